"""The speculative decoding loop: draft -> verify -> commit -> roll back.

Plain AR decoding is the same loop with no drafter (K = 0 every step), so the baseline and every
method share one KV cache implementation and one sampling path.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from .cache import SequenceState
from .drafter import Draft, DraftContext, Drafter
from .rules import AcceptanceRule, resolve_rule
from .sampling import SamplingConfig
from .stats import SpecStats
from .target import Target, TargetOutput
from .verify import TreeVerification


def _uniforms(generator: torch.Generator, sampling: SamplingConfig, n: int, device: torch.device) -> torch.Tensor | None:
    """[1, n + 1] U(0, 1) for a draft of n tokens / tree nodes (one per draft, one for the corrected or
    bonus token), drawn on the generator's device; None under greedy decoding, which draws nothing."""
    if not sampling.do_sample:
        return None
    return torch.rand(1, n + 1, generator=generator, device=generator.device).to(device)


def _tree_step(
    rule: AcceptanceRule,
    target: Target,
    state: SequenceState,
    draft: Draft,
    sampling: SamplingConfig,
    generator: torch.Generator,
    hidden_layer: int | None,
) -> tuple[TreeVerification, TargetOutput, TargetOutput]:
    """Verify a tree draft: one target forward over [pending, node_0 .. node_{N-1}] with the tree
    attention mask, then the rule's tree form. Draws N + 1 uniforms like a linear draft of N tokens
    (a chain-shaped tree consumes the same numbers and gives the same tokens).

    Returns:
        The verification, the target output restricted to [pending, accepted path], and the whole
        output [root, node_0 .. node_{N-1}].
    """
    tree = draft.tree
    rooted = tree.prepend_root(state.tokens[0, -1])
    out = target.forward(state, rooted.tokens.to(state.tokens.device).unsqueeze(0), hidden_layer=hidden_layer, tree=rooted)
    verification = rule.verify_tree(tree, out.logits, sampling, _uniforms(generator, sampling, tree.size, out.logits.device))
    rows = torch.cat([verification.path.new_zeros(1), verification.path[0, : int(verification.num_accepted[0])] + 1])
    hidden = None if out.hidden_states is None else out.hidden_states[:, rows]
    return verification, TargetOutput(out.logits[:, rows], hidden), out


def _truncate_at_stop(new_tokens: torch.Tensor, eos_token_ids: frozenset[int], budget: int) -> tuple[torch.Tensor, bool]:
    """Cut a step's tokens [1, n] (or continuous [1, n, D]) at the first EOS (kept, as transformers
    does) and at the token budget; also say whether generation is done."""
    kept = new_tokens[:, :budget]
    if eos_token_ids and kept.dim() == 2:
        for i, token in enumerate(kept[0].tolist()):
            if token in eos_token_ids:
                return kept[:, : i + 1], True
    return kept, new_tokens.shape[1] >= budget


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
) -> tuple[SequenceState, SpecStats]:
    """Generate up to ``max_new_tokens`` tokens for one prompt.

    Args:
        target: the verifying model (see :class:`~mmspec.core.target.Target`).
        model_inputs: the prompt as the target's prefill expects it (input_ids, pixel_values, ...).
        drafter: proposer of draft tokens (a linear draft or a token tree, see
            :class:`~mmspec.core.drafter.Draft`), or None for plain AR decoding.
        sampling: one transform for draft and target.
        max_new_tokens: hard cap on generated tokens.
        eos_token_ids: generation stops after the first of these (the EOS is kept).
        generator: source of every random number of the generation.
        acceptance: a rule of :data:`mmspec.core.rules.RULES` by name ("greedy", "speculative",
            "typical", "lantern", "lantern++", "gsd", ...), "auto"/None (greedy or speculative by
            ``sampling``), or an :class:`~mmspec.core.rules.AcceptanceRule` instance.
        rule_kwargs: the named rule's parameters (the fields of its ``Params``).
        on_step: called with the number of tokens generated so far after every verification step.
    Returns:
        The final state (``state.tokens`` is [1, prompt + new]) and the statistics.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rule = resolve_rule(acceptance, sampling, rule_kwargs, continuous=getattr(target, "continuous", False))
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
        empty_draft = Draft(tokens=state.tokens[:, :0])
        first = rule.verify_output(empty_draft, prefill_out, sampling, _uniforms(generator, sampling, 0, prefill_out.device), generator)
        first.record(stats)
        _, done = _truncate_at_stop(first.tokens[:, :1], eos, max_new_tokens)
        state.tokens = torch.cat([state.tokens, first.tokens[:, :1].to(state.tokens)], dim=1)
        generated = 1
        if drafter is not None:
            drafter.start(DraftContext(target, sampling, generator, model_inputs, rule), state)
            stats.config.update(drafter.describe())
            if drafter.requires_target_hidden:
                drafter.on_verified(0, 0, prefill_out)

        while not done:
            # 2. Draft at most what the token budget can still use (the bonus token is free).
            budget = max_new_tokens - generated - 1
            if drafter is not None and budget > 0:
                drafting = time.perf_counter()
                draft = drafter.propose(state, budget)
                stats.draft_time_s += time.perf_counter() - drafting
            else:
                draft = empty_draft
            k = draft.length
            if draft.tree is None:
                # 3. Verify: one target forward over [pending token, d_1 .. d_K] gives K+1 distributions.
                out = target.forward(state, state.verification_inputs(draft.tokens), hidden_layer=hidden_layer)
                verification = rule.verify_output(draft, out, sampling, _uniforms(generator, sampling, k, out.device), generator)
                path, positions = None, k
            else:
                # 3'. A token tree: one forward with the tree attention mask, then walk the tree.
                verification, out, tree_out = _tree_step(rule, target, state, draft, sampling, generator, hidden_layer)
                path, positions = verification.path[0, : int(verification.num_accepted[0])], draft.tree.max_depth
                stats.tree_nodes += k
            num_accepted = int(verification.num_accepted[0])
            # 4. Stop at EOS / the budget exactly where AR decoding would have stopped.
            committed, done = _truncate_at_stop(verification.tokens[:, : num_accepted + 1], eos, max_new_tokens - generated)
            # 5. Commit and roll back everything the rejected drafts left in the state.
            state.commit(committed.to(state.tokens), path=path)
            generated += committed.shape[1]
            verification.record(stats)
            stats.record_step(positions, num_accepted, committed.shape[1])
            if on_step is not None:
                on_step(generated)
            if drafter is not None:
                drafting = time.perf_counter()
                if draft.tree is not None:
                    drafter.on_tree_verified(path, tree_out)
                drafter.on_verified(k, num_accepted, out)
                stats.draft_time_s += time.perf_counter() - drafting

    stats.new_tokens = generated
    stats.draft_forwards = drafter.forwards if drafter is not None else 0
    if drafter is not None:
        stats.config.update(drafter.describe())  # settings the drafter chose while generating
    stats.wall_time_s = time.perf_counter() - started
    return state, stats
