"""The drafter interface and the registry of drafters by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from .cache import SequenceState
from .draft import Draft
from .registry import class_registrar
from .sampling import SamplingConfig, logits_to_probs, sample_from_probs
from .target import Target, TargetOutput
from .verify import exact_argmax

if TYPE_CHECKING:
    from .rules import AcceptanceRule


@dataclass
class DraftContext:
    """What a drafter is given once per generation, after the target's prefill (``rule``: the
    acceptance rule that will verify its drafts; None means exact)."""

    target: Target
    sampling: SamplingConfig
    generator: torch.Generator
    model_inputs: dict[str, Any]
    rule: AcceptanceRule | None = None

    @property
    def output_follows_draft(self) -> bool:
        """Whether what is drafted can change the output: under sampling (the draft decides which
        random numbers are drawn) or with a lossy rule (it accepts drafted tokens the target would
        not have chosen). Exact greedy decoding gives the target's tokens whatever is drafted."""
        return self.sampling.do_sample or (self.rule is not None and not self.rule.lossless)


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
    #: proposes token trees at batch size 1 (``Draft.from_tree``): a target that cannot verify trees
    #: (its ``tree_refusal``, e.g. recurrent layers) refuses the drafter before its prefill
    drafts_trees: ClassVar[bool] = False
    #: the key that a spec's short-form value stands for (``"layer-skip:8"`` is
    #: ``"layer-skip:layers=8"``), for drafters named by a spec (``from_spec``)
    spec_argument: ClassVar[str] = "arg"
    #: drafts only a text-to-image model's image tokens (a GuidedImageTarget): no spec names it
    #: for a text LM or a VLM (:func:`mmspec.drafters.spec_drafter_names`)
    image_tokens_only: ClassVar[bool] = False
    #: which target hidden state on_verified receives when requires_target_hidden: -1 = the last
    #: (the LM head's input), i = the output of the first i decoder layers; a tuple of such
    #: indices: those states concatenated (EAGLE-3)
    target_hidden_layer: int | tuple[int, ...] = -1
    #: a drafter with trained weights in a directory (its spec's argument): the layouts such a
    #: directory may have, each the files it holds (checked before any model loads:
    #: :func:`mmspec.drafters.check_drafter_dir`); empty: no directory
    saved_layouts: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: reads a transformers LM's own parts (its embeddings, layers, LM head): named by a spec only
    #: for a :class:`~mmspec.adapters.hf.TransformersTarget` (:func:`mmspec.drafters.resolve_drafter`)
    needs_transformers_target: ClassVar[bool] = False
    #: the command that trains such a directory (None: ``mmspec train drafter --method NAME``)
    trained_by: ClassVar[str | None] = None

    @classmethod
    def check_spec_argument(cls, argument: str | None) -> None:
        """Refuse a spec argument (``"NAME:ARG"``) that :meth:`from_spec` would refuse, before any
        model loads (one ValueError line); the default checks nothing."""

    @classmethod
    def holds_saved(cls, directory: Path) -> bool:
        """Whether ``directory`` holds one of :attr:`saved_layouts` (all of its files)."""
        return any(all((directory / file).is_file() for file in layout) for layout in cls.saved_layouts)

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
        """Propose at most ``max_tokens`` tokens to follow ``state.tokens`` (for a tree: a depth of
        at most ``max_tokens``; the loop never commits more than the budget either way)."""

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Called after each verification (adaptive draft length, feature drafters).

        For a linear draft ``target_output`` covers [pending, d_1 .. d_K]. For a tree it covers
        [pending, accepted path] (num_accepted + 1 rows, the rows of the other nodes dropped), so a
        feature drafter sees the same layout in both cases; ``num_drafted`` is the node count.
        """

    def on_tree_verified(self, path: torch.Tensor, tree_output: TargetOutput) -> None:
        """Called after a tree draft's verification, before :meth:`on_verified`, with the accepted
        path (node indices [num_accepted]) and the whole forward [root, node_0 .. node_{N-1}]
        (``tree_output.logits`` [1, N + 1, V]), for drafters that reuse the rows of nodes off the
        accepted path (SJD-PAC's carried drafts)."""

    def describe(self) -> dict[str, Any]:
        """Settings shown in ``SpecStats.config``."""
        return {"drafter": self.name, "num_draft_tokens": self.num_draft_tokens}

    # helpers for drafters that run a network -------------------------------------------------
    def _pick(self, logits: torch.Tensor, sampling: SamplingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Choose one draft token per row of logits [n, V] with ``sampling`` (default: the
        generation's settings).

        Returns the tokens [n] and, when sampling, the draft distributions q [n, V] they were drawn from.
        """
        sampling = self.context.sampling if sampling is None else sampling
        if not logits.shape[0]:  # (nothing to draw: no tensor work)
            return logits.new_empty(0, dtype=torch.long), logits.new_empty(logits.shape, dtype=torch.float32) if sampling.do_sample else None
        if not sampling.do_sample:
            return exact_argmax(logits), None
        probs = logits_to_probs(logits, sampling)
        uniforms = torch.rand(logits.shape[0], dtype=torch.float32, generator=self.context.generator, device=self.context.generator.device)
        return sample_from_probs(probs, uniforms.to(probs.device)), probs


DRAFTERS: dict[str, type[Drafter]] = {}

_register = class_registrar(DRAFTERS, "drafter")


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter constructible by name (``"name"`` or ``"name:arg"``); a
    name already taken is refused (ValueError), as in every registry of
    :func:`~mmspec.core.registry.class_registrar`."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        cls.name = name
        return _register(cls)

    return wrap
