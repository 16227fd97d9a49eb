"""The speculative decoding loop: draft -> verify -> commit -> roll back.

Plain AR decoding is the same loop with no drafter (K = 0 every step), so the baseline and every
method share one KV cache implementation and one sampling path.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .cache import SequenceState
from .drafter import Draft, DraftContext, Drafter
from .relaxed import gsd_verify, lantern_greedy_verify, lantern_verify, tree_lantern_greedy_verify, tree_lantern_verify
from .sampling import SamplingConfig, logits_to_probs
from .stats import SpecStats
from .target import Target, TargetOutput
from .verify import (
    TreeVerification,
    Verification,
    greedy_verify,
    speculative_verify,
    tree_greedy_verify,
    tree_speculative_verify,
    typical_verify,
)

#: acceptance rules the loop can apply; "auto" = greedy without sampling, speculative with it.
#: The relaxed image-token rules (mmspec.core.relaxed) take rule_kwargs: neighbours [V, k] and
#: delta (lantern), lam (lantern++) or top_m (gsd).
RELAXED_RULES = ("lantern", "lantern++", "gsd")
ACCEPTANCE_RULES = ("auto", "greedy", "speculative", "typical", *RELAXED_RULES)


def _lantern_bound(acceptance: str, rule_kwargs: dict[str, Any]) -> dict[str, float | None]:
    """LANTERN's additive bound (delta) or LANTERN++'s ratio bound (lam), as the rules' keywords."""
    if acceptance == "lantern++":
        return {"delta": None, "lam": rule_kwargs["lam"]}
    return {"delta": rule_kwargs["delta"]}


def _verify(
    acceptance: str,
    draft: Draft,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator,
    rule_kwargs: dict[str, Any],
) -> Verification:
    """Apply the acceptance rule to one draft. target_logits: [1, K+1, V]."""
    if acceptance == "greedy":
        return greedy_verify(draft.tokens, target_logits)
    if acceptance in RELAXED_RULES and not sampling.do_sample:  # greedy LANTERN / LANTERN++
        return lantern_greedy_verify(draft.tokens, target_logits.float().softmax(-1), rule_kwargs["neighbours"],
                                     **_lantern_bound(acceptance, rule_kwargs))
    target_probs = logits_to_probs(target_logits, sampling)
    k = draft.length
    uniforms = torch.rand(1, k + 1, generator=generator, device=generator.device).to(target_probs.device)
    if acceptance == "typical":
        return typical_verify(draft.tokens, target_probs, uniforms[:, k], **rule_kwargs)
    if acceptance in ("lantern", "lantern++"):
        return lantern_verify(draft.tokens, draft.probs, target_probs, rule_kwargs["neighbours"], uniforms[:, :k],
                              uniforms[:, k], **_lantern_bound(acceptance, rule_kwargs))
    if acceptance == "gsd":
        return gsd_verify(draft.tokens, draft.probs, target_probs, rule_kwargs["neighbours"], uniforms[:, :k],
                          uniforms[:, k], top_m=rule_kwargs.get("top_m", 50))
    return speculative_verify(draft.tokens, draft.probs, target_probs, uniforms[:, :k], uniforms[:, k])


def _tree_step(
    acceptance: str,
    target: Target,
    state: SequenceState,
    draft: Draft,
    sampling: SamplingConfig,
    generator: torch.Generator,
    hidden_layer: int | None,
    rule_kwargs: dict[str, Any],
) -> tuple[TreeVerification, TargetOutput, TargetOutput]:
    """Verify a tree draft: one target forward over [pending, node_0 .. node_{N-1}] with the tree
    attention mask, then the tree rule. Draws N + 1 uniforms like a linear draft of N tokens (a
    chain-shaped tree consumes the same numbers and gives the same tokens).

    Returns:
        The verification, the target output restricted to [pending, accepted path], and the whole
        output [root, node_0 .. node_{N-1}].
    """
    tree = draft.tree
    if acceptance not in ("greedy", "speculative", "lantern", "lantern++"):
        raise ValueError(f"acceptance={acceptance!r} is not implemented for token trees; use 'greedy', "
                         "'speculative', 'lantern' or 'lantern++', or a linear drafter")
    rooted = tree.prepend_root(state.tokens[0, -1])
    out = target.forward(state, rooted.tokens.to(state.tokens.device).unsqueeze(0), hidden_layer=hidden_layer, tree=rooted)
    relaxed = acceptance in RELAXED_RULES
    if acceptance == "greedy":
        verification = tree_greedy_verify(tree, out.logits)
    elif relaxed and not sampling.do_sample:
        verification = tree_lantern_greedy_verify(tree, out.logits.float().softmax(-1), rule_kwargs["neighbours"],
                                                  **_lantern_bound(acceptance, rule_kwargs))
    else:
        target_probs = logits_to_probs(out.logits, sampling)
        n = tree.size
        uniforms = torch.rand(1, n + 1, generator=generator, device=generator.device).to(target_probs.device)
        if relaxed:
            verification = tree_lantern_verify(tree, target_probs, rule_kwargs["neighbours"], uniforms[:, :n], uniforms[:, n],
                                               **_lantern_bound(acceptance, rule_kwargs))
        else:
            verification = tree_speculative_verify(tree, target_probs, uniforms[:, :n], uniforms[:, n])
    rows = torch.cat([verification.path.new_zeros(1), verification.path[0, : int(verification.num_accepted[0])] + 1])
    hidden = None if out.hidden_states is None else out.hidden_states[:, rows]
    return verification, TargetOutput(out.logits[:, rows], hidden), out


def resolve_acceptance(acceptance: str | None, sampling: SamplingConfig) -> str:
    acceptance = acceptance or "auto"
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}; choose one of {ACCEPTANCE_RULES}")
    if acceptance == "auto":
        return "speculative" if sampling.do_sample else "greedy"
    if acceptance == "gsd" and not sampling.do_sample:
        raise ValueError("acceptance='gsd' is a sampling rule; use do_sample=True (or 'lantern' for greedy decoding)")
    if acceptance in ("speculative", "typical") and not sampling.do_sample:
        raise ValueError(f"acceptance={acceptance!r} needs do_sample=True; greedy decoding uses acceptance='greedy'")
    if acceptance == "greedy" and sampling.do_sample:
        raise ValueError("acceptance='greedy' with do_sample=True would not sample; use 'speculative'")
    return acceptance


def _truncate_at_stop(new_tokens: list[int], eos_token_ids: Sequence[int], budget: int) -> tuple[list[int], bool]:
    """Cut a step's tokens at the first EOS (kept, as transformers does) and at the token budget."""
    for i, token in enumerate(new_tokens[:budget]):
        if token in eos_token_ids:
            return new_tokens[: i + 1], True
    return new_tokens[:budget], len(new_tokens) >= budget


def speculative_decode(
    target: Target,
    model_inputs: dict[str, Any],
    drafter: Drafter | None,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    acceptance: str | None = None,
    rule_kwargs: dict[str, Any] | None = None,
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
        acceptance: "auto" | "greedy" | "speculative" | "typical" | "lantern" | "lantern++" | "gsd".
        rule_kwargs: extra parameters of the rule (typical: posterior_threshold, posterior_alpha;
            lantern: neighbours, delta; lantern++: neighbours, lam; gsd: neighbours, top_m).
    Returns:
        The final state (``state.tokens`` is [1, prompt + new]) and the statistics.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    acceptance = resolve_acceptance(acceptance, sampling)
    if generator is None:
        generator = torch.Generator(device=target.device)
    eos = frozenset(int(t) for t in eos_token_ids)
    stats = SpecStats(method=drafter.name if drafter else "ar", config={"acceptance": acceptance})
    for name, value in (rule_kwargs or {}).items():  # the rule's parameters; a neighbour table by its width
        if name == "neighbours":
            stats.config["neighbours_k"] = value.shape[1]
        else:
            stats.config[name] = value
    started = time.perf_counter()

    with torch.inference_mode():
        # 1. Prefill: the target consumes the whole prompt once; its last logits give token 1.
        hidden_layer = drafter.target_hidden_layer if drafter is not None and drafter.requires_target_hidden else None
        state, prefill_out = target.prefill(model_inputs, hidden_layer=hidden_layer)
        stats.target_forwards = 1
        empty_draft = Draft(tokens=state.tokens.new_empty((1, 0)))
        first = _verify(acceptance, empty_draft, prefill_out.logits, sampling, generator, rule_kwargs or {})
        _, done = _truncate_at_stop(first.tokens[0, :1].tolist(), eos, max_new_tokens)
        state.tokens = torch.cat([state.tokens, first.tokens[:, :1]], dim=1)
        generated = 1
        if drafter is not None:
            drafter.start(DraftContext(target, sampling, generator, model_inputs), state)
            stats.config.update(drafter.describe())
            if drafter.requires_target_hidden:
                drafter.on_verified(0, 0, prefill_out)

        while not done:
            # 2. Draft at most what the token budget can still use (the bonus token is free).
            budget = max_new_tokens - generated - 1
            draft = drafter.propose(state, budget) if drafter is not None and budget > 0 else empty_draft
            k = draft.length
            if draft.tree is None:
                # 3. Verify: one target forward over [pending token, d_1 .. d_K] gives K+1 distributions.
                inputs = torch.cat([state.tokens[:, -1:], draft.tokens.to(state.tokens.device)], dim=1)
                out = target.forward(state, inputs, hidden_layer=hidden_layer)
                verification = _verify(acceptance, draft, out.logits, sampling, generator, rule_kwargs or {})
                path, positions = None, k
            else:
                # 3'. A token tree: one forward with the tree attention mask, then walk the tree.
                verification, out, tree_out = _tree_step(acceptance, target, state, draft, sampling, generator, hidden_layer,
                                                rule_kwargs or {})
                path, positions = verification.path[0, : int(verification.num_accepted[0])], draft.tree.max_depth
                stats.tree_nodes += k
            num_accepted = int(verification.num_accepted[0])
            # 4. Stop at EOS / the budget exactly where AR decoding would have stopped.
            committed, done = _truncate_at_stop(
                verification.tokens[0, : num_accepted + 1].tolist(), eos, max_new_tokens - generated
            )
            # 5. Commit and roll back everything the rejected drafts left in the state.
            state.commit(torch.tensor([committed], dtype=state.tokens.dtype, device=state.tokens.device), path=path)
            generated += len(committed)
            stats.record_step(positions, num_accepted, len(committed))
            if drafter is not None:
                if draft.tree is not None:
                    drafter.on_tree_verified(path, tree_out)
                drafter.on_verified(k, num_accepted, out)

    stats.new_tokens = generated
    stats.draft_forwards = drafter.forwards if drafter is not None else 0
    if drafter is not None:
        stats.config.update(drafter.describe())  # settings the drafter chose while generating
    stats.wall_time_s = time.perf_counter() - started
    return state, stats
