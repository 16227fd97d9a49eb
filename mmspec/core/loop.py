"""The speculative decoding loop: draft -> verify -> commit -> roll back.

Plain AR decoding is the same loop with no drafter (K = 0 every step), so the baseline and every
method share one KV cache implementation and one sampling path.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from .cache import SequenceState
from .drafter import DraftContext, Drafter
from .rules import AcceptanceRule, resolve_rule
from .sampling import SamplingConfig
from .stats import SpecStats
from .step import (append_tokens, empty_draft, finish_stats, first_token, settle, start_drafter, truncate_at_stop,
                   uniforms, verify_chain, verify_tree)
from .target import Target, is_continuous, tree_refusal

#: the step's functions under their former private names (:mod:`mmspec.core.step`)
_uniforms, _truncate_at_stop, _tree_step = uniforms, truncate_at_stop, verify_tree


def speculative_decode(
    target: Target,
    model_inputs: dict[str, Any],
    drafter: Drafter | None,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    acceptance: str | AcceptanceRule | None = None,
    rule_kwargs: dict[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
    *,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[SequenceState, SpecStats]:
    """Generate up to ``max_new_tokens`` tokens for one prompt.

    Args:
        target: the verifying model (see :class:`~mmspec.core.target.Target`).
        model_inputs: the prompt as the target's prefill expects it (input_ids, pixel_values, ...).
        drafter: proposer of draft tokens (a linear draft or a token tree, see
            :class:`~mmspec.core.draft.Draft`), or None for plain AR decoding.
        sampling: one transform for draft and target.
        max_new_tokens: hard cap on generated tokens.
        eos_token_ids: generation stops after the first of these (the EOS is kept).
        generator: source of every random number of the generation.
        acceptance: a rule of :data:`mmspec.core.rules.RULES` by name ("greedy", "speculative",
            "block", "typical", "lantern", "lantern++", "gsd", ...), "auto"/None (greedy or block
            verification by ``sampling``), or an :class:`~mmspec.core.rules.AcceptanceRule` instance.
        rule_kwargs: the named rule's parameters (the fields of its ``Params``).
        on_step: called with the number of tokens generated so far after every verification step.
        on_tokens: called with the tokens [1, m] committed, after the first token and after every
            verification step (streaming).
        cancelled: called before every step; True stops the generation there (the tokens so far
            are returned, ``stats.config["cancelled"]`` is True).
    Returns:
        The final state (``state.tokens`` is [1, prompt + new]) and the statistics.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    refusal = tree_refusal(target) if drafter is not None and drafter.drafts_trees else None
    if refusal:  # before the prefill (a VLM's image encoding)
        raise ValueError(refusal)
    rule = resolve_rule(acceptance, sampling, rule_kwargs, continuous=is_continuous(target))
    if generator is None:
        generator = torch.Generator(device=target.device)
    eos = frozenset(int(t) for t in eos_token_ids)
    stats = SpecStats(method=drafter.name if drafter else "ar", config=rule.describe())
    started = time.perf_counter()

    with torch.inference_mode():
        # 1. Prefill: the target consumes the whole prompt once; its last logits give token 1.
        hidden_layer = drafter.target_hidden_layer if drafter is not None and drafter.requires_target_hidden else None
        state, prefill_out = target.prefill(model_inputs, hidden_layer=hidden_layer)
        stats.target_forwards = 1
        first = first_token(rule, prefill_out, state.tokens, sampling, generator, eos, max_new_tokens)
        first.record(stats, None)
        stats.prefill_time_s = time.perf_counter() - started
        done = first.done
        state.tokens = append_tokens(state.tokens, first.committed)
        generated = 1
        if on_tokens is not None:
            on_tokens(first.committed)
        if drafter is not None:
            start_drafter(drafter, DraftContext(target, sampling, generator, model_inputs, rule), state, prefill_out, stats)

        while not done:
            if cancelled is not None and cancelled():
                stats.config["cancelled"] = True
                break
            # 2. Draft at most what the token budget can still use (the bonus token is free).
            budget = max_new_tokens - generated - 1
            if drafter is not None and budget > 0:
                drafting = time.perf_counter()
                draft = drafter.propose(state, budget)
                stats.draft_time_s += time.perf_counter() - drafting
            else:
                draft = empty_draft(state.tokens)
            k = draft.length
            if draft.tree is None:
                # 3. Verify: one target forward over [pending token, d_1 .. d_K] gives K+1 distributions.
                out = target.forward(state, state.verification_inputs(draft.tokens), hidden_layer=hidden_layer)
                verification = verify_chain(rule, draft, out, sampling, generator)
                positions = k
            else:
                # 3'. A token tree: one forward with the tree attention mask, then walk the tree.
                verification, out, tree_out = verify_tree(rule, target, state, draft, sampling, generator, hidden_layer)
                positions = draft.tree.max_depth
                stats.tree_nodes += k
            # 4. Stop at EOS / the budget exactly where AR decoding would have stopped.
            step = settle(verification, eos, max_new_tokens - generated)
            path = None if draft.tree is None else verification.path[0, : step.num_accepted]
            done = step.done
            # 5. Commit and roll back everything the rejected drafts left in the state.
            state.commit(step.committed.to(state.tokens), path=path)
            generated += step.length
            step.record(stats, positions)
            if on_tokens is not None:
                on_tokens(step.committed)
            if on_step is not None:
                on_step(generated)
            if drafter is not None:
                drafting = time.perf_counter()
                if draft.tree is not None:
                    drafter.on_tree_verified(path, tree_out)
                drafter.on_verified(k, step.num_accepted, out)
                stats.draft_time_s += time.perf_counter() - drafting

    finish_stats(stats, drafter, generated, started)
    return state, stats
