"""Relaxed acceptance for image and audio tokens: LANTERN, LANTERN++, grouped speculative decoding
(GSD) and VADUSA's top-k tolerance.

Visual AR models spread probability over many interchangeable codes; these rules accept a draft
when the target's mass *near* it (in the tokenizer's latent space) is high enough. They are lossy
by design, with the loss bounded in total variation. Pure functions like :mod:`mmspec.core.verify`:
no model, no cache, randomness passed in. Formulas: docs/usage.md (acceptance rules) and the papers below.

Neighbour tables (:func:`neighbour_table`): for a codebook E [V, d], row v lists the k codes
nearest to v by L2 distance, nearest first, v itself excluded.

LANTERN (Jang et al., ICLR 2025), for draft x with neighbours n_1 .. n_k:
    c_j = sum_{i <= j} p(n_i);  A = the longest prefix with c_j <= delta;  p~(x) = p(x) + c_{|A|}.
    Moving A's mass onto x gives a distribution p~ with TV(p, p~) = c_{|A|} <= delta.
    Accept iff r < min(1, p~(x) / q(x)); on rejection draw from norm(max(0, p' - q)) where p' is p
    with x and A zeroed (renormalised).  Greedy: accept iff p(x) + c_{|A|} >= max p.
LANTERN++: the bound is multiplicative, c_j <= (lambda - 1) p(x), i.e. p~(x) <= lambda p(x).
GSD (grouped speculative decoding): C = {x} plus those of x's k neighbours that are among the
    target's ``top_m`` most likely codes (near in embedding and in probability); accept iff
    r < min(1, p(C) / q(C)); on rejection draw from norm(max(0, p - q)) with C zeroed.
Top-k tolerance (VADUSA, Li et al. 2024, for speech tokens): accept x_i while p_i(x_i) > 0 and x_i
    is among the k most likely tokens of p_i (fewer than k tokens strictly more likely: a token tied
    with the k-th passes); the first other position gets a token drawn from p
    (argmax p when greedy). Lossy with no TV bound: an accepted token follows the drafter, not p,
    within the target's top k (the support top-k sampling would use); k = 1 under greedy decoding
    is exact greedy.
Group acceptance (PCG, principled coarse-graining, arXiv 2511.13732; :class:`TokenGroups`,
    :func:`group_verify`): overlapping groups G_c = {c} + c's neighbours, one per token; each
    token's mass is split evenly over the m(x) groups that hold it, w(x, g) = 1 / m(x), giving
    coarse distributions P(g) = sum_x p(x) w(x, g) and Q(g) likewise. The drafted token x names a
    group g ~ w(x, .) (so g ~ Q), accepted iff r < min(1, P(g) / Q(g)): speculative sampling on the
    group variable, whose output group is therefore distributed exactly as P. Accepted, x stands
    for its group; rejected, g' ~ norm(max(0, P - Q)) and y ~ p(. | g') = p(y) w(y, g') / P(g'). The
    token distribution this keeps (derived, tested in tests/test_relaxed.py) is
        p_out(y) = sum_g [ min(P, Q)(g) q(y | g) + (P(g) - min(P, Q)(g)) p(y | g) ],
    with q(y | g) = q(y) w(y, g) / Q(g): p where the draft matches the target within every group,
    and TV(p_out, p) <= sum_g min(P, Q)(g) TV(q(. | g), p(. | g)). Groups of one token give exact
    speculative sampling. Greedy: accept x iff it shares a group with argmax p.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .sampling import sample_from_probs
from .verify import (TreeVerification, Verification, _accepted_prefix_length, _assemble, _first_accepted_child,
                     _node_tokens_and_parent_rows, _tree_assemble, _walk, deepest_passing_path, exact_argmax)


def neighbour_table(codebook: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """The k nearest codes of every code (L2, nearest first, self excluded).

    Computed in chunks of ``chunk`` rows, so a 16384-code codebook needs only a [chunk, V] distance
    block at a time. Ties are broken by the lower index (stable sort).

    Args:
        codebook: [V, d] code vectors.
        k: neighbours kept per code (clipped to V - 1).
    Returns:
        LongTensor [V, k].
    """
    codes = codebook.detach().float()
    v = codes.shape[0]
    k = min(k, v - 1)
    squared = codes.pow(2).sum(1)
    rows = []
    for start in range(0, v, chunk):
        block = codes[start : start + chunk]
        distance = squared[start : start + chunk, None] - 2 * block @ codes.t() + squared[None, :]
        own = torch.arange(start, start + block.shape[0])
        distance[torch.arange(block.shape[0]), own] = float("inf")  # self excluded
        rows.append(torch.sort(distance, dim=1, stable=True).indices[:, :k])
    return torch.cat(rows)


def cached_neighbour_table(codebook: torch.Tensor, k: int, directory: str | Path) -> torch.Tensor:
    """:func:`neighbour_table`, cached as ``DIRECTORY/neighbours-k<K>-<hash>.pt`` (the hash is of the
    codebook's values, so a retrained tokenizer never reads a stale table)."""
    digest = hashlib.sha1(codebook.detach().float().cpu().numpy().tobytes()).hexdigest()[:12]
    path = Path(directory) / f"neighbours-k{k}-{digest}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    table = neighbour_table(codebook, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: workers building the same table at once
    torch.save(table, tmp)
    tmp.replace(path)
    return table


def relaxed_mass(target_probs: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor,
                 delta: float | None = None, lam: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LANTERN's relaxed target probability of each drafted token.

    Args:
        target_probs: [..., V] p.
        tokens: LongTensor [...] the drafted tokens x.
        neighbours: LongTensor [V, k] (:func:`neighbour_table`).
        delta: LANTERN's additive bound (c_j <= delta); or
        lam: LANTERN++'s multiplicative bound (c_j <= (lam - 1) p(x)).
    Returns:
        p~(x) [...] = p(x) + c_{|A|}, and the mask [..., k] of the neighbours in A.
    """
    if (delta is None) == (lam is None):
        raise ValueError("give exactly one of delta (LANTERN) or lam (LANTERN++)")
    near = neighbours.to(tokens.device)[tokens]  # [..., k]
    p_near = target_probs.gather(-1, near)
    p_x = target_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    cumulative = p_near.cumsum(-1)
    bound = torch.full_like(p_x, delta) if delta is not None else (lam - 1.0) * p_x
    in_a = cumulative <= bound.unsqueeze(-1)  # cumulative is non-decreasing: a prefix
    return p_x + (p_near * in_a).sum(-1), in_a


def _residual(p: torch.Tensor, q: torch.Tensor, zeroed: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p' - q) with p' = p without the ``zeroed`` tokens; p', then
    p, wherever a candidate is empty (an empty residual is never sampled; it stays well defined)."""
    p_masked = p.masked_fill(zeroed, 0.0)
    residual = (p_masked - q).clamp_(min=0.0)
    for fallback in (p_masked, p):
        residual = torch.where(residual.sum(-1, keepdim=True) <= 0, fallback, residual)
    return residual


def _residual_draw(p_next: torch.Tensor, q_next: torch.Tensor, zeroed: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw from :func:`_residual`."""
    return sample_from_probs(_residual(p_next, q_next, zeroed), uniforms)


def _draft_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int, dtype) -> torch.Tensor:
    """q per position [B, K + 1, V] (one-hot for deterministic drafts; zero at the bonus position)."""
    if draft_probs is None:
        q = torch.nn.functional.one_hot(draft_tokens, vocab).to(dtype)
    else:
        q = draft_probs.to(dtype)
    return torch.cat([q, q.new_zeros(q.shape[0], 1, vocab)], dim=1)


def lantern_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   neighbours: torch.Tensor, accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor,
                   delta: float | None = None, lam: float | None = None) -> Verification:
    """LANTERN (``delta``) / LANTERN++ (``lam``, pass delta=None) on a linear draft.

    Shapes as :func:`~mmspec.core.verify.speculative_verify`: draft_tokens [B, K], draft_probs
    [B, K, V] or None (q = 1 on the drafted token: dynamic trees, deterministic drafts),
    target_probs [B, K+1, V], accept_uniforms [B, K], sample_uniforms [B]. With delta = 0 (or
    lam = 1) this is speculative_verify exactly.
    """
    batch, k = draft_tokens.shape
    relaxed, in_a = relaxed_mass(target_probs[:, :k], draft_tokens, neighbours, delta=delta, lam=lam)
    q_rows = _draft_rows(draft_tokens, draft_probs, target_probs.shape[-1], target_probs.dtype)
    q_of_draft = q_rows[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    num_accepted = _accepted_prefix_length(accept_uniforms * q_of_draft < relaxed)
    rows = torch.arange(batch, device=draft_tokens.device)
    zeroed = torch.zeros_like(target_probs, dtype=torch.bool)
    near = neighbours.to(draft_tokens.device)[draft_tokens]  # [B, K, k]
    zeroed[:, :k].scatter_(-1, near, in_a)
    zeroed[:, :k].scatter_(-1, draft_tokens.unsqueeze(-1), True)
    if delta == 0 or lam == 1:  # nothing relaxed: exactly speculative sampling's residual
        zeroed.zero_()
    next_token = _residual_draw(target_probs[rows, num_accepted], q_rows[rows, num_accepted], zeroed[rows, num_accepted],
                                sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)


def lantern_greedy_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, neighbours: torch.Tensor,
                          delta: float | None = None, lam: float | None = None) -> Verification:
    """Greedy LANTERN: accept x while p(x) + c_{|A|} >= max p; then emit argmax p.

    target_probs: [B, K+1, V] the target's (un-truncated) distributions."""
    k = draft_tokens.shape[1]
    relaxed, _ = relaxed_mass(target_probs[:, :k], draft_tokens, neighbours, delta=delta, lam=lam)
    num_accepted = _accepted_prefix_length(relaxed >= target_probs[:, :k].max(-1).values)
    argmax = target_probs.argmax(-1)
    return _assemble(draft_tokens, num_accepted, argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1))


def gsd_cluster(p: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, top_m: int) -> torch.Tensor:
    """GSD's cluster C of each drafted token: {x} plus those of x's neighbours among the ``top_m``
    most likely codes of p.

    Args:
        p: [..., V] the distribution the draft is tested against; tokens: LongTensor [...] the drafts x;
        neighbours: LongTensor [V, k].
    Returns:
        BoolTensor [..., V], True on C.
    """
    near = neighbours.to(tokens.device)[tokens]  # [..., k]
    top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.topk(min(top_m, p.shape[-1]), dim=-1).indices, True)
    cluster = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, near, top.gather(-1, near))
    return cluster.scatter_(-1, tokens.unsqueeze(-1), True)


def gsd_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               neighbours: torch.Tensor, accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor,
               *, top_m: int) -> Verification:
    """Grouped speculative decoding: accept x iff r < min(1, p(C) / q(C)) with C = {x} plus x's
    neighbours among the target's ``top_m`` most likely codes (:func:`gsd_cluster`); on rejection
    draw from norm(max(0, p - q)) with C zeroed. Shapes as :func:`lantern_verify`."""
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    p = target_probs[:, :k]
    cluster = torch.zeros_like(target_probs, dtype=torch.bool)
    cluster[:, :k] = gsd_cluster(p, draft_tokens, neighbours, top_m)
    q_rows = _draft_rows(draft_tokens, draft_probs, vocab, target_probs.dtype)
    p_cluster = (p * cluster[:, :k]).sum(-1)
    q_cluster = (q_rows[:, :k] * cluster[:, :k]).sum(-1)
    num_accepted = _accepted_prefix_length(accept_uniforms * q_cluster < p_cluster)
    rows = torch.arange(batch, device=draft_tokens.device)
    next_token = _residual_draw(target_probs[rows, num_accepted], q_rows[rows, num_accepted], cluster[rows, num_accepted],
                                sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)


def _tree_multi_draft(tree, target_probs: torch.Tensor, accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor,
                      test) -> TreeVerification:
    """The multi-draft walk of the relaxed tree rules (that of
    :func:`~mmspec.core.verify.tree_speculative_verify`, with a relaxed test).

    At a row with current distribution p (the target's, then the residual after each rejected
    sibling) and children x_1, x_2, ... in try order, ``test`` gives per child the mass a and the
    denominator b of its acceptance ratio and the tokens Z zeroed on rejection: x_j is accepted iff
    r_j * b < a, i.e. r_j < min(1, a / b); on rejection p <- norm(max(0, p' - q_j)), p' = p without
    Z. After the walk the corrected / bonus token is drawn from the stop row's current distribution.

    Args:
        tree: TokenTree, tokens [N] or [B, N], probs [N, V] / [B, N, V] or None (q_j = one-hot(x_j)).
        target_probs: [B, N+1, V]; accept_uniforms: [B, N]; sample_uniforms: [B].
        test: (p [B, n, V], x [B, n], q [B, n, V]) -> (a [B, n], b [B, n], Z [B, n, V] bool).
    """
    batch, _, vocab = target_probs.shape
    device = target_probs.device
    tokens = tree.tokens.to(device).expand(batch, tree.size)
    weights = target_probs.clone()  # unnormalised residual per row
    mass = torch.ones(batch, target_probs.shape[1], 1, dtype=target_probs.dtype, device=device)
    accept = torch.zeros(batch, tree.size, dtype=torch.bool, device=device)
    for nodes, rows in tree.sibling_groups():
        nodes, rows = nodes.to(device), rows.to(device)
        x = tokens[:, nodes]  # [B, n]
        if tree.probs is None:
            q = torch.nn.functional.one_hot(x, vocab).to(target_probs.dtype)
        else:
            q = tree.probs.to(device=device, dtype=target_probs.dtype).expand(batch, tree.size, vocab)[:, nodes]
        p = weights[:, rows] / mass[:, rows]  # exactly target_probs until a row's first rejection
        numerator, denominator, zeroed = test(p, x, q)
        accept[:, nodes] = accept_uniforms[:, nodes] * denominator < numerator
        residual = _residual(p, q, zeroed)
        weights[:, rows] = residual
        mass[:, rows] = residual.sum(-1, keepdim=True)
    path, num_accepted, stop_row = _walk(tree, _first_accepted_child(tree, accept))
    next_token = sample_from_probs(weights[torch.arange(batch, device=device), stop_row], sample_uniforms)
    return _tree_assemble(tree, path, num_accepted, next_token)


def tree_lantern_verify(tree, target_probs: torch.Tensor, neighbours: torch.Tensor, accept_uniforms: torch.Tensor,
                        sample_uniforms: torch.Tensor, delta: float | None = None, lam: float | None = None) -> TreeVerification:
    """LANTERN / LANTERN++ on a token tree (the multi-draft walk of
    :func:`~mmspec.core.verify.tree_speculative_verify` with the relaxed test).

    At a row with current distribution p (the target's, then the residual after each rejected
    sibling) and children x_1, x_2, ... in try order:
        accept x_j iff r_j < min(1, p~(x_j) / q_j(x_j)), p~ = :func:`relaxed_mass` under p;
        on rejection p <- norm(max(0, p' - q_j)), p' = p with x_j and its set A_j zeroed.
    Dynamic trees (``tree.probs is None``, EAGLE-2) use q_j = one-hot(x_j): x_j is accepted with
    probability p~(x_j). Each row's output moves at most delta of mass (a mixture of distributions
    each within delta of its residual), so TV(output, p) <= delta per position as in the linear rule.
    A chain-shaped tree gives :func:`lantern_verify` exactly.

    Args:
        tree: TokenTree, tokens [N] or [B, N], probs [N, V] / [B, N, V] or None.
        target_probs: [B, N+1, V] target distributions for [root, node_0 .. node_{N-1}].
        neighbours: LongTensor [V, k]; accept_uniforms [B, N]; sample_uniforms [B].
    """
    relaxing = not (delta == 0 or lam == 1)

    def test(p, x, q):
        relaxed, in_a = relaxed_mass(p, x, neighbours, delta=delta, lam=lam)
        zeroed = torch.zeros_like(p, dtype=torch.bool)
        if relaxing:
            zeroed.scatter_(-1, neighbours.to(x.device)[x], in_a).scatter_(-1, x.unsqueeze(-1), True)
        return relaxed, q.gather(-1, x.unsqueeze(-1)).squeeze(-1), zeroed

    return _tree_multi_draft(tree, target_probs, accept_uniforms, sample_uniforms, test)


def tree_gsd_verify(tree, target_probs: torch.Tensor, neighbours: torch.Tensor, accept_uniforms: torch.Tensor,
                    sample_uniforms: torch.Tensor, *, top_m: int):
    """GSD on a token tree: the multi-draft walk (:func:`tree_lantern_verify`'s) with GSD's test.

    At a row with current distribution p and children x_1, x_2, ... in try order, C_j =
    :func:`gsd_cluster` (p, x_j): accept x_j iff r_j < min(1, p(C_j) / q_j(C_j)); on rejection
    p <- norm(max(0, p' - q_j)), p' = p with C_j zeroed. Deterministic trees (``tree.probs is
    None``) use q_j = one-hot(x_j), so q_j(C_j) = 1. A chain-shaped tree gives :func:`gsd_verify`
    exactly (same uniforms, same tokens).

    Args:
        tree: TokenTree, tokens [N] or [B, N], probs [N, V] / [B, N, V] or None.
        target_probs: [B, N+1, V]; neighbours: LongTensor [V, k]; accept_uniforms [B, N]; sample_uniforms [B].
    """

    def test(p, x, q):
        cluster = gsd_cluster(p, x, neighbours, top_m)
        return (p * cluster).sum(-1), (q * cluster).sum(-1), cluster

    return _tree_multi_draft(tree, target_probs, accept_uniforms, sample_uniforms, test)


def tree_lantern_greedy_verify(tree, target_probs: torch.Tensor, neighbours: torch.Tensor,
                               delta: float | None = None, lam: float | None = None):
    """Greedy LANTERN on a tree: from the root follow the first child x with p(x) + c_{|A|} >= max p
    of its parent's row; at the first row without one emit argmax p. A chain gives
    :func:`lantern_greedy_verify`. target_probs: [B, N+1, V]."""
    device = target_probs.device
    batch = target_probs.shape[0]
    tokens = tree.tokens.to(device).expand(batch, tree.size)
    parent_rows = (tree.parents + 1).to(device)
    parent_probs = target_probs[:, parent_rows]  # [B, N, V]
    relaxed, _ = relaxed_mass(parent_probs, tokens, neighbours, delta=delta, lam=lam)
    accept = relaxed >= parent_probs.max(-1).values
    path, num_accepted, stop_row = _walk(tree, _first_accepted_child(tree, accept))
    next_token = target_probs.argmax(-1).gather(1, stop_row.unsqueeze(1)).squeeze(1)
    return _tree_assemble(tree, path, num_accepted, next_token)


class TokenGroups:
    """PCG's overlapping acoustic-similarity groups over a vocabulary of V tokens, built from a
    neighbour table [V, k]: group c = {c} + c's neighbours (duplicates counted once).

    Attributes:
        members: LongTensor [V + 1, k + 1], group c's tokens (V = none, a padding token of mass 0;
            group V is the empty group none).
        count: [V] m(x), the groups holding token x (>= 1: its own).
        groups_of: LongTensor [V, max m], the groups holding x (V = none, padding).
    """

    def __init__(self, neighbours: torch.Tensor) -> None:
        vocab = neighbours.shape[0]
        members = torch.cat([torch.arange(vocab, device=neighbours.device)[:, None], neighbours], dim=1).sort(dim=1).values
        repeated = torch.zeros_like(members, dtype=torch.bool)
        repeated[:, 1:] = members[:, 1:] == members[:, :-1]
        members = members.masked_fill(repeated, vocab)
        valid = members < vocab
        tokens = members[valid]
        groups = torch.arange(vocab, device=members.device)[:, None].expand_as(members)[valid]
        order = torch.argsort(tokens, stable=True)
        tokens, groups = tokens[order], groups[order]
        count = torch.bincount(tokens, minlength=vocab)
        slot = torch.arange(tokens.shape[0], device=tokens.device) - (count.cumsum(0) - count)[tokens]
        self.groups_of = torch.full((vocab, int(count.max())), vocab, dtype=torch.long, device=members.device)
        self.groups_of[tokens, slot] = groups
        self.count = count.float()
        self.members = torch.cat([members, members.new_full((1, members.shape[1]), vocab)])  # + the group none
        self.vocab = vocab

    def coarse(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V] token probabilities -> [..., V + 1] group probabilities (the last: none, 0)."""
        share = torch.cat([probs / self.count.to(probs), probs.new_zeros(*probs.shape[:-1], 1)], dim=-1)
        return share[..., self.members.to(probs.device)].sum(-1)

    def expand(self, group_weights: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Token weights of "draw g from ``group_weights`` [..., V + 1], then y ~ p(. | g)":
        p(y) / m(y) * sum_{g holds y} weight(g) / P(g), unnormalised [..., V]."""
        coarse = self.coarse(probs)
        per_group = torch.where(coarse > 0, group_weights / coarse.clamp_min(1e-30), 0.0)
        return probs / self.count.to(probs) * per_group[..., self.groups_of.to(probs.device)].sum(-1)


def group_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 groups: TokenGroups, accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor) -> Verification:
    """PCG group acceptance (module doc). Shapes as :func:`lantern_verify`: draft_tokens [B, K],
    draft_probs [B, K, V] or None (one-hot), target_probs [B, K + 1, V], accept_uniforms [B, K],
    sample_uniforms [B].

    One uniform u per draft picks x's group and decides it: with m = m(x), j = floor(u m) is
    uniform over x's groups and u m - j is a fresh uniform independent of j.
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    q_rows = _draft_rows(draft_tokens, draft_probs, vocab, target_probs.dtype)
    big_p, big_q = groups.coarse(target_probs), groups.coarse(q_rows)  # [B, K + 1, V + 1]
    m = groups.count.to(accept_uniforms.device)[draft_tokens]
    scaled = accept_uniforms.double() * m
    pick = scaled.floor().clamp_max(m - 1)
    group = groups.groups_of.to(draft_tokens.device)[draft_tokens, pick.long()]  # [B, K]
    p_group = big_p[:, :k].gather(-1, group[..., None])[..., 0]
    q_group = big_q[:, :k].gather(-1, group[..., None])[..., 0]
    num_accepted = _accepted_prefix_length((scaled - pick) * q_group < p_group)
    rows = torch.arange(batch, device=draft_tokens.device)
    p_next, residual = target_probs[rows, num_accepted], (big_p - big_q).clamp_min(0)[rows, num_accepted]
    weights = groups.expand(residual, p_next)
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p_next)  # the bonus row: q = 0, so p itself
    return _assemble(draft_tokens, num_accepted, sample_from_probs(weights, sample_uniforms))


def group_greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, groups: TokenGroups) -> Verification:
    """Greedy PCG: accept x while it shares a group with the target's argmax; then the argmax."""
    best = exact_argmax(target_logits)  # [B, K + 1]
    k = draft_tokens.shape[1]
    shared = groups.members.to(draft_tokens.device)[groups.groups_of.to(draft_tokens.device)[best[:, :k]]]  # [B, K, m, k+1]
    accept = (shared == draft_tokens[..., None, None]).flatten(2).any(-1)
    num_accepted = _accepted_prefix_length(accept)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return _assemble(draft_tokens, num_accepted, best[rows, num_accepted])


def topk_tolerance_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, *, top_k: int,
                          sample_uniforms: torch.Tensor | None) -> Verification:
    """VADUSA's tolerance rule (module doc).

    Args:
        draft_tokens: LongTensor [B, K].
        target_probs: [B, K+1, V] the target's distributions.
        top_k: how many of the target's most likely tokens a draft may be among.
        sample_uniforms: [B] one U(0, 1) per row for the token at the first non-accepted (or bonus)
            position; None: greedy (that token is argmax p).
    """
    batch, k = draft_tokens.shape
    num_accepted = _accepted_prefix_length(_in_top_k(target_probs[:, :k], draft_tokens, top_k))
    p_next = target_probs[torch.arange(batch, device=draft_tokens.device), num_accepted]
    next_token = exact_argmax(p_next) if sample_uniforms is None else sample_from_probs(p_next, sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)


def _in_top_k(p: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """p [B, n, V], tokens [B, n] -> [B, n] bool: p(token) > 0 and the token among p's top_k, that
    is fewer than top_k tokens strictly more probable (a token tied with the k-th passes, where a
    sort's order among equals would decide arbitrarily; one comparison instead of a top-k search)."""
    chosen = p.gather(-1, tokens.unsqueeze(-1))  # [B, n, 1]
    return ((p > chosen).sum(-1) < top_k) & (chosen.squeeze(-1) > 0)


def tree_topk_tolerance_verify(tree, target_probs: torch.Tensor, *, top_k: int,
                               sample_uniforms: torch.Tensor | None) -> TreeVerification:
    """Top-k tolerance on a token tree (VADUSA verifies a sparse tree this way): a node passes when
    its token is in the top k of its parent row; the deepest fully passing path is taken
    (:func:`~mmspec.core.verify.deepest_passing_path`). On a chain this is :func:`topk_tolerance_verify`."""
    tokens, parent_rows = _node_tokens_and_parent_rows(tree, target_probs)
    passes = _in_top_k(target_probs[:, parent_rows], tokens, top_k)
    return deepest_passing_path(tree, passes, target_probs, sample_uniforms)
