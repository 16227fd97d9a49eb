"""Acceptance rules: pure functions, randomness passed in.

Every rule takes K drafted tokens per row and the target's K+1 next-token distributions (position
i scores the token that follows draft i-1; position K is the bonus position) and returns a
:class:`Verification`: how many drafts were accepted and the tokens to commit, i.e. the accepted
drafts followed by one corrected (on rejection) or bonus (all accepted) token, padded with -1.
The tree rules (:func:`tree_greedy_verify`, :func:`tree_speculative_verify`,
:func:`tree_typical_verify`) take a token tree instead of K tokens and also return the accepted
node path (:class:`TreeVerification`). :mod:`mmspec.core.rules` wraps each rule in a registered
class with its parameters; the loop calls those.

Notation (docs/design.md): p = target distribution, q = draft distribution after the
same transform, x = drafted token, r ~ U(0, 1).

No rule touches a model, a cache or a global random state; none calls ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable
import torch

from .sampling import sample_from_probs
from .tree import TokenTree

PAD = -1


@dataclass
class Verification:
    """Result of verifying one draft per row.

    Attributes:
        num_accepted: LongTensor [B], drafts accepted (0..K); the committed length is num_accepted + 1.
        tokens: LongTensor [B, K+1], accepted drafts, then the corrected/bonus token, then PAD (-1).
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor

    def record(self, stats) -> None:
        """Add what this verification reports beyond acceptance to ``stats`` (a SpecStats; nothing here)."""


def _accepted_prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] number of leading True values."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor,
              pad: float = PAD) -> Verification:
    """Accepted drafts, the next token at position num_accepted, ``pad`` after it.

    draft_tokens: [B, K] token ids, or [B, K, D] continuous tokens (then next_token is [B, D])."""
    batch, k = draft_tokens.shape[:2]
    trailing = draft_tokens.shape[2:]
    positions = torch.arange(k + 1, device=draft_tokens.device).view(1, k + 1, *(1,) * len(trailing))
    padded_draft = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1, *trailing), pad)], dim=1)
    n = num_accepted.view(batch, 1, *(1,) * len(trailing))
    tokens = torch.where(positions < n, padded_draft, torch.full_like(padded_draft, pad))
    tokens = torch.where(positions == n, next_token.unsqueeze(1), tokens)
    return Verification(num_accepted=num_accepted, tokens=tokens)


#: faster row argmaxes a backend offers (``fn(logits) -> indices, or None where it does not apply``),
#: tried in order by :func:`exact_argmax`; :mod:`mmspec.modeling.fast_linear` registers its C kernel
ROW_ARGMAXES: list[Callable[[torch.Tensor], torch.Tensor | None]] = []
#: backends of :func:`speculative_verify` (the same arguments and pad -> (num_accepted [B], tokens
#: [B, K + 1]) bitwise as its PyTorch path gives them, or None where one does not apply), tried in
#: order; :mod:`mmspec.modeling.fast_linear` registers its C kernel
SPECULATIVE_KERNELS: list[Callable[..., tuple[torch.Tensor, torch.Tensor] | None]] = []
#: the same for :func:`block_verify`
BLOCK_KERNELS: list[Callable[..., tuple[torch.Tensor, torch.Tensor] | None]] = []


def exact_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first of tied maxima, as ``argmax``; a row with a NaN gives
    its first NaN, as ``max``): a registered backend's (:data:`ROW_ARGMAXES`) where one applies,
    else through ``max``: on CPUs ``argmax`` over bf16 is slow, and ``max`` needs no float copy (a
    [20, 49152] bf16 tensor, one core: argmax 3.3 ms, float copy + argmax 1.6 ms, max 0.73 ms; the C
    kernel on [15, 49152] 0.08 ms against max's 0.55; tests/test_verify.py checks ties)."""
    for argmax in ROW_ARGMAXES:
        indices = argmax(logits)
        if indices is not None:
            return indices
    return logits.max(dim=-1).indices


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verification:
    """Greedy rule: accept x_i while x_i == argmax p_i; then emit argmax p at the first mismatch
    (or at the bonus position K when all K are accepted).

    Args:
        draft_tokens: LongTensor [B, K].
        target_logits: [B, K+1, V] target logits (or probabilities; only the argmax is used).
    """
    target_argmax = exact_argmax(target_logits)  # [B, K+1]
    num_accepted = _accepted_prefix_length(draft_tokens == target_argmax[:, :-1])
    next_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _assemble(draft_tokens, num_accepted, next_token)


def speculative_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> Verification:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Output ~ p exactly.

    Accept x_i iff r_i < min(1, p_i(x_i) / q_i(x_i)) for every i up to the first rejection.
    On the first rejection at position n, sample from norm(max(0, p_n - q_n)); if all K are
    accepted, sample the bonus token from p_K.

    ``draft_probs=None`` is a deterministic draft (prompt lookup, greedy trees): q = one-hot(x),
    so x is accepted with probability p(x) and the residual is p with x zeroed, renormalised.

    Args:
        draft_tokens: LongTensor [B, K].
        draft_probs: [B, K, V] draft distributions the tokens were sampled from, or None.
        target_probs: [B, K+1, V] target distributions (see :func:`logits_to_probs`).
        accept_uniforms: [B, K] r_i ~ U(0, 1).
        sample_uniforms: [B] one U(0, 1) per row for drawing the corrected/bonus token.
    """
    batch, k = draft_tokens.shape
    verified = _by_kernel(SPECULATIVE_KERNELS, draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    if verified is not None:
        return verified
    if k == 0:  # nothing drafted (plain decoding): the bonus token from p, as the general path draws it
        next_token = sample_from_probs(target_probs[:, 0], sample_uniforms)
        return Verification(num_accepted=torch.zeros(batch, dtype=torch.long, device=draft_tokens.device),
                            tokens=next_token.unsqueeze(1))
    p_of_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    # r < p/q  <=>  r * q < p  (q > 0 for any token the draft actually produced)
    num_accepted = _accepted_prefix_length(accept_uniforms * q_of_draft < p_of_draft)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    # q at the stopping position; zero at the bonus position (n == K), so the residual is p itself.
    q_rows = _draft_distributions(draft_tokens, draft_probs, target_probs)
    q_rows = torch.cat([q_rows, q_rows.new_zeros(batch, 1, q_rows.shape[-1])], dim=1)
    residual = (p_next - q_rows[rows, num_accepted]).clamp_(min=0.0)
    return _assemble(draft_tokens, num_accepted, _draw_residual(residual, p_next, sample_uniforms))


def _by_kernel(kernels: list, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor) -> Verification | None:
    """The first of a rule's registered backends (:data:`SPECULATIVE_KERNELS`, :data:`BLOCK_KERNELS`)
    that applies, as a Verification; None where none does."""
    for kernel in kernels:
        verified = kernel(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, PAD)
        if verified is not None:
            return Verification(num_accepted=verified[0], tokens=verified[1])
    return None


def _draft_distributions(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
                         ) -> torch.Tensor:
    """q [B, K, V] in the target's dtype: the draft's distributions, or one-hot(x) for a
    deterministic draft (``draft_probs=None``)."""
    if draft_probs is None:
        return torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    return draft_probs.to(target_probs.dtype)


def _draw_residual(residual: torch.Tensor, p_next: torch.Tensor, sample_uniforms: torch.Tensor) -> torch.Tensor:
    """The next token [B] from the residual weights [B, V], or from p_next where a row's residual is
    empty: such a row is reached with probability 0 (e.g. p == q), and p keeps the draw well defined."""
    empty = residual.sum(-1, keepdim=True) <= 0
    return sample_from_probs(torch.where(empty, p_next, residual), sample_uniforms)


def block_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> Verification:
    """Block verification (Sun et al., ICLR 2025): the K drafts judged jointly. Output ~ p exactly,
    and the expected number of accepted drafts is the largest any rule reading only the drafted
    path's p_i and q_i can reach, so never below :func:`speculative_verify`'s.

    With x_i the drafts, p_i / q_i the target / draft distributions at position i (i = 1 .. K), the
    capped path weights w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), and the residual mass
    S_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)): keep the block of i drafts with probability
    h_K = w_K, h_i = S_i / (S_i + 1 - w_i) (i < K; h_0 = 1), deciding from i = K down and stopping
    at the first kept block (r_i ~ U(0, 1) per i: tau = the largest i with r_i < h_i, else 0).
    The next token is drawn from p_{K+1} when tau = K, else from norm(max(0, w_tau p_{tau+1} -
    q_{tau+1})). With K = 1 this is speculative sampling, draw for draw (up to rounding at r = p / q).

    ``draft_probs=None`` is a deterministic draft (q = one-hot(x)), as in :func:`speculative_verify`.

    Args: as :func:`speculative_verify` (draft_tokens [B, K], draft_probs [B, K, V] or None,
        target_probs [B, K+1, V], accept_uniforms [B, K]: r_1 .. r_K, sample_uniforms [B]).
    """
    batch, k = draft_tokens.shape
    if k == 0:
        return speculative_verify(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    verified = _by_kernel(BLOCK_KERNELS, draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    if verified is not None:
        return verified
    q = _draft_distributions(draft_tokens, draft_probs, target_probs)  # [B, K, V]
    index = draft_tokens.unsqueeze(-1)
    ratio = target_probs[:, :k].gather(-1, index).squeeze(-1) / q.gather(-1, index).squeeze(-1)  # p_i(x_i) / q_i(x_i)
    weights = [torch.ones_like(ratio[:, 0])]
    for i in range(k):
        weights.append(torch.clamp(weights[-1] * ratio[:, i], max=1.0))
    w = torch.stack(weights, dim=1)  # [B, K + 1]: w_0 .. w_K
    residual = (w[:, :k, None] * target_probs[:, :k] - q).clamp_(min=0.0)  # [B, K, V]: tau = 0 .. K - 1
    mass = residual.double().cumsum(-1)[..., -1]  # S_0 .. S_{K-1}, summed in order (as the C kernel does)
    denominator = mass + 1.0 - w[:, :k].double()
    keep = torch.where(denominator > 0, mass / denominator.clamp_min(1e-300), torch.ones_like(mass))  # h_0 .. h_{K-1}
    keep = torch.cat([keep[:, 1:], w[:, k:].double()], dim=1)  # h_1 .. h_K
    kept = accept_uniforms.double() < keep  # [B, K]
    positions = torch.arange(1, k + 1, device=draft_tokens.device)
    num_accepted = torch.where(kept, positions, torch.zeros_like(positions)).amax(dim=-1)  # [B]
    rows = torch.arange(batch, device=draft_tokens.device)
    weights_next = torch.cat([residual, target_probs[:, k:]], dim=1)[rows, num_accepted]  # [B, V]
    return _assemble(draft_tokens, num_accepted, _draw_residual(weights_next, target_probs[rows, num_accepted], sample_uniforms))


def _typical_threshold(target_probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float) -> torch.Tensor:
    """min(eps, delta * exp(-H(p))) per row: [..., V] -> [...]."""
    entropy = -(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1)
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)


def typical_verify(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    sample_uniforms: torch.Tensor,
    *,
    posterior_threshold: float,
    posterior_alpha: float,
) -> Verification:
    """Typical acceptance (Medusa, Cai et al. 2024). Lossy: the output is *not* distributed as p.

    Accept x_i iff p_i(x_i) > min(eps, delta * exp(-H(p_i))) with eps = posterior_threshold and
    delta = posterior_alpha; the token after the accepted prefix is sampled from p.

    Args:
        draft_tokens: LongTensor [B, K].
        target_probs: [B, K+1, V].
        sample_uniforms: [B].
    """
    k = draft_tokens.shape[1]
    probs = target_probs[:, :k]
    threshold = _typical_threshold(probs, posterior_threshold, posterior_alpha)  # [B, K]
    p_of_draft = probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    num_accepted = _accepted_prefix_length(p_of_draft > threshold)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    next_token = sample_from_probs(target_probs[rows, num_accepted], sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)


# token trees --------------------------------------------------------------------------------------
# A tree draft (mmspec.core.tree.TokenTree) of N nodes is scored by one target forward over
# [root, node_0 .. node_{N-1}]: target row 0 is the distribution after the root (scoring the root's
# children), row 1 + i the distribution after node i (scoring node i's children, or the bonus token).
# The rules decide, for every row in parallel, which child (if any) is accepted first; the accepted
# path is then followed from the root with gathers, so nothing here synchronises with the device.


@dataclass
class TreeVerification(Verification):
    """Result of verifying one token tree per row.

    Attributes:
        num_accepted: LongTensor [B], depth of the accepted path (0..D); committed length = num_accepted + 1.
        tokens: LongTensor [B, D+1], the accepted path's tokens, then the corrected/bonus token, then PAD.
        path: LongTensor [B, D], node indices of the accepted path from the root down, then PAD.
    """

    path: torch.Tensor | None = None


def _first_accepted_child(tree: TokenTree, accept: torch.Tensor) -> torch.Tensor:
    """accept [B, N] bool -> [B, N+1]: per target row, the first child (in try order) with
    accept True, or PAD."""
    first = accept.new_full((accept.shape[0], tree.size + 1), PAD, dtype=torch.long)
    for nodes, rows in reversed(tree.sibling_groups()):  # lower ranks overwrite higher ones
        nodes, rows = nodes.to(accept.device), rows.to(accept.device)
        first[:, rows] = torch.where(accept[:, nodes], nodes, first[:, rows])
    return first


def _walk(tree: TokenTree, first_child: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow first accepted children from the root.

    Returns:
        path [B, D] (PAD-padded node indices), num_accepted [B], stop_row [B] (the target row after
        the last accepted node: 0 when nothing was accepted).
    """
    batch = first_child.shape[0]
    row = first_child.new_zeros(batch)
    alive = torch.ones(batch, dtype=torch.bool, device=first_child.device)
    steps = []
    for _ in range(tree.max_depth):
        child = first_child.gather(1, row.unsqueeze(1)).squeeze(1)
        alive = alive & (child >= 0)
        steps.append(torch.where(alive, child, PAD))
        row = torch.where(alive, child + 1, row)
    path = torch.stack(steps, dim=1) if steps else first_child.new_zeros(batch, 0)
    return path, (path >= 0).sum(dim=1), row


def _tree_assemble(tree: TokenTree, path: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> TreeVerification:
    tokens = tree.tokens.to(path.device).expand(path.shape[0], tree.size)
    path_tokens = tokens.gather(1, path.clamp(min=0))  # [B, D]; entries past num_accepted are dropped
    v = _assemble(path_tokens, num_accepted, next_token)
    return TreeVerification(num_accepted=v.num_accepted, tokens=v.tokens, path=path)


def _host_greedy_walk(tree: TokenTree, target_argmax: torch.Tensor) -> TreeVerification:
    """:func:`tree_greedy_verify` for one tree whose argmaxes [1, N+1] are on the host: the same
    walk over Python lists (a few microseconds, where the tensor form is ~40 small operations)."""
    argmax, tokens = target_argmax[0].tolist(), tree.tokens.tolist()
    path, row = [], 0
    while True:
        child = next((c for c in tree.children(row - 1) if tokens[c] == argmax[row]), None)
        if child is None:
            break
        path.append(child)
        row = child + 1
    depth = tree.max_depth
    padded = path + [PAD] * (depth - len(path))
    out_tokens = [tokens[c] for c in path] + [argmax[row]] + [PAD] * (depth - len(path))
    return TreeVerification(num_accepted=torch.tensor([len(path)]), tokens=torch.tensor([out_tokens]),
                            path=torch.tensor([padded], dtype=torch.long))


def tree_greedy_verify(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerification:
    """Greedy rule on a tree: from the root, follow the (first) child equal to argmax p of its
    parent's row; at the first row without such a child emit argmax p there.

    With a chain-shaped tree this is :func:`greedy_verify`.

    Args:
        tree: TokenTree with tokens [N] or [B, N] (probs are ignored).
        target_logits: [B, N+1, V] target logits (or probabilities) for [root, node_0 .. node_{N-1}].
    """
    target_argmax = exact_argmax(target_logits)  # [B, N+1]
    batch = target_argmax.shape[0]
    if batch == 1 and target_argmax.device.type == "cpu" and tree.tokens.dim() == 1:
        return _host_greedy_walk(tree, target_argmax)
    tokens = tree.tokens.to(target_argmax.device).expand(batch, tree.size)
    parent_rows = (tree.parents + 1).to(target_argmax.device)
    accept = tokens == target_argmax[:, parent_rows]  # [B, N]
    path, num_accepted, stop_row = _walk(tree, _first_accepted_child(tree, accept))
    next_token = target_argmax.gather(1, stop_row.unsqueeze(1)).squeeze(1)
    return _tree_assemble(tree, path, num_accepted, next_token)


def tree_speculative_verify(
    tree: TokenTree,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> TreeVerification:
    """Multi-draft speculative sampling on a tree (SpecInfer, Miao et al. 2024). Output ~ p exactly.

    At a row with target distribution p and children x_1, x_2, ... (in try order), each x_j drawn
    from its q_j independently given the row's context:
        accept x_j iff r_j < min(1, p(x_j) / q_j(x_j)), with p the current residual;
        on rejection p <- norm(max(0, p - q_j)) and try x_{j+1}.
    The first accepted child becomes the next row; when every child is rejected the corrected token
    is sampled from the residual, and after the last accepted node with no accepted child (or a
    leaf) from that node's residual / p (the bonus token).

    Deterministic trees (``tree.probs is None``: top-k, n-gram, EAGLE-2) use q_j = one-hot(x_j):
    x_j is accepted with probability p(x_j) and its rejection zeroes p(x_j) and renormalises,
    i.e. sampling without replacement among the children.

    With a chain-shaped tree and the same uniforms this is :func:`speculative_verify`, bit for bit.

    Args:
        tree: TokenTree, tokens [N] or [B, N], probs [N, V] / [B, N, V] or None.
        target_probs: [B, N+1, V] target distributions for [root, node_0 .. node_{N-1}].
        accept_uniforms: [B, N] r_i ~ U(0, 1), one per node.
        sample_uniforms: [B] one U(0, 1) per row for the corrected/bonus token.
    """
    batch, rows_total, vocab = target_probs.shape
    device = target_probs.device
    tokens = tree.tokens.to(device).expand(batch, tree.size)
    residual = target_probs.clone()  # unnormalised weights of the current residual per row
    mass = torch.ones(batch, rows_total, 1, dtype=target_probs.dtype, device=device)  # their total
    accept = torch.zeros(batch, tree.size, dtype=torch.bool, device=device)
    for nodes, rows in tree.sibling_groups():
        nodes, rows = nodes.to(device), rows.to(device)
        x = tokens[:, nodes].unsqueeze(-1)  # [B, n, 1]
        if tree.probs is None:
            q = torch.zeros(batch, nodes.shape[0], vocab, dtype=target_probs.dtype, device=device).scatter_(-1, x, 1.0)
        else:
            q = tree.probs.to(device=device, dtype=target_probs.dtype).expand(batch, tree.size, vocab)[:, nodes]
        p_weights, p_mass = residual[:, rows], mass[:, rows]
        # r < p(x)/q(x) with p = weights / mass  <=>  r * q(x) * mass < weights(x)  (mass is exactly 1
        # until a row's first rejection, which keeps chains bit-identical to the linear rule)
        r = accept_uniforms[:, nodes].unsqueeze(-1)
        accept[:, nodes] = (r * q.gather(-1, x) * p_mass < p_weights.gather(-1, x)).squeeze(-1)
        p = p_weights / p_mass
        new_weights = (p - q).clamp_(min=0.0)
        new_mass = new_weights.sum(-1, keepdim=True)
        # A rejection has probability 0 when p == q, so the residual is then empty and never used;
        # keep p to stay well defined (as speculative_verify does).
        empty = new_mass <= 0
        residual[:, rows] = torch.where(empty, p, new_weights)
        mass[:, rows] = torch.where(empty, torch.ones_like(new_mass), new_mass)
    path, num_accepted, stop_row = _walk(tree, _first_accepted_child(tree, accept))
    rows_index = torch.arange(batch, device=device)
    next_token = sample_from_probs(residual[rows_index, stop_row], sample_uniforms)
    return _tree_assemble(tree, path, num_accepted, next_token)


def tree_typical_verify(
    tree: TokenTree,
    target_probs: torch.Tensor,
    sample_uniforms: torch.Tensor,
    *,
    posterior_threshold: float,
    posterior_alpha: float,
) -> TreeVerification:
    """Typical acceptance on a token tree, as Medusa verifies its candidate tree. Lossy.

    Node i (token x_i, parent row r) passes iff p_r(x_i) > min(eps, delta * exp(-H(p_r))). Among the
    nodes whose whole root path passes, the deepest is chosen (Medusa takes the candidate with the
    longest accepted prefix; ties go to the earliest node, i.e. the first in try order), and the
    token after it is sampled from p at that node's row (the bonus/corrected token). Unlike the
    first-accepted-child walk of the exact rules this can skip a passing child whose subtree is
    shallower. With a chain-shaped tree this is :func:`typical_verify`.

    Args:
        tree: TokenTree with tokens [N] or [B, N] (probs are ignored: the rule looks at p only).
        target_probs: [B, N+1, V] target distributions for [root, node_0 .. node_{N-1}].
        sample_uniforms: [B] one U(0, 1) per row for the token after the path.
    """
    tokens, parent_rows = _node_tokens_and_parent_rows(tree, target_probs)
    threshold = _typical_threshold(target_probs, posterior_threshold, posterior_alpha)  # [B, N+1]
    p_of_node = target_probs[:, parent_rows].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, N]
    return deepest_passing_path(tree, p_of_node > threshold[:, parent_rows], target_probs, sample_uniforms)


def _node_tokens_and_parent_rows(tree: TokenTree, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes' tokens [B, N] and, per node, the row of target_probs [B, N+1, V] that predicts it."""
    device = target_probs.device
    return tree.tokens.to(device).expand(target_probs.shape[0], tree.size), (tree.parents + 1).to(device)


def deepest_passing_path(tree: TokenTree, passes: torch.Tensor, target_probs: torch.Tensor,
                         sample_uniforms: torch.Tensor | None) -> TreeVerification:
    """Among the nodes whose whole root path passes (``passes`` [B, N] bool per node), the deepest
    (ties: the earliest node); the token after it is drawn from p at its row (argmax p when
    ``sample_uniforms`` is None). The tree form of the lossy rules that test each token on its own
    (Medusa's typical acceptance, VADUSA's top-k tolerance)."""
    batch = target_probs.shape[0]
    device = target_probs.device
    on_path = tree.ancestor_matrix().to(device)  # [N, N]: j is i or an ancestor of i
    path_passes = ~((~passes).unsqueeze(1) & on_path).any(-1)  # [B, N]
    depth = torch.where(path_passes, tree.depth.to(device), 0)
    if tree.size:
        best = depth.argmax(dim=1)  # the first deepest passing node
        num_accepted = depth.gather(1, best.unsqueeze(1)).squeeze(1)
        # its path, shallow first: the nodes on it ordered by depth, PAD beyond num_accepted
        members = on_path[best] & (num_accepted > 0).unsqueeze(1)  # [B, N]
        order = torch.where(members, tree.depth.to(device), tree.max_depth + 1).argsort(dim=1, stable=True)
        path = torch.where(torch.arange(tree.max_depth, device=device) < num_accepted.unsqueeze(1),
                           order[:, : tree.max_depth], PAD)
        stop_row = torch.where(num_accepted > 0, best + 1, 0)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
        path, stop_row = num_accepted.new_zeros(batch, 0), num_accepted
    row = target_probs[torch.arange(batch, device=device), stop_row]
    next_token = exact_argmax(row) if sample_uniforms is None else sample_from_probs(row, sample_uniforms)
    return _tree_assemble(tree, path, num_accepted, next_token)
