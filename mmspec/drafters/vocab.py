"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al., 2025).

Feature-level drafters reuse the target's LM head, and for a small target that head is most of a
draft step: on this CPU SmolLM2's 49152 x 576 head costs ~12 % of a whole target forward per
drafted position, the EAGLE layer itself a third of that. Drafting over the N tokens the target
actually emits most often (counted on the drafter's self-distillation data) cuts the head to
N / V of its cost:

    logits_draft = f^ W[S]^T  (S = the N most frequent token ids),  x = S[argmax or sample]

Verification still uses the full head, so decoding stays exact: a draft can only miss tokens
outside S (its q is zero there; the speculative rule's residual keeps their mass).
The vocabulary lives next to the head as ``draft_vocab.json`` (ids, most frequent first).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..modeling.fast_linear import FewRowLinear

DRAFT_VOCAB_FILE = "draft_vocab.json"


def frequent_tokens(records, size: int) -> tuple[torch.Tensor, dict[int, int]]:
    """The ``size`` most frequent learnt tokens of self-distillation records ({"ids", "learn"})
    -> (ids [size'] most frequent first, counts)."""
    counts: Counter = Counter()
    for record in records:
        counts.update(record["ids"][record["learn"]].tolist())
    return torch.tensor([token for token, _ in counts.most_common(size)], dtype=torch.long), counts


def coverage(token_ids: torch.Tensor, records) -> float:
    """Fraction of the records' learnt tokens inside the vocabulary."""
    inside = set(token_ids.tolist())
    tokens = [t for r in records for t in r["ids"][r["learn"]].tolist()]
    return sum(t in inside for t in tokens) / max(1, len(tokens))


def save_draft_vocabulary(directory: str | Path, token_ids: torch.Tensor, **card) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DRAFT_VOCAB_FILE).write_text(json.dumps({**card, "size": len(token_ids), "token_ids": token_ids.tolist()}))


def load_draft_vocabulary(directory: str | Path) -> torch.Tensor | None:
    path = Path(directory) / DRAFT_VOCAB_FILE
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long) if path.is_file() else None


class _Rows(nn.Module):
    """A draft vocabulary's rows of the LM head as a child module (``mmspec.optimize`` replaces
    children, so it reaches the linear through here)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear


class DraftLMHead:
    """The target's LM head restricted to a draft vocabulary (or the whole head when ``token_ids``
    is None). The restricted rows are copied once ([N, H]); the target's head is never changed.

    Args:
        lm_head: the target's output embedding (nn.Linear [V, H]).
        token_ids: LongTensor [N] of vocabulary ids, or None.
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor | None = None) -> None:
        self.vocab_size = lm_head.weight.shape[0]
        self.token_ids = None if token_ids is None else token_ids.to(lm_head.weight.device)
        self.weight = lm_head.weight if token_ids is None else lm_head.weight.detach()[self.token_ids].contiguous()
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else (bias if token_ids is None else bias.detach()[self.token_ids])
        #: the head itself when it is a linear over all its rows, else a module holding a linear over
        #: ``weight`` as its child (a few-row linear when the head is one, or once ``mmspec.optimize``
        #: reaches it through the drafter: its kernel, not F.linear's small-M path, for the 1-8 rows
        #: a drafting step projects, and what a fused draft chain reads)
        self.rows = None if token_ids is None and isinstance(lm_head, nn.Linear) else _Rows(self._linear_over(lm_head))
        self.head = lm_head

    def _linear_over(self, lm_head: nn.Module) -> nn.Module:
        projection = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None, device="meta")
        projection.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            projection.bias = nn.Parameter(self.bias, requires_grad=False)
        if isinstance(lm_head, FewRowLinear):
            return FewRowLinear(projection, lm_head.kernel, lm_head.max_rows, lm_head.pack, lm_head.pack_many)
        return projection

    @property
    def projection(self) -> nn.Module:
        """The linear that gives the draft logits (the target's head, or the one over ``weight``)."""
        return self.head if self.rows is None else self.rows.linear

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> draft logits [..., N] (column j is token ``tokens(j)``)."""
        return self.projection(hidden)

    def pick(self, drafter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``drafter._pick`` over draft logits [1, N] -> (token id [1], q over the vocabulary [1, V] or None)."""
        choice, q = drafter._pick(logits)
        return self.tokens(choice), None if q is None else self.full(q)

    def tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> vocabulary ids (same shape)."""
        return indices if self.token_ids is None else self.token_ids[indices]

    def full(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft distribution [..., N] -> the same distribution over the whole vocabulary [..., V]."""
        if self.token_ids is None:
            return probs
        out = probs.new_zeros((*probs.shape[:-1], self.vocab_size))
        return out.index_copy_(-1, self.token_ids, probs)
