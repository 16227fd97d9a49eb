"""Drafting from the target's own known distributions, for targets whose steps emit several tokens
from one forward (the delay-pattern codec LMs of :mod:`mmspec.adapters.audio.delay`).

:class:`StepCompletionDrafter` proposes the rest of the current step, drawn from the target's
distributions there (argmax under greedy decoding), which the target already computed: with
q = p every rule accepts them (speculative sampling: min(1, p/q) = 1), so a generation is plain
decoding that runs the model once per step and commits a whole step per loop iteration, instead
of one loop iteration per codebook. It is the ``ar`` method of the text-to-speech pipeline.

:class:`StepAwareDrafter` is a draft model's drafter that does the same first: after a rejection
inside a step, the rest of that step is known to the target (q = p, always accepted), so only the
following steps come from the draft model (which would otherwise guess the known codes and lose
some of them).
"""

from __future__ import annotations

import torch

from ..core.cache import SequenceState
from ..core.drafter import Draft, Drafter, register_drafter
from .model import ModelDrafter


def _needs_steps(context) -> None:
    if not hasattr(context.target, "known_distributions"):
        raise ValueError(f"this drafter needs a multi-token-step target (a delay-pattern codec LM), "
                         f"not {type(context.target).__name__}")


@register_drafter("step-completion")
class StepCompletionDrafter(Drafter):
    """Needs a target with ``known_distributions(state) -> logits [n, V]``."""

    name = "step-completion"

    def __init__(self) -> None:
        super().__init__(num_draft_tokens=1)

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        super().start(context, state)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        tokens, probs = self._pick(self.context.target.known_distributions(state)[:max_tokens])
        return Draft(tokens=tokens[None], probs=None if probs is None else probs[None])


@register_drafter("step-aware")
class StepAwareDrafter(ModelDrafter):
    """A draft codec LM's drafter (arguments of :class:`~mmspec.drafters.model.ModelDrafter`):
    the current step's known codes first (q = p), then the draft model's, ``num_draft_tokens`` in all."""

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        super().start(context, state)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        known, known_q = self._pick(self.context.target.known_distributions(state)[:k])
        if known.shape[0] == k:
            return Draft(tokens=known[None], probs=None if known_q is None else known_q[None])
        more = self.continue_after(torch.cat([state.new_tokens, known[None].to(state.new_tokens.device)], dim=1),
                                   k - known.shape[0])
        tokens = torch.cat([known[None].to(more.tokens.device), more.tokens], dim=1)
        if more.probs is None:
            return Draft(tokens=tokens)
        return Draft(tokens=tokens, probs=torch.cat([known_q[None].to(more.probs), more.probs], dim=1))


@register_drafter("codec-medusa")
class CodecMedusaDrafter(Drafter):
    """Medusa heads (:class:`~mmspec.modeling.heads.DraftHeads`, kind "medusa") on a delay-pattern
    codec LM whose K output heads are one linear (``get_output_embeddings``, the embedded
    :class:`~mmspec.modeling.codec_lm.CodecLM`), drafting a chain.

    With f the target's last hidden state at the last verified position (the state whose heads
    gave step a, the pending token's step), Medusa head i = 0..M-1 gives step a + 1 + i:
    logits_i = Heads(f + SiLU(W_i f + b_i)) [K, C + 1]. The draft is the rest of step a from the
    target's known distributions (q = p), then steps a + 1, a + 2, ... from the heads, codebook by
    codebook; drawn from the heads' distributions under sampling (q = theirs: exact), their argmax
    under greedy decoding. A tree (Medusa's, VADUSA's sparse one) does not fit the delay layout
    (:class:`~mmspec.adapters.audio.delay.DelayPatternTarget` refuses trees), so the chain is
    Medusa's top-1 path.
    """

    requires_target_hidden = True

    def __init__(self, heads, num_draft_tokens: int | None = None) -> None:
        super().__init__(num_draft_tokens or 1)
        self.heads = heads
        self.fixed_length = num_draft_tokens
        self.feature: torch.Tensor | None = None

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        output = getattr(context.target.model, "get_output_embeddings", lambda: None)()
        if output is None or output.in_features != self.heads.hidden_size:
            raise ValueError(f"codec Medusa heads need a codec LM whose heads are one linear of width "
                             f"{self.heads.hidden_size} (the embedded CodecLM)")
        super().start(context, state)
        self.output, self.feature = output, None
        k = context.target.num_codebooks
        self.num_draft_tokens = self.fixed_length or k - 1 + self.heads.num_heads * k

    def on_verified(self, num_drafted: int, num_accepted: int, target_output) -> None:
        self.feature = target_output.hidden_states[0, -1 if self.feature is None and not num_drafted else num_accepted]

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        target, k = self.context.target, self.context.target.num_codebooks
        limit = min(self.num_draft_tokens, max_tokens)
        known, known_q = self._pick(target.known_distributions(state)[:limit])
        steps = -(-(limit - known.shape[0]) // k)  # whole steps still wanted, at most one per head
        if steps <= 0:
            return Draft(tokens=known[None], probs=None if known_q is None else known_q[None])
        states = torch.stack([self.heads.head_state(i, self.feature) for i in range(min(steps, self.heads.num_heads))])
        self.forwards += 1
        guesses = self.output(states).view(states.shape[0], k, -1)
        first = (state.length - 1) // k + 1  # the step after the pending token's
        tokens, probs = self._pick(target.draft_logits(state, first, guesses)[: limit - known.shape[0]])
        tokens = torch.cat([known, tokens.to(known.device)])[None]
        return Draft(tokens=tokens, probs=None if probs is None else torch.cat([known_q, probs.to(known_q)])[None])

    def describe(self) -> dict:
        return {**super().describe(), "heads": self.heads.num_heads, "tree": "chain"}
