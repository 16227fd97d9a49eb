"""A MAR drafting continuous tokens for continuous speculative decoding (CSpD).

The draft model follows the target's generation order and uses, for the token at order[i], the
same chain noise noise[i] (trajectory alignment). The first ``prefill_fraction`` of the tokens come
from the target alone (CSpD's pre-filling), where a draft conditioned on almost nothing is rarely
accepted. Two ways to draft K tokens:

- sequential (the paper's): one at a time, each a forward over the committed tokens plus the
  earlier drafts, then a diffusion chain: K forwards and K chains;
- parallel (mmspec's): MAR's own k-tokens-per-step prediction, all K from the committed tokens in
  one forward and one batched chain. Speculative sampling stays exact for a proposal that ignores
  the earlier drafts: draft i is still checked against the target's p(x | committed, d_<i, E_i).
  The diffusion chain's cost is per step, not per row, so on a CPU this makes drafting K tokens
  cost about one. With the target itself as the parallel drafter ("cspd-self"), no draft model is
  needed at all.
"""

from __future__ import annotations

import math

import torch

from ..adapters.image.mar import MARTarget
from ..core.batch import BatchDrafting
from ..core.continuous import FinalStep, MaskedARState
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.target import is_continuous
from ..modeling.mar import MARModel


@register_drafter("mar-draft")
class MARDrafter(BatchDrafting, Drafter):
    """Draft continuous tokens with a smaller MAR.

    Args:
        model: the draft :class:`~mmspec.modeling.mar.MARModel` (or a ready :class:`MARTarget`),
            with the target's grid, token width and number of sampling steps.
        num_draft_tokens: gamma, tokens drafted per verification.
        prefill_fraction: share of the tokens the target generates alone first (paper: 5-15 %).
        parallel: draft all K tokens from the committed ones in one step (see the module doc).
    """

    def __init__(self, model: MARModel | MARTarget, num_draft_tokens: int = 8, prefill_fraction: float = 0.05,
                 parallel: bool = False) -> None:
        super().__init__(num_draft_tokens)
        if not 0 <= prefill_fraction < 1:
            raise ValueError(f"prefill_fraction must be in [0, 1), got {prefill_fraction}")
        self.draft = model if isinstance(model, MARTarget) else MARTarget(model)
        self.prefill_fraction = prefill_fraction
        self.parallel = parallel
        self.condition = None
        self.own_target = False  # drafting with the target itself (CSpD's self-drafting): known at start

    def start(self, context: DraftContext, state: MaskedARState) -> None:
        super().start(context, state)
        target = context.target
        self.own_target = self.draft is target or getattr(self.draft, "model", None) is getattr(target, "model", object())
        if not is_continuous(target):
            raise ValueError("mar-draft drafts continuous tokens; its target must be a continuous-token model (MAR)")
        if tuple(self.draft.noise_shape) != tuple(target.noise_shape):
            raise ValueError(f"the draft MAR's grid, token width and sampling steps {self.draft.noise_shape} must "
                             f"equal the target's {target.noise_shape}")
        self.condition = self.draft.condition(context.model_inputs)
        self.prefill_tokens = math.ceil(self.prefill_fraction * state.num_positions)

    def propose(self, state: MaskedARState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        if state.length < self.prefill_tokens or k < 1:
            return Draft(tokens=state.tokens[:, :0])
        view = state.with_condition(self.condition)
        if self.parallel:
            trajectory = self.draft.parallel_step(view, k)
            self.forwards += 1
            return Draft(tokens=trajectory.sample, trajectory=trajectory)
        steps: list[FinalStep] = []
        drafted = None
        for i in range(k):
            step = self.draft.final_steps(view, drafted, first=i).steps
            steps.append(step)
            drafted = step.sample if drafted is None else torch.cat([drafted, step.sample], dim=1)
        self.forwards += k
        trajectory = FinalStep.cat(steps)
        return Draft(tokens=trajectory.sample, trajectory=trajectory)

    def describe(self) -> dict:
        own = {"draft": "the target itself"} if self.own_target else {}
        return {**super().describe(), **own, "prefill_fraction": self.prefill_fraction, "parallel": self.parallel}
