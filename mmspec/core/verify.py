"""Acceptance rules: pure functions, randomness passed in.

Every rule takes K drafted tokens per row and the target's K+1 next-token distributions (position
i scores the token that follows draft i-1; position K is the bonus position) and returns a
:class:`Verification`: how many drafts were accepted and the tokens to commit, i.e. the accepted
drafts followed by one corrected (on rejection) or bonus (all accepted) token, padded with -1.

Notation (../shared/algorithms.md): p = target distribution, q = draft distribution after the
same transform, x = drafted token, r ~ U(0, 1).

No rule touches a model, a cache or a global random state; none calls ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from .sampling import sample_from_probs

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


def _accepted_prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] number of leading True values."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> Verification:
    """Accepted drafts, the next token at position num_accepted, PAD after it."""
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device).expand(batch, k + 1)
    padded_draft = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), PAD)], dim=1)
    n = num_accepted.unsqueeze(1)
    tokens = torch.where(positions < n, padded_draft, torch.full_like(padded_draft, PAD))
    tokens = torch.where(positions == n, next_token.unsqueeze(1), tokens)
    return Verification(num_accepted=num_accepted, tokens=tokens)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verification:
    """Greedy rule: accept x_i while x_i == argmax p_i; then emit argmax p at the first mismatch
    (or at the bonus position K when all K are accepted).

    Args:
        draft_tokens: LongTensor [B, K].
        target_logits: [B, K+1, V] target logits (or probabilities; only the argmax is used).
    """
    target_argmax = target_logits.argmax(dim=-1)  # [B, K+1]
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
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        q_rows = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    else:
        q_rows = draft_probs.to(target_probs.dtype)
    q_rows = torch.cat([q_rows, q_rows.new_zeros(batch, 1, vocab)], dim=1)
    residual = (p_next - q_rows[rows, num_accepted]).clamp_(min=0.0)
    # A rejection has probability 0 when p == q, so the residual is then empty and never used;
    # fall back to p to keep the draw well defined.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    next_token = sample_from_probs(residual, sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)


def typical_verify(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    sample_uniforms: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
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
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [B, K]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    p_of_draft = probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    num_accepted = _accepted_prefix_length(p_of_draft > threshold)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    next_token = sample_from_probs(target_probs[rows, num_accepted], sample_uniforms)
    return _assemble(draft_tokens, num_accepted, next_token)
