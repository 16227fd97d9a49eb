"""Prompt lookup (PLD; Saxena 2023): copy what followed the last n-gram's earlier occurrence."""

from __future__ import annotations

import torch

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.spec import positive_int


class NgramIndex:
    """Positions of every n-gram (n <= max_ngram) of a growing token list.

    Lookup is O(1) per step instead of a scan of the whole prompt + output, which matters for long
    prompts (a VLM prompt holds hundreds of image tokens).
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.ends[n].setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)

    def continuation(self, max_ngram: int, min_ngram: int, num_tokens: int, prefer: str = "recent") -> list[int]:
        """Up to ``num_tokens`` tokens that followed an earlier occurrence of the longest suffix
        n-gram (n from max_ngram down to min_ngram): the most recent occurrence
        (``prefer="recent"``) or the first (``"earliest"``, transformers' choice). [] if none."""
        length = len(self.tokens)
        for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
            ends = self.ends[n].get(tuple(self.tokens[length - n :]), [])[:-1]  # [-1] is the suffix itself
            if ends:
                end = ends[-1] if prefer == "recent" else ends[0]
                return self.tokens[end + 1 : end + 1 + num_tokens]
        return []


@register_drafter("prompt-lookup")
class PromptLookupDrafter(BatchDrafting, Drafter):
    """Training-free, deterministic (q = None): drafts are copies from the prompt and the output.

    Args:
        num_draft_tokens: K, the longest continuation copied (spec ``"prompt-lookup:K"``).
        max_ngram / min_ngram: suffix n-gram sizes searched, longest first.
        prefer: which earlier occurrence to copy from, "recent" or "earliest".
    """

    spec_argument = "num_draft_tokens"

    def __init__(self, num_draft_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, prefer: str = "recent") -> None:
        super().__init__(num_draft_tokens)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if prefer not in ("recent", "earliest"):
            raise ValueError(f"prefer must be 'recent' or 'earliest', got {prefer!r}")
        self.max_ngram, self.min_ngram, self.prefer = max_ngram, min_ngram, prefer
        self.index = NgramIndex(max_ngram)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "PromptLookupDrafter":
        k = positive_int(arg, "prompt-lookup's num_draft_tokens") if arg else (num_draft_tokens or 10)
        return cls(num_draft_tokens=k)

    def start(self, context: DraftContext, state: SequenceState) -> None:
        super().start(context, state)
        self.index = NgramIndex(self.max_ngram)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        if state.length < len(self.index.tokens):  # the sequence was rolled back: re-index
            self.index = NgramIndex(self.max_ngram)
        self.index.extend(state.tokens[0, len(self.index.tokens) :].tolist())
        found = self.index.continuation(self.max_ngram, self.min_ngram, min(self.num_draft_tokens, max_tokens), self.prefer)
        return Draft(tokens=torch.tensor([found], dtype=state.tokens.dtype, device=state.tokens.device).view(1, -1))

    def describe(self) -> dict:
        return {**super().describe(), "max_ngram": self.max_ngram, "min_ngram": self.min_ngram, "prefer": self.prefer}
