"""Prompt lookup (PLD; Saxena 2023): copy what followed the last n-gram's previous occurrence."""

from __future__ import annotations

import torch

from ..core.cache import SequenceState
from ..core.drafter import Draft, Drafter, register_drafter


def find_continuation(
    tokens: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int, prefer: str = "recent"
) -> torch.Tensor:
    """Continuation of an earlier occurrence of the longest matching suffix n-gram: the most
    recent one (``prefer="recent"``) or the first one (``"earliest"``, transformers' choice).

    Args:
        tokens: LongTensor [L] (prompt + generated so far).
        max_ngram, min_ngram: n-gram sizes tried, longest first.
        num_tokens: maximum continuation length.
    Returns:
        LongTensor [k], 0 <= k <= num_tokens (empty when no n-gram recurs).
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram that ends before the suffix does
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if starts.numel():
            begin = int(starts[-1] if prefer == "recent" else starts[0]) + n
            return tokens[begin : begin + num_tokens]
    return tokens[:0]


@register_drafter("prompt-lookup")
class PromptLookupDrafter(Drafter):
    """Training-free, deterministic (q = None): drafts are copies from the prompt and the output.

    Args:
        num_draft_tokens: K, the longest continuation copied (spec ``"prompt-lookup:K"``).
        max_ngram / min_ngram: suffix n-gram sizes searched, longest first.
    """

    def __init__(self, num_draft_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, prefer: str = "recent") -> None:
        super().__init__(num_draft_tokens)
        if prefer not in ("recent", "earliest"):
            raise ValueError(f"prefer must be 'recent' or 'earliest', got {prefer!r}")
        self.prefer = prefer
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "PromptLookupDrafter":
        k = int(arg) if arg else (num_draft_tokens or 10)
        return cls(num_draft_tokens=k)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        tokens = state.tokens[0].cpu()
        found = find_continuation(tokens, self.max_ngram, self.min_ngram, min(self.num_draft_tokens, max_tokens), self.prefer)
        return Draft(tokens=found.unsqueeze(0).to(state.tokens.device))

    def describe(self) -> dict:
        return {**super().describe(), "max_ngram": self.max_ngram, "min_ngram": self.min_ngram, "prefer": self.prefer}
