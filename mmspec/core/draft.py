"""A draft: what a drafter proposes and an acceptance rule verifies (a linear chain of tokens, or a
token tree). Its own module so that the rules, the decoding step and the drafters all read it
without importing one another."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .continuous import FinalStep
from .tree import TokenTree


@dataclass
class Draft:
    """A linear draft, or a token tree.

    Attributes:
        tokens: LongTensor [1, k] proposed continuation (k may be 0: the step is then plain AR);
            for a tree, its N node tokens in node order.
        probs: [1, k, V] the distributions the tokens were sampled from, or None for a
            deterministic draft (q = 1 on the drafted token).
        tree: None for a linear draft; else the TokenTree proposed (build the draft with
            :meth:`from_tree`). The loop verifies it in one forward with a tree attention mask.
        trajectory: for continuous tokens (``tokens`` [1, k, D] float), the final steps of the
            drafter's diffusion chains (:class:`~mmspec.core.continuous.FinalStep` [1, k]), which
            take the place of ``probs``.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    tree: TokenTree | None = None
    trajectory: FinalStep | None = None

    @classmethod
    def from_tree(cls, tree: TokenTree) -> "Draft":
        """A tree draft (tree.tokens [N], tree.probs [N, V] or None)."""
        if tree.tokens.dim() != 1:
            raise ValueError(f"a tree draft holds one tree, tokens [N]; got shape {tuple(tree.tokens.shape)}")
        probs = None if tree.probs is None else tree.probs.unsqueeze(0)
        return cls(tokens=tree.tokens.unsqueeze(0), probs=probs, tree=tree)

    @classmethod
    def chain(cls, tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> "Draft":
        """A linear draft from its tokens drafted one by one ([1, 1] each) and the distributions
        they were drawn from ([1, V] each, or None each for a deterministic draft)."""
        return cls(tokens=torch.cat(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs[0] is not None else None)

    @property
    def length(self) -> int:
        """Tokens drafted (nodes, for a tree)."""
        return self.tokens.shape[1]


def draft_confidence(logits: torch.Tensor, q: torch.Tensor | None, token: torch.Tensor) -> float:
    """The draft's own confidence in a token it drew: q(token) under the distribution q [1, V] it
    was drawn from, or for a greedy pick (q None) the top probability of softmax(logits [1, N])."""
    if q is not None:
        return float(q[0, int(token)])
    return float(torch.softmax(logits.float(), dim=-1).max())


def chain_stops(running: float, confidence: float, stop_below: float) -> tuple[bool, float]:
    """The confidence stop of a drafted chain (a dynamic draft length): after draw i, with
    c_j = the draft's confidence in draw j (:func:`draft_confidence`),

        P_i = prod_{j <= i} c_j          (the chance, as the draft sees it, that draws 0..i all pass)

    the chain ends after draw i once P_i < ``stop_below`` (draw i is kept; 0 never stops).
    ``running`` is P_{i-1} (1.0 before the first draw). Returns (stop, P_i). On a CPU a verified row
    is not free (C(n) rises with n), so rows the target would likely reject cost more than they add."""
    if stop_below <= 0.0:
        return False, running
    running *= confidence
    return running < stop_below, running
