"""The drafter interface and the registry of drafters by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .cache import SequenceState
from .sampling import SamplingConfig, logits_to_probs, sample_from_probs
from .target import Target, TargetOutput


@dataclass
class Draft:
    """A linear draft.

    Attributes:
        tokens: LongTensor [1, k] proposed continuation (k may be 0: the step is then plain AR).
        probs: [1, k, V] the distributions the tokens were sampled from, or None for a
            deterministic draft (q = 1 on the drafted token).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftContext:
    """What a drafter is given once per generation, after the target's prefill."""

    target: Target
    sampling: SamplingConfig
    generator: torch.Generator
    model_inputs: dict[str, Any]


class Drafter(ABC):
    """Proposes tokens for the target to verify.

    Subclasses set ``name`` and implement :meth:`propose`; :meth:`start` is called once per
    generation (after the target's prefill) and :meth:`on_verified` after every verification.
    A drafter keeps only per-generation state (its own cache, counters) and resets it in start().

    Attributes:
        num_draft_tokens: maximum draft length K.
        forwards: draft network forwards in the current generation (0 for lookup drafters).
    """

    name: ClassVar[str] = "drafter"
    requires_target_hidden: ClassVar[bool] = False

    def __init__(self, num_draft_tokens: int = 4) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self.forwards = 0
        self.context: DraftContext | None = None

    def start(self, context: DraftContext, state: SequenceState) -> None:
        self.context = context
        self.forwards = 0

    @abstractmethod
    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        """Propose at most ``max_tokens`` tokens to follow ``state.tokens``."""

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Called after each verification (adaptive draft length, feature drafters)."""

    def describe(self) -> dict[str, Any]:
        """Settings shown in ``SpecStats.config``."""
        return {"drafter": self.name, "num_draft_tokens": self.num_draft_tokens}

    # helpers for drafters that run a network -------------------------------------------------
    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Choose the next draft token from logits [1, V] with the generation's sampling settings.

        Returns the token [1] and, when sampling, the draft distribution q [1, V] it was drawn from.
        """
        sampling = self.context.sampling
        if not sampling.do_sample:
            return logits.argmax(-1), None
        probs = logits_to_probs(logits, sampling)
        uniform = torch.rand(1, generator=self.context.generator, device=self.context.generator.device)
        return sample_from_probs(probs, uniform.to(probs.device)), probs


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register_drafter(name: str):
    """Class decorator: make a drafter constructible by name (``"name"`` or ``"name:arg"``)."""

    def wrap(cls):
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return wrap
