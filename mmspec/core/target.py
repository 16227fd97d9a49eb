"""What the core needs from a target model (adapters in ``mmspec.adapters`` provide it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from .cache import SequenceState
from .tree import TokenTree


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [1, n, V] next-token logits for each of the n input positions.
        hidden_states: [R, n, H] last hidden states (before the LM head), when asked for; R = 1, or
            the rows of a classifier-free-guided image target (conditional first).
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def row(self, b: int, n: int, rows_per_item: int = 1) -> "TargetOutput":
        """Row b's first n positions of a batched output (logits [B, n', V], hidden states
        [B R, n', H]) in the batch-1 layout: logits [1, n, V], hidden states [R, n, H]."""
        hidden = None if self.hidden_states is None else self.hidden_states[b * rows_per_item : (b + 1) * rows_per_item, :n]
        return TargetOutput(self.logits[b : b + 1, :n], hidden)


class Target(Protocol):
    """A model the speculative loop can verify with.

    ``prefill`` consumes the whole prompt once (pixels, audio prompts ... are encoded here and never
    again) and returns the state plus the logits of the last prompt position ([1, 1, V]);
    ``forward`` appends ``tokens`` [1, n] to the state's cache and returns their logits; with
    ``tree`` (a :class:`~mmspec.core.tree.TokenTree` over the n tokens) the inputs form a token tree
    (tree attention mask, positions by depth) instead of a chain.
    ``hidden_layer`` asks for hidden states too: None = none, -1 = the last (the LM head's input),
    i = the output of the first i decoder layers (0 = the embeddings); a tuple of such indices
    (EAGLE-3's low / middle / high layers) returns those states concatenated on the last axis
    ([R, n, k H], in the tuple's order; :func:`select_hidden_states`).
    Rolling back is the state's job (:class:`SequenceState`), never the model's.
    A target may name the ``model_inputs`` its prefill reads in ``input_names`` (a tuple);
    ``mmspec.generate`` then refuses any other keyword before the prefill.
    """

    device: torch.device
    vocab_size: int

    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[SequenceState, TargetOutput]: ...

    def forward(
        self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None, tree: TokenTree | None = None
    ) -> TargetOutput: ...


def select_hidden_states(hidden_states: Sequence[torch.Tensor], hidden_layer: int | tuple[int, ...] | None
                         ) -> torch.Tensor | None:
    """The entry ``hidden_layer`` of transformers' ``output_hidden_states`` tuple (embeddings, then
    each layer's output) [B, n, H], or for a tuple of indices their concatenation [B, n, k H];
    None for None."""
    if hidden_layer is None:
        return None
    if isinstance(hidden_layer, tuple):
        return torch.cat([hidden_states[i] for i in hidden_layer], dim=-1)
    return hidden_states[hidden_layer]


# Optional capabilities: a target declares one by having the attribute; the core reads each
# through the helper below it, which gives the default of a target without it.


@runtime_checkable
class ContinuousTarget(Protocol):
    """A target whose tokens are continuous vectors ([1, n, D] floats, a MAR image) when
    ``continuous`` is true; the rules then take their continuous forms."""

    continuous: bool


def is_continuous(target: object) -> bool:
    """Whether ``target`` generates continuous tokens (default: False, token ids)."""
    return isinstance(target, ContinuousTarget) and bool(target.continuous)


@runtime_checkable
class NamedInputs(Protocol):
    """A target naming the ``model_inputs`` its prefill reads (``mmspec.generate`` refuses any other
    keyword before the prefill); None: it does not say."""

    input_names: tuple[str, ...] | None


def input_names(target: object) -> tuple[str, ...] | None:
    """The prefill's keywords ``target`` names, or None (default) when it names none."""
    return target.input_names if isinstance(target, NamedInputs) else None


@runtime_checkable
class StopTokens(Protocol):
    """A target with its own stop tokens (a codec LM's end-of-audio id), used when the caller names none."""

    eos_token_ids: Sequence[int]


def eos_token_ids(target: object) -> list[int]:
    """The target's own stop tokens (default: none)."""
    return list(target.eos_token_ids) if isinstance(target, StopTokens) else []


@runtime_checkable
class BoundedTarget(Protocol):
    """A target with a fixed number of positions, prompt included (a static cache, an image grid)."""

    max_length: int


def max_length(target: object) -> int | None:
    """The positions ``target`` holds, or None (default) when it is unbounded."""
    return target.max_length if isinstance(target, BoundedTarget) else None


@runtime_checkable
class RowTarget(Protocol):
    """A target that verifies several sequences in one forward (:mod:`mmspec.core.batch`).

    ``prefill_rows`` prefills each prompt (one dict of model inputs per row) and returns the
    stacked batch state (a :class:`~mmspec.core.batch.BatchState`, or another state with its
    interface) and each row's output ([1, 1, V]); ``forward_rows`` appends ``tokens`` [B, n] to
    every row and returns logits [B, n, V] (and hidden states [B R, n, H], R cache rows per
    sequence). A target whose class has these but cannot use them for a given model names why in
    ``batch_size_one_reason`` (:func:`batch_size_one_reason`).

    Other states fit the same loop when they offer ``rows``, ``ids``, ``size``, ``rows_per_item``,
    ``verification_inputs``, ``commit`` and ``keep`` (a delay-pattern codec LM's
    ``DelayBatchState``; :class:`~mmspec.core.continuous.MaskedARBatch` for continuous tokens, whose
    ``forward_rows`` takes each row's drafts and returns a ``ContinuousOutput``); the loop reads
    row b of an output with its ``row(b, n, rows_per_item)``.
    """

    device: torch.device

    def prefill_rows(self, rows: Sequence[dict[str, Any]], hidden_layer: int | None = None) -> tuple[Any, list[TargetOutput]]: ...

    def forward_rows(self, state: Any, tokens: Any, hidden_layer: int | None = None) -> TargetOutput: ...


@runtime_checkable
class RowsRefused(Protocol):
    """A target saying why it decodes one sequence at a time (None: it does not refuse)."""

    batch_size_one_reason: str | None


def batch_size_one_reason(target: object) -> str | None:
    """Why ``target`` decodes one sequence at a time although it may have row forwards, or None
    (default) when it gives no reason."""
    return (target.batch_size_one_reason or None) if isinstance(target, RowsRefused) else None


@runtime_checkable
class TreesRefused(Protocol):
    """A target saying why it cannot verify token trees, in one line with what to use instead (None:
    it verifies them). A drafter that drafts trees (``Drafter.drafts_trees``) is refused before the
    prefill (:func:`tree_refusal`)."""

    tree_refusal: str | None


def tree_refusal(target: object) -> str | None:
    """Why ``target`` cannot verify token trees, or None (default) when it gives no reason."""
    return (target.tree_refusal or None) if isinstance(target, TreesRefused) else None


@runtime_checkable
class ImageGrid(Protocol):
    """An image-token target: its tokens fill a (rows, columns) grid in raster order."""

    grid: tuple[int, int]


def image_grid(target: object) -> tuple[int, int] | None:
    """The (rows, columns) of ``target``'s token grid, or None (default) for a target without one."""
    return target.grid if isinstance(target, ImageGrid) else None


@runtime_checkable
class VisionLanguage(Protocol):
    """A target (or draft model) that says whether its prompt holds image tokens (``is_vlm``)."""

    is_vlm: bool


def sees_images(model: object) -> bool:
    """Whether ``model``'s prompt holds image tokens (default: False, a text model)."""
    return isinstance(model, VisionLanguage) and bool(model.is_vlm)


@runtime_checkable
class MultiStepTarget(Protocol):
    """A target generating several tokens per step (a delay-pattern codec LM), some of whose
    distributions are known before the step (``known_distributions``: forced or fixed tokens)."""

    def known_distributions(self, state: SequenceState) -> torch.Tensor: ...
