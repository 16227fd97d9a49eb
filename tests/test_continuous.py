"""Continuous speculative decoding in the core (mmspec.core.continuous, the "cspd" rule): the
trajectory density ratio against explicit trajectory densities, the acceptance rate against a
Monte-Carlo integral, and the distribution of accepted-plus-resampled tokens against the target's
own chain on 1-D and 2-D toy diffusion heads, with negative controls that must fail."""

import math

import pytest
import torch

from mmspec.core.continuous import FinalStep, MaskedARState, cspd_log_ratio, cspd_verify, gaussian_log_density, sample_residual
from mmspec.core.rules import resolve_rule
from mmspec.core.sampling import SamplingConfig
from mmspec.modeling.diffusion import DiffusionSchedule, sample_chain

# few, coarse steps: a final-step std large enough for draft and target to overlap (rate ~0.3-0.6)
SCHEDULE = DiffusionSchedule(num_train_steps=12, schedule="cosine", sampling_steps=12)


def mixture_head(means, scales, weights, v):
    """The exact eps-predictor of x_0 ~ sum_k w_k N(m_k, s_k^2 I), with a constant learned-variance
    output v in [-1, 1] (so two heads with different v have different step variances)."""
    means, scales, weights = torch.tensor(means), torch.tensor(scales), torch.tensor(weights)
    abar_table = SCHEDULE.train_abar.float()

    def net(x, t, condition):
        abar = abar_table[t].unsqueeze(1)  # [M, 1]
        var = abar.unsqueeze(2) * scales.pow(2)[None, :, None] + (1 - abar.unsqueeze(2))  # [M, K, 1]
        centre = abar.sqrt().unsqueeze(2) * means[None]  # [M, K, D]
        log_r = weights.log()[None] - 0.5 * ((x[:, None] - centre).pow(2) / var + var.log()).sum(-1)
        resp = log_r.softmax(-1).unsqueeze(2)  # [M, K, 1]
        x0_k = means[None] + abar.sqrt().unsqueeze(2) * scales.pow(2)[None, :, None] / var * (x[:, None] - centre)
        x0 = (resp * x0_k).sum(1)
        eps = (x - abar.sqrt() * x0) / (1 - abar).sqrt()
        return torch.cat([eps, torch.full_like(eps, v)], dim=-1)

    return net


TARGETS = {
    1: mixture_head([[-1.0], [1.2]], [0.35, 0.5], [0.4, 0.6], v=0.4),
    2: mixture_head([[-1.0, 0.5], [1.0, -0.5]], [0.4, 0.45], [0.5, 0.5], v=0.4),
}
DRAFTS = {
    1: mixture_head([[-0.8], [1.0]], [0.45, 0.4], [0.55, 0.45], v=-0.6),
    2: mixture_head([[-0.7, 0.3], [1.2, -0.2]], [0.5, 0.4], [0.4, 0.6], v=-0.6),
}


def chains(dim, rows, seed, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(rows, SCHEDULE.sampling_steps + 1, dim, generator=g)
    cond = torch.zeros(rows, 1)
    return (sample_chain(DRAFTS[dim], SCHEDULE, cond, noise, temperature),
            sample_chain(TARGETS[dim], SCHEDULE, cond, noise, temperature), g)


def one_token(draft: FinalStep, target: FinalStep) -> tuple[FinalStep, FinalStep]:
    """Each row as a draft of K = 1 (rows independent): [M, 1] drafts, [M, 2] target (the second
    position, the unused bonus, copies the first)."""
    draft = FinalStep(*(getattr(draft, n).transpose(0, 1) for n in ("mean", "std", "sample", "log_scale")))
    target = FinalStep(*(getattr(target, n).transpose(0, 1) for n in ("mean", "std", "sample", "log_scale")))
    return draft, FinalStep.cat([target, target])


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic of 1-D samples."""
    values = torch.cat([a, b]).sort().values
    cdf_a = torch.searchsorted(a.sort().values, values, right=True).double() / a.numel()
    cdf_b = torch.searchsorted(b.sort().values, values, right=True).double() / b.numel()
    return float((cdf_a - cdf_b).abs().max())


def max_ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """KS over each coordinate and the diagonal projections of [M, D] samples."""
    directions = [torch.eye(a.shape[1])[i] for i in range(a.shape[1])]
    if a.shape[1] == 2:
        directions += [torch.tensor([1.0, 1.0]) / math.sqrt(2), torch.tensor([1.0, -1.0]) / math.sqrt(2)]
    return max(ks_distance(a @ d, b @ d) for d in directions)


ROWS = 20000
# KS critical value at alpha = 1e-4 for two samples of ROWS: c sqrt(2 / ROWS), c = sqrt(-ln(alpha / 2) / 2)
CRITICAL = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt(2 / ROWS)


def cspd_tokens(dim, seed, **kwargs):
    draft, target, g = chains(dim, ROWS, seed)
    d, t = one_token(draft, target)
    uniforms = torch.rand(ROWS, 2, generator=g)
    out = cspd_verify(d, t, uniforms, g, **kwargs)
    return out.tokens[:, 0], out


def target_tokens(dim, seed):
    return chains(dim, ROWS, seed)[1].sample[0]


def test_paper_ratio_is_the_ratio_of_trajectory_densities():
    """eq. 9's form: the product of each model's step densities along its own trajectory, which
    ends in the drafted x_0, equals the final-step ratio times prod_t sigma_t^q / sigma_t^p."""
    dim, rows = 2, 64
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(rows, SCHEDULE.sampling_steps + 1, dim, generator=g)
    cond = torch.zeros(rows, 1)

    def trajectory_log_density(net, x0):
        x, total = noise[:, 0], torch.zeros(rows, dtype=torch.float64)
        for j, index in enumerate(range(SCHEDULE.sampling_steps - 1, -1, -1), start=1):
            mean, std = SCHEDULE.step_gaussian(net(x, SCHEDULE.timesteps[index].expand(rows), cond), x, index)
            nxt = mean + std * noise[:, j] if index > 0 else x0
            total += gaussian_log_density(nxt, mean, std)
            x = nxt
        return total

    draft = sample_chain(DRAFTS[dim], SCHEDULE, cond, noise)
    target = sample_chain(TARGETS[dim], SCHEDULE, cond, noise)
    x0 = draft.sample[0]
    explicit = trajectory_log_density(TARGETS[dim], x0) - trajectory_log_density(DRAFTS[dim], x0)
    paper = cspd_log_ratio(draft.sample, draft, target, trajectory_jacobian=True)[0]
    torch.testing.assert_close(paper, explicit, rtol=1e-4, atol=1e-3)
    exact = cspd_log_ratio(draft.sample, draft, target)[0]
    assert (paper - exact).abs().min() > 1.0  # the heads' step variances differ: the factor matters here


def test_acceptance_rate_matches_monte_carlo_overlap():
    """P(accept) = E_E[ integral min(p(x|E), q(x|E)) dx ]: the rule's empirical acceptance against
    the overlap of the two final-step Gaussians integrated numerically per noise draw (1-D)."""
    draft, target, g = chains(1, ROWS, 1)
    d, t = one_token(draft, target)
    out = cspd_verify(d, t, torch.rand(ROWS, 2, generator=g), g)
    # step 0.004 (the stds are >= 0.125): the integral moves by 2e-7 from a grid 4x finer, the tolerance below is 0.014
    grid = torch.linspace(-4, 4, 2001, dtype=torch.float64)[None, :, None]
    overlap = []
    for rows in torch.arange(ROWS).split(2000):  # 2,000 rows at a time (all 20,000 at once held gigabytes)
        p = gaussian_log_density(grid, t.mean[rows, :1].double(), t.std[rows, :1].double()).exp()
        q = gaussian_log_density(grid, d.mean[rows].double(), d.std[rows].double()).exp()
        overlap.append(torch.minimum(p, q).sum(1) * float(grid[0, 1, 0] - grid[0, 0, 0]))
    overlap = torch.cat(overlap)
    expected, observed = float(overlap.mean()), float(out.num_accepted.double().mean())
    assert 0.1 < expected < 0.9  # a test with something to reject
    assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / ROWS)


def test_marginal_is_the_average_of_final_step_densities():
    """What exactness rests on: p(x_0) = E_E[p(x_0 | E)]. A histogram of the chain's samples
    against the Monte-Carlo average of the final-step Gaussian densities over the same noise draws."""
    _, target, _ = chains(1, ROWS, 2)
    edges = torch.linspace(-2.5, 2.5, 26, dtype=torch.float64)
    counts = torch.histc(target.sample[0, :, 0].double(), bins=25, min=-2.5, max=2.5) / ROWS
    mean, std = target.mean[0, :, 0].double(), target.std[0, :, 0].double()
    cdf = 0.5 * (1 + torch.erf((edges[None] - mean[:, None]) / (std[:, None] * math.sqrt(2))))
    mass = (cdf[:, 1:] - cdf[:, :-1]).mean(0)
    assert (counts - mass).abs().max() < 4 * math.sqrt(0.25 / ROWS)


@pytest.mark.parametrize("dim", [1, 2])
def test_accepted_plus_resampled_tokens_follow_the_target(dim):
    tokens, out = cspd_tokens(dim, seed=3)
    reference = target_tokens(dim, seed=4)
    rate = float(out.num_accepted.double().mean())
    assert 0.05 < rate < 0.95, rate  # both branches exercised
    assert not bool(out.residual_capped.any())
    assert max_ks(tokens, reference) < CRITICAL
    draft_only = chains(dim, ROWS, 5)[0].sample[0]
    assert max_ks(draft_only, reference) > 3 * CRITICAL  # the test can tell the draft from the target


@pytest.mark.parametrize("dim", [1, 2])
def test_wrong_ratios_fail(dim):
    """Negative controls: the same test rejects (a) the released code's exponent, tempered by 42^2
    (both final-step stds scaled by 42 in the ratio), and (b) the paper's trajectory-Jacobian
    factor, which is not exact when the heads' variances differ."""
    reference = target_tokens(dim, seed=4)
    draft, target, g = chains(dim, ROWS, 3)
    d, t = one_token(draft, target)
    out = cspd_verify(d, t, torch.rand(ROWS, 2, generator=g), g, exponent_temperature=42.0)
    assert max_ks(out.tokens[:, 0], reference) > 2 * CRITICAL
    tokens, _ = cspd_tokens(dim, seed=3, trajectory_jacobian=True)
    assert max_ks(tokens, reference) > CRITICAL  # rejected at alpha = 1e-4 (measured: 0.044 in 1-D, 0.034 in 2-D)


def test_paper_factor_is_exact_when_variances_agree():
    """With the same variance output on both heads the factor S is 1 and both forms coincide."""
    draft = mixture_head([[-0.8], [1.0]], [0.45, 0.4], [0.55, 0.45], v=0.4)
    g = torch.Generator().manual_seed(6)
    noise = torch.randn(256, SCHEDULE.sampling_steps + 1, 1, generator=g)
    cond = torch.zeros(256, 1)
    q, p = sample_chain(draft, SCHEDULE, cond, noise), sample_chain(TARGETS[1], SCHEDULE, cond, noise)
    torch.testing.assert_close(cspd_log_ratio(q.sample, q, p, True), cspd_log_ratio(q.sample, q, p), rtol=1e-9, atol=1e-9)


def test_residual_sampler_draws_the_normalised_difference():
    """norm(max(0, p - q)) for two fixed 1-D Gaussians, against its CDF by numerical integration."""
    rows = ROWS
    p = FinalStep(torch.zeros(rows, 1, 1), torch.ones(rows, 1, 1), torch.zeros(rows, 1, 1), torch.zeros(rows, 1))
    q = FinalStep(torch.full((rows, 1, 1), 0.8), torch.full((rows, 1, 1), 0.7), torch.zeros(rows, 1, 1), torch.zeros(rows, 1))
    y, tries, capped = sample_residual(p, q, torch.Generator().manual_seed(7))
    assert not bool(capped.any()) and int(tries.min()) >= 1
    grid = torch.linspace(-6, 6, 24001, dtype=torch.float64)
    dens = (gaussian_log_density(grid[:, None], torch.zeros(1), torch.ones(1)).exp()
            - gaussian_log_density(grid[:, None], torch.full((1,), 0.8), torch.full((1,), 0.7)).exp()).clamp(min=0)
    cdf = dens.cumsum(0) / dens.sum()
    empirical = torch.searchsorted(y[:, 0].double().sort().values, grid, right=True).double() / rows
    assert float((empirical - cdf).abs().max()) < 0.015
    # mean tries ~ 1 / TV (the residual's mass)
    tv = float(dens.sum() * (grid[1] - grid[0]))
    assert abs(float(tries.double().mean()) - 1 / tv) < 0.1 / tv


def test_verify_commits_the_accepted_prefix_then_one_token():
    k, dim = 3, 2
    mean = torch.zeros(1, k + 1, dim)
    target = FinalStep(mean, torch.ones(1, k + 1, dim), torch.full((1, k + 1, dim), 7.0), torch.zeros(1, k + 1))
    draft = FinalStep(mean[:, :k], torch.ones(1, k, dim), torch.randn(1, k, dim), torch.zeros(1, k))
    g = torch.Generator().manual_seed(0)
    out = cspd_verify(draft, target, torch.tensor([[0.5, 0.5, 0.5, 0.5]]), g)  # p == q: all accepted
    assert int(out.num_accepted) == k
    torch.testing.assert_close(out.tokens[0, :k], draft.sample[0])
    torch.testing.assert_close(out.tokens[0, k], target.sample[0, k])  # the bonus: the target's own sample
    shifted = FinalStep(mean[:, :k] + torch.tensor([0.0, 30.0])[None, None], draft.std, draft.sample, draft.log_scale)
    out = cspd_verify(FinalStep(shifted.mean, shifted.std, draft.sample + torch.tensor([[[0, 0], [0, 30.0], [0, 0]]]),
                                draft.log_scale), target, torch.tensor([[0.5, 0.5, 0.5, 0.5]]), g)
    assert int(out.num_accepted) == 1  # the second draft sits 30 sigma out under p: rejected
    assert bool((out.tokens[0, 2:] == 0).all())


def test_rule_registry_and_state():
    sample = SamplingConfig(do_sample=True)
    assert resolve_rule("auto", sample, continuous=True).name == "cspd"
    with pytest.raises(ValueError, match="does not verify continuous tokens"):
        resolve_rule("speculative", sample, continuous=True)
    with pytest.raises(ValueError, match="does not verify discrete tokens"):
        resolve_rule("cspd", sample)
    with pytest.raises(ValueError, match="needs do_sample=True"):
        resolve_rule("cspd", SamplingConfig(do_sample=False), continuous=True)
    with pytest.raises(ValueError, match="max_tries must be an integer >= 1"):
        resolve_rule("cspd", sample, {"max_tries": 0}, continuous=True)
    state = MaskedARState(torch.tensor([3, 0, 2, 1]), torch.zeros(4, 5, 2), None, token_dim=2)
    state.commit(torch.tensor([[[1.0, 1.0], [2.0, 2.0]]]))
    assert state.verification_inputs(torch.ones(1, 1, 2)).shape == (1, 1, 2)
    state.rollback(1)
    assert state.length == 1
    with pytest.raises(ValueError, match="linear"):
        state.commit(torch.zeros(1, 1, 2), path=torch.tensor([0]))


def test_clip_denoised_bounds_the_predicted_x0():
    """Near t = T, abar ~ 2e-9 turns an eps error into a huge x0_hat; the clamp bounds it."""
    schedule = DiffusionSchedule(1000, "cosine", 50, clip_denoised=2.0)
    plain = DiffusionSchedule(1000, "cosine", 50)
    x = torch.randn(4, 3)
    out = torch.cat([x + 0.05, torch.zeros(4, 3)], dim=-1)  # an eps off by 0.05 at the first reverse step
    wild, _ = plain.step_gaussian(out, x, 49)
    tame, _ = schedule.step_gaussian(out, x, 49)
    assert wild.abs().max() > 10 and tame.abs().max() < 2.0 * float(schedule.coef_x0[49]) + x.abs().max() * float(schedule.coef_xt[49]) + 1e-4
