"""Drafting from the target's own known distributions, for targets whose steps emit several tokens
from one forward (the delay-pattern codec LMs of :mod:`mmspec.adapters.audio.delay`).

:class:`StepCompletionDrafter` proposes the rest of the current step, drawn from the target's
distributions there (argmax under greedy decoding), which the target already computed: with
q = p every rule accepts them (speculative sampling: min(1, p/q) = 1), so a generation is plain
decoding that runs the model once per step and commits a whole step per loop iteration, instead
of one loop iteration per codebook. It is the ``ar`` method of the text-to-speech pipeline.
"""

from __future__ import annotations

from ..core.cache import SequenceState
from ..core.drafter import Draft, Drafter, register_drafter


@register_drafter("step-completion")
class StepCompletionDrafter(Drafter):
    """Needs a target with ``known_distributions(state) -> logits [n, V]``."""

    name = "step-completion"

    def __init__(self) -> None:
        super().__init__(num_draft_tokens=1)

    def start(self, context, state: SequenceState) -> None:
        if not hasattr(context.target, "known_distributions"):
            raise ValueError(f"the step-completion drafter needs a multi-token-step target (a delay-pattern codec LM), "
                             f"not {type(context.target).__name__}")
        super().start(context, state)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        tokens, probs = self._pick(self.context.target.known_distributions(state)[:max_tokens])
        return Draft(tokens=tokens[None], probs=None if probs is None else probs[None])
