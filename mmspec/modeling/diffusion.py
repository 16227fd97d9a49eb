"""The per-token Gaussian diffusion of MAR-style heads: schedule, training loss, and the sampling
chain with its noise passed in (what continuous speculative decoding aligns between two models).

A head net f(x_t, t, z) -> [eps_hat, v] (2D channels, "learned sigma" as in improved DDPM / ADM /
MAR) defines each reverse step as a Gaussian

    x0_hat  = (x_t - sqrt(1 - abar_t) eps_hat) / sqrt(abar_t)
    mu_t    = c1_t x0_hat + c2_t x_t                                     (the posterior mean)
    log s_t^2 = f log beta_t + (1 - f) log beta~_t,   f = (v + 1) / 2     (learned interpolation)
    x_{t-1} = mu_t + tau s_t eps_t,   eps_t ~ N(0, I)                     (tau: temperature)

over a respaced subset of the training timesteps. Unlike ADM, the last step keeps its noise: its
Gaussian N(mu_1, (tau s_1)^2) is the density continuous speculative decoding evaluates.

A trajectory's randomness is ``noise`` [M, S + 1, D]: row 0 is x_T, row j (1..S) the eps of the
j-th reverse step; two models fed the same noise follow "aligned" trajectories (CSpD, Wang et al.
2024, sec. 3.3).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..core.continuous import FinalStep

#: net(x_t [M, D], timesteps LongTensor [M] (training-schedule indices), condition [M, C]) -> [M, 2D];
#: a head may also offer ``chain(condition [M, C], timesteps [S]) -> step(x_t [M, D], index) -> [M, 2D]``
HeadNet = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GuidedHead:
    """Classifier-free guidance on a head's eps: eps = eps_u + w (eps_c - eps_u), the variance output
    from the conditional rows (MAR's rule). The condition holds the conditional rows [M, C], then
    the unconditional [M, C]; x_t [M, D] is shared by both."""

    def __init__(self, net: HeadNet, scale: float) -> None:
        self.net, self.scale = net, scale

    def _combine(self, out: torch.Tensor, dim: int) -> torch.Tensor:
        cond, uncond = out.chunk(2)
        eps = uncond[:, :dim] + self.scale * (cond[:, :dim] - uncond[:, :dim])
        return torch.cat([eps, cond[:, dim:]], dim=-1)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return self._combine(self.net(torch.cat([x, x]), torch.cat([t, t]), condition), x.shape[-1])

    def chain(self, condition: torch.Tensor, timesteps: torch.Tensor):
        if not hasattr(self.net, "chain"):
            return lambda x, index: self(x, timesteps[index].expand(x.shape[0]), condition)
        inner = self.net.chain(condition, timesteps)
        return lambda x, index: self._combine(inner(torch.cat([x, x]), index), x.shape[-1])


def _cosine_betas(num_steps: int, max_beta: float = 0.999) -> torch.Tensor:
    """Nichol & Dhariwal's cosine schedule: abar(t) = cos^2(((t / T) + s) / (1 + s) * pi / 2), s = 0.008."""
    def abar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return torch.tensor([min(1 - abar((i + 1) / num_steps) / abar(i / num_steps), max_beta) for i in range(num_steps)],
                        dtype=torch.float64)


def _linear_betas(num_steps: int) -> torch.Tensor:
    """DDPM's linear schedule, scaled to ``num_steps`` as in improved DDPM."""
    scale = 1000 / num_steps
    return torch.linspace(scale * 1e-4, scale * 0.02, num_steps, dtype=torch.float64)


SCHEDULES = {"cosine": _cosine_betas, "linear": _linear_betas}
SPACINGS = ("even", "trailing")


class DiffusionSchedule:
    """A training schedule of ``num_train_steps`` and its respacing to ``sampling_steps`` reverse steps.

    Args:
        num_train_steps: T of training (MAR: 1000).
        schedule: "cosine" (MAR) or "linear".
        sampling_steps: S reverse steps at sampling (MAR: 100).
        spacing: which S of the T timesteps: "even" (ADM / MAR: round(i (T - 1) / (S - 1)), the last
            step from t = 0) or "trailing" (round((i + 1) T / S) - 1: the last step leaves from
            t = T / S - 1, so its Gaussian, the one CSpD compares, is wider).
        clip_denoised: clamp each step's predicted x_0 to [-c, c] (ADM's clip_denoised, with the
            data's range c). Near t = T of the cosine schedule abar is ~2e-9, so x0_hat carries the
            eps error times ~2e4; MAR runs unclipped, which needs an eps error far below a small
            model's. None: no clamp.
    """

    def __init__(self, num_train_steps: int = 1000, schedule: str = "cosine", sampling_steps: int = 100,
                 spacing: str = "even", clip_denoised: float | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown noise schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
        if not 1 <= sampling_steps <= num_train_steps:
            raise ValueError(f"sampling_steps must be in [1, {num_train_steps}], got {sampling_steps}")
        self.num_train_steps, self.schedule, self.sampling_steps = num_train_steps, schedule, sampling_steps
        self.clip_denoised = clip_denoised
        betas = SCHEDULES[schedule](num_train_steps)
        self.train_abar = torch.cumprod(1 - betas, 0)
        if spacing not in SPACINGS:
            raise ValueError(f"unknown timestep spacing {spacing!r}; choose one of {SPACINGS}")
        if spacing == "even":  # ADM's space_timesteps with one section
            stride = (num_train_steps - 1) / max(sampling_steps - 1, 1)
            kept = sorted({round(i * stride) for i in range(sampling_steps)})
        else:
            kept = sorted({round((i + 1) * num_train_steps / sampling_steps) - 1 for i in range(sampling_steps)})
        self.timesteps = torch.tensor(kept, dtype=torch.long)  # respaced index -> training timestep
        abar = self.train_abar[self.timesteps]
        abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
        beta = 1 - abar / abar_prev
        posterior_var = beta * (1 - abar_prev) / (1 - abar)
        # beta~ is 0 at the last reverse step (log 0): use the next step's value, as ADM clips it
        self.log_beta = beta.log().float()
        self.log_posterior_var = torch.cat([posterior_var[1:2], posterior_var[1:]]).log().float()
        self.sqrt_recip_abar = (1 / abar).sqrt().float()
        self.sqrt_recipm1_abar = (1 / abar - 1).sqrt().float()
        self.coef_x0 = (beta * abar_prev.sqrt() / (1 - abar)).float()
        self.coef_xt = ((1 - abar_prev) * (1 - beta).sqrt() / (1 - abar)).float()

    def step_gaussian(self, net_out: torch.Tensor, x_t: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reverse step at respaced ``index`` (S - 1 first, 0 last) as a Gaussian.

        Args:
            net_out: [M, 2D] the head's [eps_hat, v]; x_t: [M, D].
        Returns:
            mean, std: [M, D] of x_{t-1} | x_t (std before the temperature).
        """
        dim = x_t.shape[-1]
        eps, v = net_out[:, :dim].float(), net_out[:, dim:].float()
        x0 = self.sqrt_recip_abar[index] * x_t - self.sqrt_recipm1_abar[index] * eps
        if self.clip_denoised is not None:
            x0 = x0.clamp(-self.clip_denoised, self.clip_denoised)
        mean = self.coef_x0[index] * x0 + self.coef_xt[index] * x_t
        frac = (v + 1) / 2
        log_var = frac * self.log_beta[index] + (1 - frac) * self.log_posterior_var[index]
        return mean, (0.5 * log_var).exp()

    # training ---------------------------------------------------------------------------------
    def training_loss(self, net: HeadNet, x0: torch.Tensor, condition: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """improved DDPM's hybrid loss on the training schedule: ||eps - eps_hat||^2 plus the
        variational bound of the learned variance (mean detached), per token, averaged.

        Args:
            x0: [M, D] clean tokens; condition: [M, C].
        """
        m, dim = x0.shape
        drawn_on = generator.device if generator is not None else x0.device  # a CPU generator serves a GPU run too
        t = torch.randint(0, self.num_train_steps, (m,), generator=generator, device=drawn_on).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator, device=drawn_on, dtype=x0.dtype).to(x0.device)
        abar = self.train_abar.to(x0.device)[t].float().unsqueeze(1)
        x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
        out = net(x_t, t, condition)
        eps, v = out[:, :dim], out[:, dim:]
        mse = (eps - noise).pow(2).mean(-1)
        # vb term: KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t)) on the training schedule, mean frozen
        abar_all = self.train_abar.to(x0.device)
        abar_prev = torch.where(t > 0, abar_all[(t - 1).clamp(min=0)], torch.ones_like(abar_all[t])).float().unsqueeze(1)
        beta = 1 - abar / abar_prev
        post_var = beta * (1 - abar_prev) / (1 - abar)
        post_mean = (beta * abar_prev.sqrt() / (1 - abar)) * x0 + ((1 - abar_prev) * (1 - beta).sqrt() / (1 - abar)) * x_t
        x0_hat = (x_t - (1 - abar).sqrt() * eps.detach()) / abar.sqrt()
        model_mean = (beta * abar_prev.sqrt() / (1 - abar)) * x0_hat + ((1 - abar_prev) * (1 - beta).sqrt() / (1 - abar)) * x_t
        log_post_var = torch.where(t.unsqueeze(1) > 0, post_var.clamp(min=1e-20).log(), beta.log())
        frac = (v + 1) / 2
        model_log_var = frac * beta.log() + (1 - frac) * log_post_var
        kl = 0.5 * (model_log_var - log_post_var + (log_post_var - model_log_var).exp()
                    + (post_mean - model_mean).pow(2) * (-model_log_var).exp() - 1)
        nll = 0.5 * ((x0 - model_mean).pow(2) * (-model_log_var).exp() + model_log_var + math.log(2 * math.pi))
        vb = torch.where(t.unsqueeze(1) > 0, kl, nll).mean(-1) / math.log(2.0)
        return (mse + vb * self.num_train_steps / 1000).mean()


def sample_chain(net: HeadNet, schedule: DiffusionSchedule, condition: torch.Tensor, noise: torch.Tensor,
                 temperature: float = 1.0) -> FinalStep:
    """Run the reverse chain of M tokens with the given noise.

    Args:
        net: the head (with classifier-free guidance already folded in, if any).
        condition: [M, C] the transformer's per-token condition z.
        noise: [M, S + 1, D]: x_T, then the eps of each of the S reverse steps (the last one is the
            final step's eps_1).
        temperature: tau, multiplying every step's standard deviation.
    Returns:
        :class:`~mmspec.core.continuous.FinalStep` over [1, M]: the final step's mean mu_1 and
        std tau s_1, the token x_0 = mu_1 + tau s_1 eps_1, and sum_{t >= 2} sum_d log(tau s_t)
        (the trajectory's Jacobian d x / d eps, the factor the CSpD paper's ratio carries).
    """
    steps = schedule.sampling_steps
    if noise.dim() != 3 or noise.shape[1] != steps + 1:
        raise ValueError(f"noise must be [M, {steps + 1}, D] for {steps} sampling steps, got {tuple(noise.shape)}")
    x = noise[:, 0].float()
    log_scale = x.new_zeros(x.shape[0])
    timesteps = schedule.timesteps.to(x.device)
    if hasattr(net, "chain"):  # a head that precomputes what does not depend on x_t (MAR's adaLN modulations)
        step = net.chain(condition, timesteps)
    else:
        def step(x_t: torch.Tensor, index: int) -> torch.Tensor:
            return net(x_t, timesteps[index].expand(x_t.shape[0]), condition)
    for j, index in enumerate(range(steps - 1, -1, -1), start=1):
        mean, std = schedule.step_gaussian(step(x, index), x, index)
        std = std * temperature
        if index > 0:
            x = mean + std * noise[:, j]
            log_scale = log_scale + std.log().sum(-1)
    sample = mean + std * noise[:, steps]
    return FinalStep(mean=mean.unsqueeze(0), std=std.unsqueeze(0), sample=sample.unsqueeze(0), log_scale=log_scale.unsqueeze(0))
