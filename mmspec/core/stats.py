"""SpecStats: what every generation reports about its own speed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

import torch


class DictAccess:
    """Attribute *and* dict access for output dataclasses (``out.stats`` and ``out["stats"]``);
    :meth:`to_dict` gives a JSON-serialisable dict."""

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def keys(self):
        """The fields' names (and what a subclass's :meth:`to_dict` adds: its extra names)."""
        return [f.name for f in fields(self)] + list(self.extra_keys)

    #: names :meth:`to_dict` adds to the fields' (computed figures)
    extra_keys: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-serialisable: nested outputs and stats as their ``to_dict()``, tensors
        as nested lists (:func:`json_ready`); images as :meth:`json_value` makes them."""
        return {f.name: self.json_value(getattr(self, f.name)) for f in fields(self)}

    def json_value(self, value: Any) -> Any:
        """A field's value made JSON-serialisable (:func:`json_ready`; an output holding other
        values, such as images, converts them here)."""
        return json_ready(value, self.json_value)


def json_ready(value: Any, inner=None) -> Any:
    """``value`` with :class:`DictAccess` outputs as their ``to_dict()``, other dataclasses as
    dicts, tensors as nested lists (``tolist()``), tuples as lists; dicts and lists converted item
    by item (through ``inner``, default this function)."""
    inner = inner or json_ready
    if isinstance(value, DictAccess):
        return value.to_dict()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: inner(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: inner(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [inner(item) for item in value]
    return value


@dataclass
class SpecStats(DictAccess):
    """Counters of one speculative generation.

    tau (``mean_accepted_length``) = tokens committed per verification step, counting the
    bonus/corrected token: plain AR decoding has tau = 1.0, a drafter whose K drafts are always
    accepted has tau = K + 1. The prefill yields the first token and is counted in
    ``target_forwards`` but is not a verification step.

    Attributes:
        method: the drafter/rule that produced the tokens ("ar", "prompt-lookup", ...).
        new_tokens: tokens generated (excluding the prompt).
        target_forwards: target forward passes (prefill + one per verification).
        verify_steps: verification steps (target forwards after the prefill).
        draft_forwards: forward passes of a draft network (0 for lookup drafters).
        drafted: draft tokens proposed in total (for a token tree: its depth, the most it could add).
        accepted: draft tokens accepted and kept in total (drafts the rule accepted past a stop
            token or the token budget are not kept, so not counted).
        tree_nodes: tree nodes verified in total (0 without token trees).
        drafted_per_position / accepted_per_position: counts per draft index (0 = first draft).
        committed_per_step: tokens committed by each verification step, in order (the prefill's
            first token is not listed), so token i's step is recoverable (see :meth:`step_of_token`).
        wall_time_s: wall time of the whole call (prefill included).
        prefill_time_s: of which the prefill (a VLM's image encoding included) and the first token:
            what no drafter can shorten (one generation's; None for a batch's totals).
        draft_time_s: of which in the drafter (proposing, and updating itself after each
            verification); host time (on CUDA, kernels still queued are not counted).
        speedup: baseline wall time / this wall time, when a baseline ran in the same call.
        rows: sequences counted (B for a batch's totals, :func:`mmspec.core.batch.batch_stats`:
            each row's first token comes from its prefill, not from a verification step).
        prefill_tokens: tokens the first forward committed where that is not one a row (MAR's
            parallel decoding: its first step's); None = ``rows``.
        config: the method's chosen settings (draft length, rule, ...).
    """

    method: str = "ar"
    new_tokens: int = 0
    target_forwards: int = 0
    verify_steps: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    tree_nodes: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    committed_per_step: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    prefill_time_s: float | None = None
    draft_time_s: float = 0.0
    speedup: float | None = None
    rows: int = 1
    prefill_tokens: int | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens committed per verification step (AR = 1.0, all-accepted K drafts = K + 1):
        (new_tokens - the prefill's) / verify_steps."""
        if not self.verify_steps:
            return float(self.new_tokens)
        return (self.new_tokens - (self.rows if self.prefill_tokens is None else self.prefill_tokens)) / self.verify_steps

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0.0 if nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Acceptance rate of the i-th draft token, given that it was proposed."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def draft_ms_per_step(self) -> float:
        """Drafting time per verification step, in milliseconds."""
        return 1000 * self.draft_time_s / self.verify_steps if self.verify_steps else 0.0

    def step_of_token(self) -> list[int]:
        """For each generated token, the verification step that committed it (0 = the prefill)."""
        steps = [0] if self.new_tokens else []
        for step, count in enumerate(self.committed_per_step, start=1):
            steps.extend([step] * count)
        return steps

    def record_step(self, num_drafted: int, num_accepted: int, num_committed: int | None = None) -> None:
        """Count one verification of ``num_drafted`` drafts of which ``num_accepted`` survived and
        ``num_committed`` tokens (default num_accepted + 1) were kept."""
        self.committed_per_step.append(num_accepted + 1 if num_committed is None else num_committed)
        self.target_forwards += 1
        self.verify_steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        if num_drafted > len(self.drafted_per_position):
            grow = num_drafted - len(self.drafted_per_position)
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    extra_keys = ("mean_accepted_length", "acceptance_rate", "acceptance_per_position", "tokens_per_second",
                  "draft_ms_per_step")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_per_position=self.acceptance_per_position,
            tokens_per_second=self.tokens_per_second,
            draft_ms_per_step=self.draft_ms_per_step,
        )
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """One line for humans."""
        line = (
            f"{self.method}: {self.new_tokens} tokens in {self.wall_time_s:.2f}s "
            f"({self.tokens_per_second:.1f} tok/s), tau {self.mean_accepted_length:.2f}, "
            f"acceptance {self.acceptance_rate:.0%}, {self.target_forwards} target forwards"
        )
        if self.draft_time_s:
            line += f", drafting {self.draft_ms_per_step:.1f} ms/step ({self.draft_time_s / self.wall_time_s:.0%})"
        if self.speedup is not None:
            line += f", speedup {self.speedup:.2f}x"
        return line
