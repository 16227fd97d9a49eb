"""LANTERN / LANTERN++ / GSD rules (ladder level 1 and properties): neighbour tables, the TV bound,
reduction to exact speculative sampling, and hand-built accept / reject cases."""

import pytest
import torch

from mmspec.core.relaxed import (cached_neighbour_table, gsd_verify, lantern_greedy_verify, lantern_verify,
                                 neighbour_table, relaxed_mass)
from mmspec.core.verify import speculative_verify


def test_neighbour_table_is_nearest_first_without_self():
    codebook = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    table = neighbour_table(codebook, k=2, chunk=3)  # chunked: rows 0-2, then row 3
    assert table.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]
    big = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(neighbour_table(big, 5, chunk=64), neighbour_table(big, 5, chunk=1000))
    distance = torch.cdist(big, big).fill_diagonal_(float("inf"))
    assert torch.equal(neighbour_table(big, 5)[:, 0], distance.argmin(1))


def test_neighbour_table_cache(tmp_path):
    codebook = torch.randn(50, 4)
    first = cached_neighbour_table(codebook, 7, tmp_path)
    assert len(list(tmp_path.glob("neighbours-k7-*.pt"))) == 1
    assert torch.equal(cached_neighbour_table(codebook, 7, tmp_path), first)
    cached_neighbour_table(codebook + 1.0, 7, tmp_path)  # another codebook: another file
    assert len(list(tmp_path.glob("neighbours-k7-*.pt"))) == 2


@pytest.mark.parametrize("seed", range(30))
def test_relaxed_distribution_stays_within_the_tv_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 40, 12
    delta = float(torch.rand(1, generator=gen)) * 0.5
    p = torch.softmax(torch.randn(vocab, generator=gen) * 3, -1)
    table = neighbour_table(torch.randn(vocab, 3, generator=gen), k)
    for x in range(vocab):
        relaxed, in_a = relaxed_mass(p, torch.tensor(x), table, delta=delta)
        moved = torch.zeros(vocab, dtype=torch.bool)
        moved[table[x][in_a]] = True
        p_tilde = p.masked_fill(moved, 0.0)
        p_tilde[x] = relaxed
        assert abs(float(p_tilde.sum()) - 1.0) < 1e-5
        tv = 0.5 * float((p_tilde - p).abs().sum())
        assert tv <= delta + 1e-6
        # A is the longest such prefix: adding the next neighbour would break the bound
        j = int(in_a.sum())
        if j < k:
            assert float(p[table[x][: j + 1]].sum()) > delta


def test_multiplicative_bound_caps_the_ratio():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, 30, generator=gen) * 2, -1)
    table = neighbour_table(torch.randn(30, 4, generator=gen), 10)
    x = torch.randint(30, (6,), generator=gen)
    for lam in (1.0, 2.0, 5.0):
        relaxed, _ = relaxed_mass(p, x, table, lam=lam)
        assert torch.all(relaxed <= lam * p.gather(-1, x[:, None])[:, 0] + 1e-7)


@pytest.mark.parametrize("draft_probs", [True, False])
def test_zero_relaxation_is_speculative_sampling(draft_probs):
    gen = torch.Generator().manual_seed(2)
    b, k, v = 64, 4, 20
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=gen) * 2, -1) if draft_probs else None
    tokens = torch.randint(v, (b, k), generator=gen)
    r, s = torch.rand(b, k, generator=gen), torch.rand(b, generator=gen)
    table = neighbour_table(torch.randn(v, 3, generator=gen), 6)
    exact = speculative_verify(tokens, q, p, r, s)
    for relaxed in (lantern_verify(tokens, q, p, table, r, s, delta=0.0),
                    lantern_verify(tokens, q, p, table, r, s, delta=None, lam=1.0)):
        assert torch.equal(relaxed.num_accepted, exact.num_accepted) and torch.equal(relaxed.tokens, exact.tokens)


def test_hand_built_lantern_cases():
    # codes on a line: neighbours of 0 are 1, 2, 3 (nearest first)
    table = neighbour_table(torch.tensor([[0.0], [1.0], [2.0], [3.0]]), 3)
    p = torch.tensor([[[0.10, 0.05, 0.05, 0.80], [0.25, 0.25, 0.25, 0.25]]])
    draft = torch.tensor([[0]])
    # exact: p(0) = 0.1, r = 0.15 rejects; delta = 0.1 adds p(1) + p(2) = 0.1 -> 0.2 > 0.15 accepts
    r, s = torch.tensor([[0.15]]), torch.tensor([0.5])
    assert int(lantern_verify(draft, None, p, table, r, s, delta=0.0).num_accepted) == 0
    assert int(lantern_verify(draft, None, p, table, r, s, delta=0.1).num_accepted) == 1
    # delta = 0.07 keeps only neighbour 1 (c_1 = 0.05, c_2 = 0.10 > 0.07): p~ = 0.15, r = 0.15 rejects
    v = lantern_verify(draft, None, p, table, r, s, delta=0.07)
    assert int(v.num_accepted) == 0
    # on rejection x and A = {1} are zeroed: the residual draw can only give 2 or 3
    for u in torch.linspace(0, 0.999, 20):
        tok = int(lantern_verify(draft, None, p, table, r, u.view(1), delta=0.07).tokens[0, 0])
        assert tok in (2, 3)
    # greedy: p(0) + 0.1 = 0.2 < max p = 0.8 rejects; delta = 0.7 never reaches 0.8 either (c_3 = 0.9 > 0.7)
    greedy = lantern_greedy_verify(draft, p, table, delta=0.7)
    assert int(greedy.num_accepted) == 0 and int(greedy.tokens[0, 0]) == 3
    p_flat = torch.tensor([[[0.30, 0.30, 0.30, 0.10], [0.25, 0.25, 0.25, 0.25]]])
    accepted = lantern_greedy_verify(draft, p_flat, table, delta=0.3)  # 0.3 + 0.3 >= 0.3
    assert int(accepted.num_accepted) == 1


def test_gsd_accepts_on_the_cluster_mass():
    table = neighbour_table(torch.tensor([[0.0], [1.0], [2.0], [3.0]]), 2)  # 0 -> [1, 2]
    p = torch.tensor([[[0.05, 0.40, 0.05, 0.50], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.60, 0.10, 0.10, 0.20]]])
    draft, r, s = torch.tensor([[0]]), torch.tensor([[0.5]]), torch.tensor([0.3])
    # exact: p/q = 0.05/0.6 rejects r = 0.5; cluster {0, 1, 2} (both neighbours in the top 3 of p):
    # p(C) / q(C) = 0.5 / 0.8 = 0.625 > 0.5 accepts
    assert int(speculative_verify(draft, q, p, r, s).num_accepted) == 0
    assert int(gsd_verify(draft, q, p, table, r, s, top_m=3).num_accepted) == 1
    # top_m = 1 keeps only code 3 as likely: the cluster is {0} and GSD is exact again
    v = gsd_verify(draft, q, p, table, r, s, top_m=1)
    assert int(v.num_accepted) == 0 and int(v.tokens[0, 0]) in (1, 3)  # residual max(0, p - q) = (0, .3, 0, .3)


def test_bound_arguments_are_exclusive():
    with pytest.raises(ValueError, match="exactly one"):
        relaxed_mass(torch.ones(1, 4) / 4, torch.tensor([0]), torch.zeros(4, 2, dtype=torch.long), delta=0.1, lam=2.0)


# ---- LANTERN on token trees ------------------------------------------------------------------
from mmspec.core.relaxed import tree_lantern_greedy_verify, tree_lantern_verify  # noqa: E402
from mmspec.core.tree import TokenTree  # noqa: E402


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("bound", [{"delta": 0.2}, {"delta": None, "lam": 3.0}])
def test_chain_tree_lantern_equals_linear_lantern(deterministic, bound):
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 4, 20
    table = neighbour_table(torch.randn(vocab, 3, generator=gen), 6)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
    q = None if deterministic else torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    draft = torch.randint(vocab, (batch, k), generator=gen)
    r, s = torch.rand(batch, k, generator=gen), torch.rand(batch, generator=gen)
    tree = TokenTree(draft, torch.arange(-1, k - 1), probs=q)
    linear = lantern_verify(draft, q, p, table, r, s, **bound)
    on_tree = tree_lantern_verify(tree, p, table, r, s, **bound)
    assert torch.equal(on_tree.num_accepted, linear.num_accepted) and torch.equal(on_tree.tokens, linear.tokens)
    assert torch.equal(tree_lantern_greedy_verify(tree, p, table, **bound).tokens,
                       lantern_greedy_verify(draft, p, table, **bound).tokens)


def _relaxed_output(p, x, table, delta):
    """The exact output of one deterministic child x under LANTERN: (P(accept), the residual)."""
    relaxed, in_a = relaxed_mass(p, torch.tensor(x), table, delta=delta)
    residual = p.clone()
    residual[table[x][in_a]] = 0.0
    residual[x] = 0.0
    return float(relaxed), residual / residual.sum()


def _first_token_frequencies(delta, seed=0, runs=40000):
    """A deterministic two-child tree (EAGLE-2's q = 1) verified ``runs`` times: frequencies of the
    first committed token, the distribution the rule should give, and the target p."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    p_row = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    table = neighbour_table(torch.randn(vocab, 2, generator=gen), 5)
    first, second = p_row.topk(2).indices.flip(0).tolist()  # the second most likely first
    tree = TokenTree(torch.tensor([first, second]), torch.tensor([-1, -1]))
    p = p_row.expand(runs, 3, vocab).contiguous()
    out = tree_lantern_verify(tree, p, table, torch.rand(runs, 2, generator=gen), torch.rand(runs, generator=gen), delta=delta)
    a1, residual1 = _relaxed_output(p_row, first, table, delta)
    a2, residual2 = _relaxed_output(residual1, second, table, delta)
    expected = (1 - a1) * (1 - a2) * residual2
    expected[first] += a1
    expected[second] += (1 - a1) * a2
    return torch.bincount(out.tokens[:, 0], minlength=vocab).float() / runs, expected, p_row


@pytest.mark.parametrize("delta", [0.0, 0.05, 0.2, 0.4])
def test_tree_lantern_output_distribution_and_tv_bound(delta):
    freq, expected, p = _first_token_frequencies(delta)
    assert 0.5 * float((freq - expected).abs().sum()) < 0.01  # sampling noise at 40000 runs is ~0.005
    assert 0.5 * float((expected - p).abs().sum()) <= delta + 1e-6
    if delta == 0.0:
        torch.testing.assert_close(expected, p)  # exact speculative sampling over the tree


def test_loop_runs_lantern_on_a_dynamic_tree():
    from mmspec.core.loop import _tree_step
    from mmspec.core.rules import resolve_rule
    from mmspec.core.drafter import Draft
    from mmspec.core.sampling import SamplingConfig
    from mmspec.core.target import TargetOutput

    vocab = 8
    table = neighbour_table(torch.arange(vocab, dtype=torch.float)[:, None], 2)

    class Fixed:  # a target whose every row puts 0.3 on token 1 and 0.6 on its neighbour 2
        def forward(self, state, tokens, hidden_layer=None, tree=None):
            probs = torch.full((vocab,), 0.1 / (vocab - 2))
            probs[1], probs[2] = 0.3, 0.6
            return TargetOutput(probs.log().expand(1, tokens.shape[1], vocab).clone())

    class State:
        tokens = torch.tensor([[0]])

    tree = TokenTree(torch.tensor([1, 1]), torch.tensor([-1, 0]))  # a chain 1 -> 1
    sampling = SamplingConfig(do_sample=False)
    rule = resolve_rule("lantern", sampling, {"neighbours": table, "delta": 0.7})  # p~(1) = 0.3 + 0.6 >= max p: accepted
    verification, _, _ = _tree_step(rule, Fixed(), State(), Draft.from_tree(tree), sampling, torch.Generator(), None)
    assert int(verification.num_accepted[0]) == 2
    rule = resolve_rule("lantern", sampling, {"neighbours": table, "delta": 0.5})  # A is empty (0.6 > 0.5): 0.3 < 0.6, rejected
    verification, _, _ = _tree_step(rule, Fixed(), State(), Draft.from_tree(tree), sampling, torch.Generator(), None)
    assert int(verification.num_accepted[0]) == 0 and int(verification.tokens[0, 0]) == 2


# VADUSA's top-k tolerance -------------------------------------------------------------------------------
from mmspec.core.relaxed import topk_tolerance_verify  # noqa: E402
from mmspec.core.verify import greedy_verify  # noqa: E402


def test_topk_tolerance_hand_built():
    p = torch.tensor([[[0.5, 0.3, 0.15, 0.05, 0.0],
                       [0.1, 0.6, 0.2, 0.1, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 1.0]]])
    draft = torch.tensor([[2, 0]])  # rank 3 at position 0, rank 2 (tied) at position 1
    assert int(topk_tolerance_verify(draft, p, top_k=2, sample_uniforms=None).num_accepted[0]) == 0
    out = topk_tolerance_verify(draft, p, top_k=3, sample_uniforms=None)
    assert out.tokens.tolist() == [[2, 0, 4]]  # both inside the top 3, then the bonus argmax
    out = topk_tolerance_verify(torch.tensor([[4, 1]]), p, top_k=5, sample_uniforms=torch.tensor([0.99]))
    assert out.tokens.tolist() == [[3, -1, -1]]  # p(4) = 0 is never accepted; the draw from p at u = 0.99
    assert int(out.num_accepted[0]) == 0
    tied = torch.tensor([[[0.4, 0.2, 0.2, 0.2], [0.4, 0.2, 0.2, 0.2]]])  # token 3 ties with the 2nd most probable
    assert int(topk_tolerance_verify(torch.tensor([[3]]), tied, top_k=2, sample_uniforms=None).num_accepted[0]) == 1
    assert int(topk_tolerance_verify(torch.tensor([[3]]), tied, top_k=1, sample_uniforms=None).num_accepted[0]) == 0


def test_topk_tolerance_with_k_1_is_greedy():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.softmax(torch.randn(1, 5, 7, generator=g) * 2, -1)
        draft = torch.randint(0, 7, (1, 4), generator=g)
        draft[0, :2] = p[0, :2].argmax(-1)
        a = topk_tolerance_verify(draft, p, top_k=1, sample_uniforms=None)
        b = greedy_verify(draft, p)
        assert torch.equal(a.tokens, b.tokens)


def test_topk_tolerance_in_the_loop_stays_in_the_target_top_k():
    """Through mmspec.generate: every accepted draft token is in the target's top k at its position
    (checked against the target's own distributions)."""
    import mmspec
    from tiny_models import make_tiny

    case = make_tiny("llama")
    from mmspec.drafters import ModelDrafter

    drafter = ModelDrafter(case.model, num_draft_tokens=4)  # draws from p at a low temperature: mostly its top 3
    out = mmspec.generate(case.model, drafter=drafter, acceptance="topk-tolerance", rule_kwargs={"top_k": 3},
                          max_new_tokens=32, do_sample=True, temperature=0.02, seed=0, **case.inputs)
    prompt = case.inputs["input_ids"].shape[1]
    with torch.no_grad():
        logits = case.model(out.sequences.clone()).logits[0, prompt - 1 : -1]  # each new token's distribution
    ranks = (logits > logits.gather(-1, out.sequences[0, prompt:, None])).sum(-1)  # 0 = the most likely
    drafted, position = [], 1  # new token 0 came from the prefill; each step commits accepted drafts + one draw
    for committed in out.stats.committed_per_step:
        drafted += range(position, position + committed - 1)
        position += committed
    assert out.stats.config["acceptance"] == "topk-tolerance" and len(drafted) == out.stats.accepted > 0
    assert int(ranks[drafted].max()) < 3
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        mmspec.generate(case.model, acceptance="topk-tolerance", rule_kwargs={"top_k": 0}, max_new_tokens=2, **case.inputs)
