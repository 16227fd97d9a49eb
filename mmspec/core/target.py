"""What the core needs from a target model (adapters in ``mmspec.adapters`` provide it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
    i = the output of the first i decoder layers (0 = the embeddings).
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
