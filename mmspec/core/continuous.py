"""Continuous tokens in the core: the masked-AR sequence state, the final-step Gaussians a
diffusion head leaves, and continuous speculative decoding's acceptance (CSpD, Wang et al. 2024).

A continuous-token generator (MAR) emits each token x_0 in R^D by a reverse diffusion chain of
S Gaussian steps conditioned on the transformer's output z. Given the chain's noise
E = (x_T, eps_S .. eps_2), the token's conditional density is the last step's Gaussian

    p(x_0 | E) = N(x_0; mu_p(x_1^p(E)), Sigma_1^p),      p(x_0) = E_E[ p(x_0 | E) ].

Trajectory alignment (CSpD sec. 3.3) feeds draft and target the same E per token. Conditioned on
E, speculative sampling between the two final-step Gaussians is exact for p(x_0 | E) and hence,
integrating E out, for p(x_0):

    accept x ~ q(. | E)  iff  r < min(1, p(x | E) / q(x | E)),  r ~ U(0, 1)
    else draw from norm(max(0, p(. | E) - q(. | E)))   (acceptance-rejection, proposal p(. | E))

The paper (eq. 9) writes the ratio of the two *trajectory* densities, which multiplies the above
by S = prod_{t=2..T} sqrt|Sigma_t^q| / sqrt|Sigma_t^p|: the Jacobians of the maps E -> trajectory.
With a fixed variance schedule S = 1 and both agree; with learned variances (MAR's heads) S != 1
and the accepted-plus-resampled tokens no longer follow p (docs/continuous.md derives it;
tests/test_continuous.py measures it). The rule below is exact by default and takes the paper's
factor as an option (``trajectory_jacobian=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from .verify import Verification, _assemble


@dataclass
class FinalStep:
    """The last reverse step of K tokens' chains, per row.

    Attributes:
        mean: [B, K, D] mu_1, the final step's mean.
        std: [B, K, D] its standard deviation (> 0, temperature included).
        sample: [B, K, D] the model's own token x_0 = mean + std * eps_1.
        log_scale: [B, K] sum over steps t = 2..S and over dims of log std_t (the trajectory's
            Jacobian, used only by the paper's form of the ratio).
    """

    mean: torch.Tensor
    std: torch.Tensor
    sample: torch.Tensor
    log_scale: torch.Tensor

    def _map(self, fn) -> "FinalStep":
        """The same transform of every field (they share the [B, K] leading axes)."""
        return FinalStep(*(fn(getattr(self, f.name)) for f in fields(self)))

    def __getitem__(self, index) -> "FinalStep":
        """Slice the K axis (and rows): ``step[:, :k]``."""
        return self._map(lambda t: t[index])

    def pick(self, rows: torch.Tensor, positions: torch.Tensor) -> "FinalStep":
        """Position ``positions[m]`` of row ``rows[m]`` for each m: a FinalStep [M, 1]."""
        return self._map(lambda t: t[rows, positions].unsqueeze(1))

    @classmethod
    def cat(cls, steps: list["FinalStep"], dim: int = 1) -> "FinalStep":
        return cls(*(torch.cat([getattr(s, f.name) for s in steps], dim=dim) for f in fields(cls)))

    @property
    def length(self) -> int:
        return self.mean.shape[1]


@dataclass
class ContinuousOutput:
    """A continuous target's forward: the final steps of the K + 1 positions it predicted
    (position i conditioned on the committed tokens and drafts 1..i; position K is the bonus).
    ``hidden_states`` is always None (no drafter reads a continuous target's features yet)."""

    steps: FinalStep
    hidden_states: None = None

    @property
    def device(self) -> torch.device:
        return self.steps.mean.device

    def row(self, b: int, n: int, rows_per_item: int = 1) -> "ContinuousOutput":
        """Row b's first n positions of a batched output ([B, Q] final steps) -> [1, n]."""
        return ContinuousOutput(self.steps[b : b + 1, :n])


@dataclass
class ContinuousVerification(Verification):
    """Verification of continuous drafts: ``tokens`` [B, K + 1, D] (accepted drafts, the corrected or
    bonus token, zeros after), ``residual_tries`` [B] proposals the residual sampler drew, and
    ``residual_capped`` [B] rows where it gave up after ``max_tries`` (that row's token is then its
    last proposal, a draw from the target's final step rather than from the residual: not exact;
    counted in the stats)."""

    residual_tries: torch.Tensor | None = None
    residual_capped: torch.Tensor | None = None

    def record(self, stats) -> None:
        """Count the residual sampler's proposals and give-ups in ``stats.config``."""
        if self.residual_tries is not None:
            stats.config["residual_proposals"] = stats.config.get("residual_proposals", 0) + int(self.residual_tries.sum())
            stats.config["residual_capped"] = stats.config.get("residual_capped", 0) + int(self.residual_capped.sum())


class MaskedARState:
    """One continuous-token sequence generated in a fixed order (masked AR), batch size 1.

    There is no KV cache: a masked-AR transformer re-reads every known token at each forward, so the
    committed tokens are the whole state and rollback is forgetting tokens.

    Attributes:
        tokens: [1, n, D] committed tokens in generation order.
        order: LongTensor [N] grid position of the i-th generated token (shared by draft and target).
        noise: [N, S + 1, D] the diffusion noise of the i-th generated token (trajectory alignment:
            both models use noise[i] for the token at order[i]).
        condition: the target's conditioning (opaque to the core: class or text features).
        prompt_length: 0 (the condition is not a token sequence).
    """

    prompt_length = 0

    def __init__(self, order: torch.Tensor, noise: torch.Tensor, condition: Any, token_dim: int) -> None:
        if order.dim() != 1 or noise.dim() != 3 or noise.shape[0] != order.shape[0] or noise.shape[2] != token_dim:
            raise ValueError(f"order [N] and noise [N, S + 1, {token_dim}] must agree, got {tuple(order.shape)} and "
                             f"{tuple(noise.shape)}")
        self.order, self.noise, self.condition = order, noise, condition
        self.tokens = noise.new_zeros(1, 0, token_dim)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_positions(self) -> int:
        return self.order.shape[0]

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens

    def with_condition(self, condition: Any) -> "MaskedARState":
        """The same sequence (tokens, order, noise shared, not copied) under another model's
        conditioning: what a draft model reads."""
        view = MaskedARState.__new__(MaskedARState)
        view.order, view.noise, view.tokens, view.condition = self.order, self.noise, self.tokens, condition
        return view

    def verification_inputs(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """What the target's forward reads besides the state: the drafts [1, K, D] themselves."""
        return draft_tokens

    def commit(self, new_tokens: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Append accepted tokens [1, m, D] (``path`` must be None: no trees over continuous tokens)."""
        if path is not None:
            raise ValueError("continuous drafts are linear; a token tree cannot be committed to a MaskedARState")
        if self.length + new_tokens.shape[1] > self.num_positions:
            raise ValueError(f"{self.length} + {new_tokens.shape[1]} tokens exceed the {self.num_positions} positions")
        self.tokens = torch.cat([self.tokens, new_tokens.to(self.tokens)], dim=1)

    def rollback(self, length: int) -> None:
        """Forget every token after the first ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback length {length} outside [0, {self.length}]")
        self.tokens = self.tokens[:, :length]


class MaskedARBatch:
    """Several masked-AR sequences decoded together (:mod:`mmspec.core.batch`): there is no cache
    to share, so the batch is its rows; a target's ``forward_rows`` reads them all in one forward.

    Attributes:
        rows: the active rows' :class:`MaskedARState`; ids: their indices in the caller's batch.
    """

    rows_per_item = 1

    def __init__(self, rows: list[MaskedARState]) -> None:
        self.rows = rows
        self.ids = list(range(len(rows)))

    @property
    def size(self) -> int:
        return len(self.rows)

    def verification_inputs(self, drafts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each row's drafts [1, k_b, D], unpadded (the rows' queries are concatenated, not stacked)."""
        return list(drafts)

    def commit(self, committed: list[torch.Tensor]) -> None:
        """Append each row's committed tokens [1, m_b, D]."""
        for row, tokens in zip(self.rows, committed):
            row.commit(tokens)

    def keep(self, positions: list[int]) -> None:
        """Keep the active rows at ``positions`` (of ``range(size)``), dropping the others."""
        self.rows = [self.rows[i] for i in positions]
        self.ids = [self.ids[i] for i in positions]


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(std^2)) summed over the last dim: [..., D] -> [...] (float64)."""
    z = (x.double() - mean.double()) / std.double()
    return (-0.5 * z.pow(2) - std.double().log() - 0.5 * math.log(2 * math.pi)).sum(-1)


def cspd_log_ratio(tokens: torch.Tensor, draft: FinalStep, target: FinalStep, trajectory_jacobian: bool = False,
                   exponent_temperature: float = 1.0) -> torch.Tensor:
    """log of the acceptance ratio of drafted tokens [B, K, D]: [B, K].

    Exact form: log p(x | E) - log q(x | E) with the two final-step Gaussians.
    ``trajectory_jacobian``: the paper's eq. 9, adding sum_{t >= 2} (log sigma_t^q - log sigma_t^p).
    ``exponent_temperature`` T > 1 (lossy): both Gaussians' quadratic terms divided by T^2, as the
    released CSpD code does with T = 42.
    """
    # stretching both stds by T divides the quadratic terms by T^2; the normalisers' ratio is unchanged
    ratio = (gaussian_log_density(tokens, target.mean, target.std * exponent_temperature)
             - gaussian_log_density(tokens, draft.mean, draft.std * exponent_temperature))
    if trajectory_jacobian:
        ratio = ratio + (draft.log_scale.double() - target.log_scale.double())
    return ratio


def sample_residual(target: FinalStep, draft: FinalStep, generator: torch.Generator, log_factor: torch.Tensor | None = None,
                    max_tries: int = 4096, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row from norm(max(0, F p - q)) by acceptance-rejection (CSpD sec. 3.4).

    Proposal y ~ p = N(mu_p, Sigma_p) (the target's final step); accept with probability
    max(0, F p(y) - q(y)) / (F p(y)) = max(0, 1 - q(y) / (F p(y))): F p bounds the residual, so the
    accepted y follow it exactly. F = 1 for the exact rule (``log_factor`` None).

    Args:
        target, draft: FinalStep with K = 1 for M rows ([M, 1, D] / [M, 1]).
        generator: source of the proposals and their uniforms.
        log_factor: [M] log F per row, or None.
        max_tries: proposals per row before giving up (the row then takes its last proposal).
        chunk: proposals drawn per row at once.
    Returns:
        tokens [M, D], tries [M] (proposals drawn until acceptance), capped [M] bool.
    """
    mean, std = target.mean[:, 0].double(), target.std[:, 0].double()
    q_mean, q_std = draft.mean[:, 0].double(), draft.std[:, 0].double()
    rows, dim = mean.shape
    device = mean.device
    factor = torch.zeros(rows, dtype=torch.float64, device=device) if log_factor is None else log_factor.double().to(device)
    out = torch.zeros(rows, dim, dtype=torch.float64, device=device)
    tries = torch.zeros(rows, dtype=torch.long, device=device)
    pending = torch.ones(rows, dtype=torch.bool, device=device)
    while bool(pending.any()) and int(tries.max()) < max_tries:
        idx = pending.nonzero().squeeze(1)
        eps = torch.randn(idx.numel(), chunk, dim, generator=generator, device=generator.device, dtype=torch.float64).to(device)
        u = torch.rand(idx.numel(), chunk, generator=generator, device=generator.device, dtype=torch.float64).to(device)
        y = mean[idx, None] + std[idx, None] * eps
        log_p = gaussian_log_density(y, mean[idx, None], std[idx, None]) + factor[idx, None]
        log_q = gaussian_log_density(y, q_mean[idx, None], q_std[idx, None])
        ok = u < -torch.expm1(torch.clamp(log_q - log_p, max=0.0))  # u < 1 - q / (F p), never for q >= F p
        ok &= torch.arange(chunk, device=device) < (max_tries - tries[idx]).unsqueeze(1)
        hit = ok.any(1)
        first = ok.long().argmax(1)
        out[idx[hit]] = y[hit, first[hit]]
        tries[idx] += torch.where(hit, first + 1, torch.full_like(first, chunk).clamp(max=max_tries))
        last = y[:, -1]
        out[idx[~hit]] = last[~hit]
        pending[idx[hit]] = False
    return out.to(target.mean.dtype), tries, pending


def cspd_verify(draft: FinalStep | None, target: FinalStep, uniforms: torch.Tensor, generator: torch.Generator,
                trajectory_jacobian: bool = False, max_tries: int = 4096,
                exponent_temperature: float = 1.0) -> ContinuousVerification:
    """Continuous speculative sampling of K drafted tokens per row.

    Args:
        draft: [B, K] final steps of the draft's chains; ``draft.sample`` are the drafted tokens
            (None: no draft, K = 0; the token is the target's own sample).
        target: [B, K + 1] the target's final steps with the same noise (position K: the bonus).
        uniforms: [B, K + 1] r per draft position (the last one unused: the bonus token is the
            target's own sample).
        generator: randomness of the residual sampler.
        trajectory_jacobian: use the paper's ratio (eq. 9) instead of the exact one.
        exponent_temperature: T > 1 tempers the ratio's exponent (lossy; the residual stays
            norm(max(0, p - q))).
    Returns:
        :class:`ContinuousVerification`.
    """
    if draft is None:
        batch = target.mean.shape[0]
        return ContinuousVerification(num_accepted=torch.zeros(batch, dtype=torch.long, device=target.mean.device),
                                      tokens=target.sample[:, :1])
    batch, k = draft.mean.shape[:2]
    tokens_in = draft.sample
    log_ratio = cspd_log_ratio(tokens_in, draft, target[:, :k], trajectory_jacobian, exponent_temperature)
    accept = uniforms[:, :k].double().log() < log_ratio  # r < min(1, ratio)
    num_accepted = accept.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=num_accepted.device)
    next_token = target.sample[rows, num_accepted]  # the bonus where all were accepted
    tries = torch.zeros(batch, dtype=torch.long, device=num_accepted.device)
    capped = torch.zeros(batch, dtype=torch.bool, device=num_accepted.device)
    rejected = (num_accepted < k).nonzero().squeeze(1)
    if rejected.numel():
        at = num_accepted[rejected]
        p, q = target.pick(rejected, at), draft.pick(rejected, at)
        log_factor = (q.log_scale[:, 0] - p.log_scale[:, 0]) if trajectory_jacobian else None
        resampled, tries[rejected], capped[rejected] = sample_residual(p, q, generator, log_factor, max_tries)
        next_token = next_token.clone()
        next_token[rejected] = resampled
    assembled = _assemble(tokens_in, num_accepted, next_token, pad=0.0)
    return ContinuousVerification(num_accepted=num_accepted, tokens=assembled.tokens, residual_tries=tries,
                                  residual_capped=capped)
