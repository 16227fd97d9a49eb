"""PCG group acceptance (ladder levels 1-2): the overlapping groups by hand, the coarse
distributions, the output distribution against the derived formula (and not against p: the
negative control), exact speculative sampling for groups of one token, the TV bound, greedy
cases, and the rule in the decoding loop."""

import pytest
import torch
from scipy.stats import chisquare

import mmspec
from mmspec.core.relaxed import TokenGroups, group_greedy_verify, group_verify, neighbour_table
from tiny_models import make_tiny

RUNS = 200_000


def test_groups_by_hand():
    groups = TokenGroups(torch.tensor([[1], [2], [1], [3]]))  # token 3's only "neighbour" is itself
    none = 4
    assert groups.members.tolist() == [[0, 1], [1, 2], [1, 2], [3, none], [none, none]]
    assert groups.count.tolist() == [1, 3, 2, 1]
    assert groups.groups_of.tolist() == [[0, none, none], [0, 1, 2], [1, 2, none], [3, none, none]]
    p = torch.tensor([0.1, 0.3, 0.4, 0.2])
    coarse = groups.coarse(p)  # G0 = 0.1 + 0.3/3, G1 = G2 = 0.3/3 + 0.4/2, G3 = 0.2, none = 0
    torch.testing.assert_close(coarse, torch.tensor([0.2, 0.3, 0.3, 0.2, 0.0]))


@pytest.mark.parametrize("seed", range(5))
def test_drawing_a_group_then_a_member_gives_p(seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, 30, generator=gen) * 2, -1)
    groups = TokenGroups(neighbour_table(torch.randn(30, 2, generator=gen), 4))
    torch.testing.assert_close(groups.coarse(p).sum(-1), torch.ones(3))
    torch.testing.assert_close(groups.expand(groups.coarse(p), p), p)  # sum_g P(g) p(y | g) = p(y)


def derived_output(p, q, groups):
    """The formula of mmspec.core.relaxed's module doc: p_out(y) = sum_g min(P, Q)(g) q(y | g) +
    (P(g) - min(P, Q)(g)) p(y | g); and its TV bound."""
    big_p, big_q = groups.coarse(p)[:-1], groups.coarse(q)[:-1]
    low = torch.minimum(big_p, big_q)
    out = torch.zeros_like(p)
    bound = 0.0
    for g, members in enumerate(groups.members[:-1].tolist()):
        members = [m for m in members if m < p.shape[0]]
        w = 1.0 / groups.count[members]
        q_g = q[members] * w / big_q[g] if big_q[g] > 0 else torch.zeros(len(members))
        p_g = p[members] * w / big_p[g] if big_p[g] > 0 else torch.zeros(len(members))
        out[members] += low[g] * q_g + (big_p[g] - low[g]) * p_g
        if low[g] > 0:
            bound += float(low[g]) * 0.5 * float((q_g - p_g).abs().sum())
    return out, bound


def sampled_first_tokens(p, q, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, RUNS, replacement=True, generator=gen)[:, None]
    target = torch.stack([p, p])[None].expand(RUNS, 2, -1)
    result = group_verify(drafts, q[None, None].expand(RUNS, 1, -1), target, groups, torch.rand(RUNS, 1, generator=gen),
                          torch.rand(RUNS, generator=gen))
    return torch.bincount(result.tokens[:, 0], minlength=p.shape[0]).double(), result


@pytest.mark.parametrize("seed", range(3))
def test_the_output_follows_the_derived_distribution_not_p(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    vocab = 12
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    groups = TokenGroups(neighbour_table(torch.randn(vocab, 2, generator=gen), 2))
    expected, bound = derived_output(p, q, groups)
    assert float(expected.sum()) == pytest.approx(1.0)
    counts, result = sampled_first_tokens(p, q, groups, seed)
    assert chisquare(counts, expected / expected.sum() * RUNS).pvalue > 1e-4
    assert chisquare(counts, p / p.sum() * RUNS).pvalue < 1e-10  # the negative control: lossy at token level
    assert 0.5 * float((expected - p).abs().sum()) <= bound + 1e-9
    exact_rate = float(torch.minimum(p, q).sum())  # speculative sampling's acceptance
    assert float(result.num_accepted.double().mean()) > exact_rate  # groups accept more


def test_groups_of_one_token_are_speculative_sampling():
    gen = torch.Generator().manual_seed(7)
    vocab = 10
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    groups = TokenGroups(torch.arange(vocab)[:, None])  # each token's neighbour is itself
    expected, bound = derived_output(p, q, groups)
    torch.testing.assert_close(expected, p)
    assert bound == 0.0
    counts, result = sampled_first_tokens(p, q, groups, 0)
    assert chisquare(counts, p / p.sum() * RUNS).pvalue > 1e-4
    assert float(result.num_accepted.double().mean()) == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)


def test_greedy_accepts_tokens_sharing_a_group_with_the_argmax():
    groups = TokenGroups(torch.tensor([[1], [2], [1], [3]]))  # G0 {0, 1}, G1 = G2 {1, 2}, G3 {3}
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.5, 0.2, 0.2, 0.1]]]))
    result = group_greedy_verify(torch.tensor([[2, 3]]), logits, groups)  # 2 shares G1 with argmax 1; 3 is the argmax
    assert result.num_accepted.tolist() == [2] and result.tokens.tolist() == [[2, 3, 0]]
    result = group_greedy_verify(torch.tensor([[3, 3]]), logits, groups)  # 3 shares no group with 1
    assert result.num_accepted.tolist() == [0] and result.tokens.tolist() == [[1, -1, -1]]


def test_the_rule_in_the_loop():
    """acceptance="group" runs in mmspec.generate (sampling and greedy); without neighbours it is
    one clear error."""
    case = make_tiny("llama")
    vocab = case.model.config.vocab_size
    table = neighbour_table(torch.randn(vocab, 4, generator=torch.Generator().manual_seed(0)), 3)
    prompt = case.inputs["input_ids"]
    for sample in (True, False):
        out = mmspec.generate(case.model, drafter="prompt-lookup", input_ids=prompt, max_new_tokens=12, do_sample=sample,
                              seed=1, acceptance="group", rule_kwargs={"neighbours": table})
        assert out.stats.config["acceptance"] == "group" and out.sequences.shape[1] == prompt.shape[1] + 12
    with pytest.raises(ValueError, match="needs rule_kwargs\\['neighbours'\\]"):
        mmspec.generate(case.model, drafter="prompt-lookup", input_ids=prompt, max_new_tokens=4, acceptance="group")
