"""Speculative Jacobi decoding (SJD, Teng et al., ICLR 2025) and its coupled variant, as drafters.

SJD needs no draft model: the target's own previous forward is the draft. Each step the target
runs on [pending token, d_1 .. d_K] (K = the window L, 16 by default); the loop verifies d_i with
the speculative-sampling rule against q_i, the distribution d_i was sampled from one iteration
earlier (P_{t-1}), i.e. accept iff r < min(1, P_t(d_i) / P_{t-1}(d_i)), and on the first rejection
resamples from norm(max(0, P_t - P_{t-1})) — exactly :func:`~mmspec.core.verify.speculative_verify`.
Afterwards (:meth:`on_verified`) the forward's outputs past the accepted prefix become the next
iteration's drafts: d'_j ~ P_t(. | position j), with q'_j = P_t. New positions at the end of the
window are initialised without a model (q = 1 on the chosen token, so they are accepted with
probability P_t(x)):

* ``random``: a uniformly random code;
* ``horizontal``: a copy of the token to the left;
* ``vertical``: a copy of the token one row up (needs the grid width; the target's ``grid``).

Coupled SJD (``coupled=True``; maximal coupling of consecutive iterates, as in SCD / MC-SJD): the
redraft at a position that already held a draft x ~ q keeps x with probability
min(1, P_t(x) / q(x)) and otherwise draws from norm(max(0, P_t - q)). Its marginal is still P_t,
so verification stays exact, but drafts stop churning once the iterates agree.

With ``do_sample=False`` drafts are the argmaxes (Jacobi decoding) and greedy verification makes
the output identical to AR decoding.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.cache import SequenceState
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.sampling import logits_to_probs, sample_from_probs
from ..core.target import TargetOutput

INIT_STRATEGIES = ("random", "horizontal", "vertical")


def coupled_redraft(old_tokens: torch.Tensor, old_probs: torch.Tensor, new_probs: torch.Tensor,
                    uniforms: torch.Tensor) -> torch.Tensor:
    """Maximal coupling of q (old) and p (new): keep x ~ q with probability min(1, p(x)/q(x)), else
    draw from norm(max(0, p - q)). The result is distributed as p.

    Args:
        old_tokens: LongTensor [m] tokens drawn from old_probs.
        old_probs, new_probs: [m, V] the distributions q and p.
        uniforms: [m, 2] uniforms (keep test, residual draw).
    Returns:
        LongTensor [m].
    """
    p_x = new_probs.gather(-1, old_tokens[:, None])[:, 0]
    q_x = old_probs.gather(-1, old_tokens[:, None])[:, 0]
    keep = uniforms[:, 0] * q_x < p_x  # r < p(x) / q(x), without dividing by q(x) = 0
    residual = (new_probs - old_probs).clamp_min(0)
    empty = residual.sum(-1) <= 0  # p == q: nothing to correct, any draw from p is exact
    residual = torch.where(empty[:, None], new_probs, residual)
    redrawn = sample_from_probs(residual, uniforms[:, 1])
    return torch.where(keep, old_tokens, redrawn)


@register_drafter("sjd")
class JacobiDrafter(Drafter):
    """Args:
        num_draft_tokens: the window L (tokens verified per forward).
        init: how new window positions are initialised, one of :data:`INIT_STRATEGIES`.
        coupled: redraft with the maximal coupling of consecutive iterates.
        grid_width: tokens per image row (``vertical`` init); default: the target's ``grid``.
    """

    def __init__(self, num_draft_tokens: int = 16, init: str = "random", coupled: bool = False,
                 grid_width: int | None = None) -> None:
        super().__init__(num_draft_tokens)
        if init not in INIT_STRATEGIES:
            raise ValueError(f"unknown SJD init {init!r}; choose one of {INIT_STRATEGIES}")
        self.init, self.coupled, self.grid_width = init, coupled, grid_width
        self.carried_tokens: torch.Tensor | None = None
        self.carried_probs: torch.Tensor | None = None
        self.last_draft: Draft | None = None

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "JacobiDrafter":
        """``"sjd"``, ``"sjd:vertical"``, ``"sjd:horizontal"``, ``"sjd:random"``."""
        return cls(num_draft_tokens or 16, init=arg or "random")

    def start(self, context: DraftContext, state: SequenceState) -> None:
        super().start(context, state)
        self.carried_tokens = state.tokens.new_empty(0)
        self.carried_probs = None
        self.last_draft = None
        if self.grid_width is None and self.init == "vertical":
            grid = getattr(context.target, "grid", None)
            if grid is None:
                raise ValueError("SJD's vertical init needs the image grid width: pass grid_width=... "
                                 "or use a target with a `grid` (an image-token model)")
            self._width = grid[1]
        else:
            self._width = self.grid_width

    def _fresh(self, known: torch.Tensor, count: int, vocab_size: int, device) -> torch.Tensor:
        """``count`` initial tokens to follow the generated tokens ``known`` [m] (1-D)."""
        if self.init == "random":
            u = torch.rand(count, generator=self.context.generator, device=self.context.generator.device)
            return (u * vocab_size).long().clamp_(max=vocab_size - 1).to(device)
        sequence = known.tolist()
        for _ in range(count):
            if self.init == "vertical" and len(sequence) >= self._width:
                sequence.append(sequence[-self._width])
            else:
                sequence.append(sequence[-1] if sequence else 0)
        return torch.tensor(sequence[len(known):], dtype=torch.long, device=device)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        carried = self.carried_tokens[:k]
        known = torch.cat([state.new_tokens[0], carried.to(state.tokens.device)])
        vocab = self.context.target.vocab_size
        fresh = self._fresh(known, k - carried.shape[0], vocab, state.tokens.device)
        tokens = torch.cat([carried.to(state.tokens.device), fresh]).unsqueeze(0)
        probs = None
        if self.context.sampling.do_sample:
            fresh_probs = torch.nn.functional.one_hot(fresh, vocab).float()
            parts = [fresh_probs] if self.carried_probs is None else [self.carried_probs[:k].to(fresh_probs.device), fresh_probs]
            probs = torch.cat(parts).unsqueeze(0)
        self.last_draft = Draft(tokens=tokens, probs=probs)
        return self.last_draft

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        # rows num_accepted + 1 .. K of the forward predict the positions after the committed token
        logits = target_output.logits[0, num_accepted + 1 : num_drafted + 1]
        sampling = self.context.sampling
        if not sampling.do_sample:
            self.carried_tokens, self.carried_probs = logits.argmax(-1), None
            return
        new_probs = logits_to_probs(logits, sampling)
        m = new_probs.shape[0]
        gen = self.context.generator
        if self.coupled and m:
            # rows j < K had a draft at their position: draft token j of the verified window
            old = m - 1  # the last row predicts a position the window did not reach
            uniforms = torch.rand(m, 2, generator=gen, device=gen.device).to(new_probs.device)
            old_tokens = self.last_draft.tokens[0, num_accepted + 1 :].to(new_probs.device)
            old_probs = self.last_draft.probs[0, num_accepted + 1 :].to(new_probs.device)
            tokens = torch.empty(m, dtype=torch.long, device=new_probs.device)
            tokens[:old] = coupled_redraft(old_tokens, old_probs, new_probs[:old], uniforms[:old])
            tokens[old:] = sample_from_probs(new_probs[old:], uniforms[old:, 1])
        else:
            uniforms = torch.rand(m, generator=gen, device=gen.device).to(new_probs.device)
            tokens = sample_from_probs(new_probs, uniforms)
        self.carried_tokens, self.carried_probs = tokens, new_probs

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "window": self.num_draft_tokens, "init": self.init, "coupled": self.coupled}


@register_drafter("sjd-coupled")
class CoupledJacobiDrafter(JacobiDrafter):
    """Coupled SJD by name: ``"sjd-coupled[:init]"``."""

    def __init__(self, num_draft_tokens: int = 16, init: str = "random", grid_width: int | None = None) -> None:
        super().__init__(num_draft_tokens, init=init, coupled=True, grid_width=grid_width)
