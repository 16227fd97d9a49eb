"""Image tokens through the core: LlamaGen-style target with classifier-free guidance, SJD
(every init, coupled) and an independent draft generator — greedy identical to AR, sampling
distributed as AR (ladder levels 2-3 on a tiny random generator with a 2x2 grid of 4 codes)."""

import itertools

import pytest
import torch
from distribution_check import joint_pvalue, two_stage
from tiny_models import tiny_llamagen

import mmspec
from mmspec.adapters.image_gen import LlamaGenTarget
from mmspec.core.sampling import SamplingConfig, logits_to_probs
from mmspec.drafters import ImageEagle2Drafter, ImageEagleDrafter, JacobiDrafter, ModelDrafter
from mmspec.drafters.jacobi import ProactiveJacobiDrafter, coupled_redraft
from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead

VOCAB, SIDE, PREFIX, CAPTION_DIM = 4, 2, 3, 8
GUIDANCE, TEMPERATURE, TOP_K = 2.0, 1.2, 3
RUNS = 2000


def tiny_generator(seed: int, dim: int = 32) -> LlamaGenTarget:
    return tiny_llamagen(seed, dim, VOCAB, SIDE, PREFIX, CAPTION_DIM)


@pytest.fixture(scope="module")
def target():
    return tiny_generator(0)


CAPTION = torch.randn(1, PREFIX, CAPTION_DIM, generator=torch.Generator().manual_seed(3))


def drafter_factory(target, spec):
    """A function giving a fresh drafter per call, its model built once: "draft" (a smaller
    generator), "eagle" / "eagle2" (random image EAGLE head over both guidance rows) or a spec string."""
    if spec == "draft":
        model = tiny_generator(1, dim=16)
        return lambda: ModelDrafter(model, num_draft_tokens=3)
    if spec == "pac":  # window 3 of a 4-token grid: a 2-candidate tree at the first carried position
        return lambda: ProactiveJacobiDrafter(3, branches=3, depth=1)
    if spec in ("eagle", "eagle2"):
        torch.manual_seed(5)
        head = ImageEagleHead(ImageEagleConfig(dim=32, n_head=2, grid=(SIDE, SIDE))).eval()
        if spec == "eagle":
            return lambda: ImageEagleDrafter(target, head, num_draft_tokens=3)
        return lambda: ImageEagle2Drafter(target, head, depth=3, top_k=2, num_nodes=5)
    return lambda: spec


def make_drafter(target, spec):
    """A fresh drafter (see :func:`drafter_factory`)."""
    return drafter_factory(target, spec)()


def generate(target, drafter, seed, do_sample=True, k=3):
    return mmspec.generate(target, drafter=drafter, max_new_tokens=SIDE * SIDE, do_sample=do_sample, temperature=TEMPERATURE,
                           top_k=TOP_K, seed=seed, num_draft_tokens=k, caption=CAPTION, guidance_scale=GUIDANCE)


def test_cached_forward_matches_full_forward(target):
    model = target.model
    tokens = torch.tensor([[1, 3, 0, 2]])
    with torch.no_grad():
        full = model(tokens, CAPTION).logits
        state, first = target.prefill({"caption": CAPTION, "guidance_scale": None})
        step = target.forward(state, tokens[:, :2])
        rest = target.forward(state, tokens[:, 2:3])
    torch.testing.assert_close(first.logits[0, 0], full[0, PREFIX - 1])
    torch.testing.assert_close(step.logits[0], full[0, PREFIX : PREFIX + 2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest.logits[0, 0], full[0, PREFIX + 2], atol=1e-5, rtol=1e-5)


def test_guided_logits_combine_both_halves(target):
    with torch.no_grad():
        state, out = target.prefill({"caption": CAPTION, "guidance_scale": GUIDANCE})
        cond = target.model(None, CAPTION).logits[0, -1]
        uncond = target.model(None, target.model.null_caption(1)).logits[0, -1]
    torch.testing.assert_close(out.logits[0, 0], uncond + GUIDANCE * (cond - uncond), atol=1e-5, rtol=1e-5)
    assert state.cache.layers[0].keys.shape[0] == 2  # both halves live in one cache


@pytest.mark.parametrize("spec", ["sjd:random", "sjd:horizontal", "sjd:vertical", "sjd-coupled:vertical", "draft", "eagle", "eagle2",
                                  "pac"])
def test_greedy_methods_equal_ar(target, spec):
    drafter = make_drafter(target, spec)
    ar = generate(target, None, 0, do_sample=False)
    out = generate(target, drafter, 0, do_sample=False)
    assert torch.equal(out.sequences, ar.sequences)
    assert out.stats.new_tokens == SIDE * SIDE


def exact_joint(target) -> dict[tuple[int, ...], float]:
    """Exact probability of every token grid under guided sampling with temperature and top-k."""
    config = SamplingConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K)
    joint = {}
    with torch.no_grad():
        for grid in itertools.product(range(VOCAB), repeat=SIDE * SIDE):
            state, out = target.prefill({"caption": CAPTION, "guidance_scale": GUIDANCE})
            rest = target.forward(state, torch.tensor([grid[:-1]]))
            logits = torch.cat([out.logits, rest.logits], dim=1)[0]
            probs = logits_to_probs(logits, config)
            joint[grid] = float(torch.prod(probs[torch.arange(len(grid)), torch.tensor(grid)]))
    return joint


@pytest.fixture(scope="module")
def joint(target):
    return exact_joint(target)


@pytest.mark.parametrize("spec", ["sjd:random", "sjd:vertical", "sjd-coupled:horizontal", "draft", "eagle", "eagle2", "pac"])
def test_sampling_methods_sample_the_guided_distribution(target, joint, spec):
    counts = {}
    accepted = 0
    new_drafter = drafter_factory(target, spec)  # models built once, a new drafter per run

    def draw(seed):
        nonlocal accepted
        out = generate(target, new_drafter(), seed)
        accepted += out.stats.accepted
        grid = tuple(out.sequences[0, PREFIX:].tolist())
        counts[grid] = counts.get(grid, 0) + 1

    # chi-square over grids with enough expected mass, the rest pooled (nothing outside the top-k support)
    runs, found = two_stage(RUNS, draw, lambda n: [joint_pvalue(counts, joint, n)])
    assert accepted > 0.05 * runs  # drafts were accepted, so the acceptance path was exercised
    assert found[0] > 1e-4


def test_coupled_redraft_is_distributed_as_the_new_distribution():
    gen = torch.Generator().manual_seed(0)
    v, n = 5, 200_000
    q = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    p = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.4])
    old = torch.multinomial(q, n, replacement=True, generator=gen)
    new = coupled_redraft(old, q.expand(n, v), p.expand(n, v), torch.rand(n, 2, generator=gen))
    freq = torch.bincount(new, minlength=v).float() / n
    torch.testing.assert_close(freq, p, atol=4e-3, rtol=0)
    # maximal coupling: P(new == old) = sum min(p, q)
    assert abs(float((new == old).float().mean()) - float(torch.minimum(p, q).sum())) < 4e-3


def test_the_carry_couples_each_old_draft_with_its_own_positions_new_distribution():
    """The stop-78 audit: _carry could pair old draft i with the new row i + 1 and no end-to-end
    test noticed. Rows with disjoint supports: every carried token lies in its own row's support,
    and the carried q is that row's distribution."""
    from types import SimpleNamespace

    drafter = JacobiDrafter(num_draft_tokens=3, coupled=True)
    drafter.context = SimpleNamespace(sampling=SamplingConfig(do_sample=True), generator=torch.Generator().manual_seed(0))
    logits = torch.full((3, 6), -1e9)
    logits[0, :2] = 0.0  # position c + 1: tokens 0, 1
    logits[1, 2:4] = 0.0  # c + 2: tokens 2, 3
    logits[2, 4:] = 0.0  # c + 3 (no old draft): tokens 4, 5
    old_probs = torch.zeros(2, 6)
    old_probs[:, 5] = 1.0  # the old drafts: token 5 at both positions, which neither new row allows
    for _ in range(50):
        drafter._carry(logits, torch.tensor([5, 5]), old_probs)
        tokens = drafter.carried_tokens.tolist()
        assert tokens[0] in (0, 1) and tokens[1] in (2, 3) and tokens[2] in (4, 5), tokens
    torch.testing.assert_close(drafter.carried_probs, logits_to_probs(logits, SamplingConfig(do_sample=True)))


def test_the_coupled_kernel_draws_the_pytorch_paths_codes():
    """coupled_rows (kernels/verify.c, what _carry calls where the kernels build) against
    coupled_redraft and sample_from_probs: the same codes bit for bit, over distributions with zeros,
    a row where p == q (nothing to correct) and rows whose old code p does not allow; an old code
    outside the vocabulary is left to the PyTorch path (None)."""
    from mmspec.core.sampling import sample_from_probs
    from mmspec.modeling.fast_linear import coupled_rows

    gen = torch.Generator().manual_seed(0)
    m, v = 9, 37
    for trial in range(300):
        p = torch.rand(m, v, generator=gen) ** 3
        p[p < 0.05] = 0.0
        p = p / p.sum(-1, keepdim=True)
        q = torch.rand(m - 1, v, generator=gen) ** 2
        q[trial % (m - 1)] = p[trial % (m - 1)]  # p == q: the coupling keeps or redraws from p
        q = q / q.sum(-1, keepdim=True)
        old = torch.multinomial(q, 1, generator=gen)[:, 0]
        uniforms = torch.rand(m, 2, generator=gen)
        got = coupled_rows(p, q, old, uniforms)
        if got is None:
            pytest.skip("the C kernels do not build here")
        expected = torch.cat([coupled_redraft(old, q, p[: m - 1], uniforms[: m - 1]), sample_from_probs(p[m - 1 :], uniforms[m - 1 :, 1])])
        assert torch.equal(got, expected), trial
    assert coupled_rows(p, q, torch.full((m - 1,), v), uniforms) is None


def test_vertical_init_copies_the_row_above(target):
    drafter = JacobiDrafter(num_draft_tokens=3, init="vertical")
    out = generate(target, drafter, 0, do_sample=False)
    assert drafter.describe()["init"] == "vertical" and out.stats.new_tokens == 4
    assert drafter._fresh(torch.tensor([1, 2]), 2, VOCAB, "cpu").tolist() == [1, 2]  # width 2: one row up


def test_sjd_rejects_unknown_init():
    with pytest.raises(ValueError, match="unknown SJD init"):
        JacobiDrafter(init="diagonal")


def test_llamagen_target_refuses_unknown_keywords(target):
    with pytest.raises(ValueError, match="unknown argument 'negative_caption'.*LlamaGenTarget.prefill"):
        mmspec.generate(target, max_new_tokens=2, caption=CAPTION, negative_caption=CAPTION)
