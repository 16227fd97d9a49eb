"""Token trees: construction, masks, tree rules, target forward + compaction, and the loop.

Ladder levels 1 (hand-built cases), 2 (distributions), 4 (greedy == AR) and 6 (compaction ==
recompute) for ``mmspec.core.tree`` and the tree rules of ``mmspec.core.verify``.
"""

import math

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_text_only_draft, make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.core.drafter import Draft, Drafter
from mmspec.core.sampling import logits_to_probs, sample_from_probs
from mmspec.core.tree import TokenTree, dynamic_tree, sampled_dynamic_tree, tree_attention_mask, tree_position_ids
from mmspec.core.verify import (
    PAD,
    greedy_verify,
    speculative_verify,
    tree_greedy_verify,
    tree_speculative_verify,
)

PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]


# construction, masks, positions -----------------------------------------------------------------
def test_from_paths_orders_parents_first():
    paths = [(0, 0), (1,), (0,), (0, 1), (0, 0, 0)]
    tree = TokenTree.from_paths(paths, [10, 11, 12, 13, 14])
    # sorted by (depth, path): (0,) (1,) (0,0) (0,1) (0,0,0)
    assert tree.tokens.tolist() == [12, 11, 10, 13, 14]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]
    assert tree.depth.tolist() == [1, 1, 2, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3] and tree.children(4) == []
    assert tree.path_to(4) == [0, 2, 4] and tree.max_depth == 3
    probs = torch.eye(5)
    with_probs = TokenTree.from_paths(paths, [10, 11, 12, 13, 14], probs)
    assert torch.equal(with_probs.probs.argmax(-1), torch.tensor([2, 1, 0, 3, 4]))  # rows follow the tokens
    with pytest.raises(ValueError, match="parent"):
        TokenTree.from_paths([(0,), (1, 0)], [1, 2])
    with pytest.raises(ValueError, match="distinct"):
        TokenTree.from_paths([(0,), (0,)], [1, 2])
    with pytest.raises(ValueError, match="topologically"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


def test_attention_mask_and_positions():
    tree = TokenTree.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], [5, 6, 7, 8, 9])
    prefix = 3
    mask = tree_attention_mask(tree, prefix, dtype=torch.float16)
    assert mask.shape == (1, 1, 5, prefix + 5) and mask.dtype == torch.float16
    visible = mask[0, 0] == 0
    assert visible[:, :prefix].all()  # everyone sees the prefix
    expected = torch.tensor(
        [  # node i sees itself and its ancestors: parents = [-1, -1, 0, 1, 2]
            [1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [0, 1, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible[:, prefix:], expected)
    assert (mask[0, 0][~visible] == torch.finfo(torch.float16).min).all()
    assert tree_position_ids(tree, 10).tolist() == [[10, 10, 11, 11, 12]]
    # a chain's mask is the causal mask
    chain = TokenTree.chain(torch.tensor([1, 2, 3]))
    assert torch.equal(tree_attention_mask(chain, 0)[0, 0] == 0, torch.ones(3, 3, dtype=torch.bool).tril())
    rooted = tree.prepend_root(4)
    assert rooted.tokens.tolist() == [4, 5, 6, 7, 8, 9] and rooted.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert tree_position_ids(rooted, 10).tolist() == [[10, 11, 11, 12, 12, 13]]


def test_ancestor_matrix_matches_paths_on_random_trees():
    generator = torch.Generator().manual_seed(0)
    for size in (1, 7, 40):
        parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(size)]
        tree = TokenTree(torch.arange(size), torch.tensor(parents))
        expected = torch.zeros(size, size, dtype=torch.bool)
        for node in range(size):
            expected[node, tree.path_to(node)] = True
        assert torch.equal(tree.ancestor_matrix(), expected)
        nodes = torch.randperm(size, generator=generator)[: max(1, size // 3)].tolist()
        columns = torch.randperm(size, generator=generator)[: max(1, size // 2)].tolist()
        assert torch.equal(tree.ancestor_rows(nodes, columns), expected[nodes][:, columns])
        assert torch.equal(tree.ancestor_rows([], columns), expected[[]][:, columns])


def _brute_force_top(root_probs, table, depth, top_k):
    """Every candidate EAGLE-2 creates, by plain recursion over paths: {path: log score}."""
    def top(probs):
        return torch.topk(probs, top_k).indices.tolist()

    layer = {(t,): math.log(root_probs[t]) for t in top(root_probs)}
    candidates = dict(layer)
    for _ in range(depth - 1):
        expand = sorted(layer, key=lambda p: -layer[p])[:top_k]
        new = {}
        for path in expand:
            probs = table[path[-1]]
            for t in top(probs):
                new[path + (t,)] = layer[path] + math.log(probs[t])
        candidates.update(new)
        layer = new
    return candidates


@pytest.mark.parametrize("depth,top_k,num_nodes", [(2, 6, 10), (4, 3, 12), (3, 2, 100)])
def test_dynamic_tree_keeps_best_cumulative_confidence(depth, top_k, num_nodes):
    torch.manual_seed(depth * 10 + top_k)
    vocab = 6
    table = (3 * torch.randn(vocab, vocab)).softmax(-1)  # draft: next-token distribution given the last token
    root = (3 * torch.randn(vocab)).softmax(-1)
    calls = []

    def child_probs(candidates, nodes):
        calls.append(nodes.tolist())
        assert candidates.scores is not None and candidates.scores.shape == candidates.tokens.shape
        # the depths the growing tree kept are the ones its parents give
        assert torch.equal(candidates.depth, TokenTree(candidates.tokens, candidates.parents).depth)
        return table[candidates.tokens[nodes]]

    tree = dynamic_tree(root, child_probs, depth=depth, top_k=top_k, num_nodes=num_nodes)
    assert len(calls) == depth - 1 and all(len(c) <= top_k for c in calls)
    candidates = _brute_force_top(root, table, depth, top_k)
    kept = {tuple(tree.tokens[tree.path_to(i)].tolist()): float(tree.scores[i]) for i in range(tree.size)}
    assert tree.size == min(num_nodes, len(candidates)) == len(kept)
    for path, score in kept.items():  # scores are sums of log confidences along the path
        assert path in candidates and score == pytest.approx(candidates[path], abs=1e-5)
        assert path[:-1] in kept or len(path) == 1  # ancestor-closed
    worst_kept = min(kept.values())
    assert all(score <= worst_kept + 1e-6 for path, score in candidates.items() if path not in kept)
    assert tree.probs is None and (tree.parents < torch.arange(tree.size)).all()
    for node in range(-1, tree.size):  # siblings in decreasing confidence
        child_scores = [float(tree.scores[c]) for c in tree.children(node)]
        assert child_scores == sorted(child_scores, reverse=True)


# tree rules: chain == linear --------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_chain_tree_equals_linear_rules(deterministic):
    torch.manual_seed(0)
    b, k, vocab = 4000, 4, 5
    draft = torch.randint(0, vocab, (b, k))
    target = (2 * torch.randn(b, k + 1, vocab)).softmax(-1)
    q = None if deterministic else (2 * torch.randn(b, k, vocab)).softmax(-1)
    if not deterministic:  # drafts really drawn from q, so that many are accepted
        draft = torch.multinomial(q.view(-1, vocab), 1).view(b, k)
    u, s = torch.rand(b, k), torch.rand(b)
    linear = speculative_verify(draft, q, target, u, s)
    tree = tree_speculative_verify(TokenTree.chain(draft, q), target, u, s)
    assert torch.equal(linear.tokens, tree.tokens) and torch.equal(linear.num_accepted, tree.num_accepted)
    assert 0 < float(linear.num_accepted.float().mean()) < k
    positions = torch.arange(k).expand(b, k)
    assert torch.equal(tree.path, torch.where(positions < tree.num_accepted[:, None], positions, PAD))
    g_linear, g_tree = greedy_verify(draft, target), tree_greedy_verify(TokenTree.chain(draft), target)
    assert torch.equal(g_linear.tokens, g_tree.tokens) and torch.equal(g_linear.num_accepted, g_tree.num_accepted)


# tree rules: hand-built cases ---------------------------------------------------------------------
def one_hot_rows(ids, vocab=6):
    rows = torch.zeros(len(ids), vocab)
    rows[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return rows.unsqueeze(0)


# (0,) (1,) (0,0) (0,1) (1,0) (0,1,0): nodes 0..5 with parents [-1, -1, 0, 0, 1, 3]
HAND = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)], [3, 4, 1, 2, 5, 0])


def test_greedy_tree_follows_matching_sibling_to_the_leaf():
    # rows: root, node 0 .. node 5. root -> 3 (node 0); node 0 -> 2 (node 3, its second child);
    # node 3 -> 0 (node 5); node 5 (a leaf) -> 4, the bonus token
    target = one_hot_rows([3, 2, 5, 5, 0, 5, 4])
    v = tree_greedy_verify(HAND, target)
    assert v.num_accepted.tolist() == [3] and v.path.tolist() == [[0, 3, 5]]
    assert v.tokens.tolist() == [[3, 2, 0, 4]]


def test_greedy_tree_rejects_every_child():
    v = tree_greedy_verify(HAND, one_hot_rows([5, 0, 0, 0, 0, 0, 0]))
    assert v.num_accepted.tolist() == [0] and v.path.tolist() == [[PAD, PAD, PAD]]
    assert v.tokens.tolist() == [[5, PAD, PAD, PAD]]


def test_greedy_tree_walks_one_host_tree_as_the_tensor_rule_does():
    """One tree on the CPU takes the host walk: the tensor rule's path, tokens and count (the same
    tree verified twice in a batch of two rows takes the tensor rule) on random trees and targets
    built to accept deep paths, shallow ones and none."""
    gen = torch.Generator().manual_seed(0)
    depths = set()
    for trial in range(200):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
        tree = TokenTree(torch.randint(0, 5, (n,), generator=gen), torch.tensor(parents))
        argmax = torch.randint(0, 5, (n + 1,), generator=gen)
        if trial % 2:  # follow a random root-to-leaf path: make its tokens the argmaxes
            node = n - 1
            while node >= 0:
                argmax[parents[node] + 1] = tree.tokens[node]
                node = parents[node]
        logits = torch.nn.functional.one_hot(argmax, 5).float()[None]
        host, tensor = tree_greedy_verify(tree, logits), tree_greedy_verify(tree, logits.expand(2, -1, -1))
        assert torch.equal(host.num_accepted, tensor.num_accepted[:1]) and torch.equal(host.path, tensor.path[:1])
        assert torch.equal(host.tokens, tensor.tokens[:1])
        depths.add(int(host.num_accepted))
    assert 0 in depths and max(depths) >= 4


def test_speculative_tree_accepts_deep_path_then_bonus():
    # root -> 4: node 0 (token 3, p = 0) is rejected, its sibling node 1 (token 4) accepted;
    # node 1 -> 5 accepts node 4; node 4 is a leaf whose row gives the bonus token 1
    target = one_hot_rows([4, 0, 5, 0, 0, 1, 0])
    v = tree_speculative_verify(HAND, target, torch.full((1, 6), 0.5), torch.tensor([0.3]))
    assert v.path.tolist() == [[1, 4, PAD]] and v.tokens.tolist() == [[4, 5, 1, PAD]]


def test_speculative_tree_all_children_rejected_samples_the_residual():
    # root row p: tokens 3 and 4 (the root's children) hold 0.9 of the mass; both rejected
    p = torch.tensor([0.05, 0.0, 0.0, 0.6, 0.3, 0.05])
    target = torch.cat([p.view(1, 1, -1), one_hot_rows([0] * 6)], dim=1)
    u = torch.tensor([[0.99, 0.99, 0, 0, 0, 0]])  # r_0 = .99 > p(3) = .6; residual p(4) = .3/.4 = .75 < .99
    for s, expected in [(0.2, 0), (0.8, 5)]:  # residual = {0: .5, 5: .5}
        v = tree_speculative_verify(HAND, target, u, torch.tensor([s]))
        assert v.num_accepted.tolist() == [0] and v.tokens.tolist() == [[expected, PAD, PAD, PAD]]


def test_speculative_tree_sibling_accepted_after_residual_update():
    # deterministic: p = (.5 on 3, .3 on 4, .2 on 0). Reject token 3 with r = .6 > .5; the residual
    # is p without 3, renormalised: p'(4) = .6, so r = .55 accepts 4 (p(4) = .3 alone would reject).
    p = torch.tensor([0.2, 0.0, 0.0, 0.5, 0.3, 0.0])
    target = torch.cat([p.view(1, 1, -1), one_hot_rows([0, 5, 0, 0, 0, 0])], dim=1)
    u = torch.tensor([[0.6, 0.55, 0.5, 0.5, 0.5, 0.5]])
    v = tree_speculative_verify(HAND, target, u, torch.tensor([0.5]))
    assert v.path.tolist() == [[1, 4, PAD]] and v.tokens.tolist() == [[4, 5, 0, PAD]]
    u[0, 1] = 0.65  # > p'(4): now both rejected, residual = {0: 1}
    v = tree_speculative_verify(HAND, target, u, torch.tensor([0.5]))
    assert v.tokens.tolist() == [[0, PAD, PAD, PAD]]


def test_speculative_tree_stochastic_siblings_use_their_q():
    # two root children drawn from q = (.5, .5, 0, ...) over tokens {0, 1}; p = (.3, .3, .4).
    # child 0 (token 0): r * q(0) = .8 * .5 = .4 >= .3 -> rejected; residual max(p - q, 0) = {2: 1}.
    # child 1 (token 1): residual(1) = 0 -> rejected for any r (without the update r = .1 would accept).
    tree = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, -1]), probs=torch.tensor([[0.5, 0.5, 0.0]] * 2))
    target = torch.tensor([[[0.3, 0.3, 0.4], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    v = tree_speculative_verify(tree, target, torch.tensor([[0.8, 0.1]]), torch.tensor([0.01]))
    assert v.tokens.tolist() == [[2, PAD]]
    # and when child 0 is accepted its own row gives the bonus token
    v = tree_speculative_verify(tree, target, torch.tensor([[0.5, 0.1]]), torch.tensor([0.99]))
    assert v.path.tolist() == [[0]] and v.tokens.tolist() == [[0, 0]]


# tree rules: distribution -------------------------------------------------------------------------
VOCAB_D, N_TRIALS = 5, 100_000
DIST_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]


def _distribution_setup(seed):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.tensor([0.30, 0.25, 0.0, 0.35, 0.10])  # target after the root
    p2 = torch.rand(VOCAB_D, VOCAB_D, generator=g) ** 2  # target after token x: p2[x]
    p2[:, 2] = 0.0
    p2 = p2 / p2.sum(-1, keepdim=True)
    q1 = torch.tensor([0.25, 0.15, 0.05, 0.20, 0.35])  # draft after the root (top 3: 4, 0, 3)
    q2 = torch.rand(VOCAB_D, VOCAB_D, generator=g)  # draft after token x
    q2 = q2 / q2.sum(-1, keepdim=True)
    return g, p1, p2, q1, q2


def _sample_trees(g, q1, q2, deterministic):
    """N_TRIALS trees of shape DIST_PATHS (batched): children drawn i.i.d. from q given the parent's
    token, or (deterministic) the top tokens of q. Returns tokens [B, N], probs [B, N, V] | None,
    parents."""
    skeleton = TokenTree.from_paths(DIST_PATHS, list(range(len(DIST_PATHS))))
    n = skeleton.size
    tokens = torch.zeros(N_TRIALS, n, dtype=torch.long)
    probs = torch.zeros(N_TRIALS, n, VOCAB_D)
    for node in range(n):
        parent = int(skeleton.parents[node])
        q = q1.expand(N_TRIALS, VOCAB_D) if parent < 0 else q2[tokens[:, parent]]
        if deterministic:
            rank = skeleton.children(parent).index(node)
            tokens[:, node] = torch.sort(q, dim=-1, descending=True, stable=True).indices[:, rank]
        else:
            tokens[:, node] = torch.multinomial(q, 1, generator=g).squeeze(1)
        probs[:, node] = q
    return skeleton.parents, tokens, None if deterministic else probs


def _two_token_counts(g, p1, p2, tree, target, verification):
    """Histogram [V, V] of the first two generated tokens. When a step emits only one token, the
    second is drawn from p2[first] -- what the next (AR) step does -- so the exact law is p1(a) p2[a](b)."""
    first = verification.tokens[:, 0]
    second = verification.tokens[:, 1]
    missing = second == PAD
    fill = torch.multinomial(p2[first[missing]], 1, generator=g).squeeze(1)
    second = second.clone()
    second[missing] = fill
    return torch.bincount(first * VOCAB_D + second, minlength=VOCAB_D**2).double()


def _run_distribution(seed, deterministic, claimed_q=None):
    g, p1, p2, q1, q2 = _distribution_setup(seed)
    parents, tokens, probs = _sample_trees(g, q1, q2, deterministic)
    if claimed_q is not None:
        probs = claimed_q.expand_as(probs)
    tree = TokenTree(tokens, parents, probs)
    # target rows: root -> p1; node i -> p2[token i] (what the target says after the path's last token;
    # it depends only on that token here, which the exact law below relies on)
    target = torch.cat([p1.expand(N_TRIALS, 1, VOCAB_D), p2[tokens]], dim=1)
    v = tree_speculative_verify(tree, target, torch.rand(N_TRIALS, tree.size, generator=g), torch.rand(N_TRIALS, generator=g))
    counts = _two_token_counts(g, p1, p2, tree, target, v)
    exact = (p1[:, None] * p2).flatten().double()
    return counts, exact, v


@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_sampling_preserves_target_distribution(deterministic):
    counts, exact, v = _run_distribution(seed=1, deterministic=deterministic)
    assert float(v.num_accepted.float().mean()) > 0.5  # the tree was really used, deep paths included
    assert int((v.num_accepted == 2).sum()) > 5000
    support = exact > 0
    assert counts[~support].sum() == 0  # zero-probability tokens are never emitted
    pvalue = chisquare(counts[support].numpy(), (exact[support] / exact[support].sum() * N_TRIALS).numpy()).pvalue
    assert pvalue > 1e-4, pvalue
    tv = 0.5 * (counts / N_TRIALS - exact).abs().sum().item()
    assert tv < 0.01, tv  # ~ sqrt(V^2 / n) / 2 = 0.008 for an exact sampler


def test_wrong_residual_is_detected():
    """Negative control: the rule told the wrong q (uniform instead of the q the children were drawn
    from) subtracts the wrong residual on every sibling rejection; the test above must catch it."""
    counts, exact, _ = _run_distribution(seed=1, deterministic=False, claimed_q=torch.full((VOCAB_D,), 1.0 / VOCAB_D))
    support = exact > 0
    pvalue = chisquare(counts[support].numpy(), (exact[support] / exact[support].sum() * N_TRIALS).numpy()).pvalue
    assert pvalue < 1e-12
    assert 0.5 * (counts / N_TRIALS - exact).abs().sum().item() > 0.02


def _sampled_tree_counts(trials, claim_unrenormalised=False):
    """First-two-token histogram of trees grown by sampled_dynamic_tree (children drawn from q
    without replacement) and verified by the multi-draft rule, against the exact law."""
    g, p1, p2, q1, q2 = _distribution_setup(seed=2)
    counts = torch.zeros(VOCAB_D**2, dtype=torch.float64)
    accepted = torch.zeros(3)
    for _ in range(trials):
        tree = sampled_dynamic_tree(q1, lambda candidates, nodes: q2[candidates.tokens[nodes]], depth=2, top_k=3,
                                    num_nodes=6, generator=g)
        probs = tree.probs
        if claim_unrenormalised:  # the rule told each sibling's parent q instead of its own q_j
            probs = torch.stack([q1 if int(parent) < 0 else q2[tree.tokens[parent]] for parent in tree.parents])
        target = torch.cat([p1[None], p2[tree.tokens]])[None]
        v = tree_speculative_verify(TokenTree(tree.tokens, tree.parents, probs), target, torch.rand(1, tree.size, generator=g),
                                    torch.rand(1, generator=g))
        accepted[int(v.num_accepted)] += 1
        counts += _two_token_counts(g, p1, p2, None, target, v)
    return counts, (p1[:, None] * p2).flatten().double(), accepted


def test_sampled_dynamic_tree_shape_and_rows():
    g, _, _, q1, q2 = _distribution_setup(seed=3)
    tree = sampled_dynamic_tree(q1, lambda candidates, nodes: q2[candidates.tokens[nodes]], depth=3, top_k=3, num_nodes=7, generator=g)
    assert 3 < tree.size <= 7 and tree.max_depth == 3 and (tree.parents < torch.arange(tree.size)).all()
    for parent in range(-1, tree.size):
        kids = tree.children(parent)
        q = q1 if parent < 0 else q2[tree.tokens[parent]]
        assert len(set(tree.tokens[kids].tolist())) == len(kids)  # without replacement
        for j, kid in enumerate(kids):  # q_j = q without the earlier siblings, renormalised
            expected = q.clone()
            expected[tree.tokens[kids[:j]]] = 0
            assert torch.allclose(tree.probs[kid], expected / expected.sum(), atol=1e-6)
            # a slot's value is fixed before its token is drawn: V(parent) (times the j-th largest q for j >= 2)
            base = 0.0 if parent < 0 else float(tree.scores[parent])
            factor = 1.0 if j == 0 else float(q.sort(descending=True).values[j])
            assert float(tree.scores[kid]) == pytest.approx(base + math.log(factor), abs=1e-5)
    # open_slot closes a layer, expand_while stops the growth
    seen = []
    small = sampled_dynamic_tree(q1, lambda candidates, nodes: q2[candidates.tokens[nodes]], depth=3, top_k=3, num_nodes=7, generator=g,
                                 open_slot=lambda value, depth: seen.append(depth) or len(seen) <= 2, expand_while=lambda best: False)
    assert small.size == 2 and small.max_depth == 1 and seen == [1, 1, 1]


@pytest.mark.parametrize("claim_unrenormalised", [False, True])
def test_sampled_dynamic_tree_preserves_target_distribution(claim_unrenormalised):
    """Sampled trees are exact; and the test has power: telling the rule each sibling's parent q
    (siblings drawn without replacement, q_j not renormalised) is caught."""
    trials = 8000
    counts, exact, accepted = _sampled_tree_counts(trials, claim_unrenormalised)
    support = exact > 0
    pvalue = chisquare(counts[support].numpy(), (exact[support] / exact[support].sum() * trials).numpy()).pvalue
    tv = 0.5 * (counts / trials - exact).abs().sum().item()
    if claim_unrenormalised:
        assert pvalue < 1e-6 and tv > 0.03, (pvalue, tv)
    else:
        assert counts[~support].sum() == 0
        assert accepted[2] > 2000 and accepted[1] > 2000  # deep paths and siblings were used
        assert pvalue > 1e-4 and tv < 0.025, (pvalue, tv)


# target forward over a tree + compaction ----------------------------------------------------------
COMPACT_FAMILIES = ["llama", "llava", "gemma3"]


def _prefill_plus_one(target, case):
    state, out = target.prefill(case.inputs)
    state.tokens = torch.cat([state.tokens, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return state


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", COMPACT_FAMILIES)
def test_tree_forward_equals_path_forwards_and_compaction_equals_recompute(family, attn):
    case = make_tiny(family)
    case.model.set_attn_implementation(attn)
    assert case.model.config.get_text_config()._attn_implementation == attn
    target = TransformersTarget(case.model)
    gen = torch.Generator().manual_seed(3)
    tree = TokenTree.from_paths(PATHS, torch.randint(3, 400, (len(PATHS),), generator=gen))
    with torch.inference_mode():
        state = _prefill_plus_one(target, case)
        rooted = tree.prepend_root(state.tokens[0, -1])
        logits = target.forward(state, rooted.tokens[None], tree=rooted).logits  # [1, N+1, V]
        assert state.cache_length == state.length + tree.size
        # every node's logits == a plain causal forward over the root + its path
        for node in [0, 2, 4, 8, 9, 10, 11]:
            path = tree.path_to(node)
            fresh = _prefill_plus_one(target, case)
            ref = target.forward(fresh, torch.cat([fresh.tokens[:, -1:], tree.tokens[path][None]], dim=1)).logits
            torch.testing.assert_close(logits[:, [0] + [p + 1 for p in path]], ref, atol=1e-5, rtol=1e-5)
        # accept the scattered path (0,0,1) = nodes [0, 3, 8] and a bonus token, compact, continue
        path = torch.tensor(tree.path_to(8))
        assert path.tolist() == [0, 3, 8]
        bonus = torch.tensor([[7]])
        state.commit(torch.cat([tree.tokens[path][None], bonus], dim=1), path=path)
        next_logits = target.forward(state, state.tokens[:, -1:]).logits
        fresh, _ = target.prefill(case.inputs)
        fresh_logits = target.forward(fresh, state.tokens[:, case.prompt_len :]).logits[:, -1:]
    assert state.cache_length == fresh.cache_length == state.length
    for mine, theirs in zip(state.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_logits, fresh_logits, atol=1e-5, rtol=1e-5)


def test_compaction_with_nothing_accepted_and_rollback_after():
    case = make_tiny("llama")
    target = TransformersTarget(case.model)
    tree = TokenTree.from_paths(PATHS, torch.arange(10, 10 + len(PATHS)))
    with torch.inference_mode():
        state = _prefill_plus_one(target, case)
        length = state.length
        rooted = tree.prepend_root(state.tokens[0, -1])
        target.forward(state, rooted.tokens[None], tree=rooted)
        state.commit(torch.tensor([[5]]), path=torch.zeros(0, dtype=torch.long))
        assert state.length == length + 1 and state.cache_length == length
        state.rollback(length)
        assert state.cache_length == length - 1
        fresh = _prefill_plus_one(target, case)
    for mine, theirs in zip(state.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-6, rtol=1e-6)


# trees past a sliding window (its layers get the window form of the tree mask): tests/test_gemma4.py


# the loop with tree drafts ------------------------------------------------------------------------
class TreeModelDrafter(Drafter):
    """Test-only drafter: a token tree from a small causal LM, recomputed from scratch each step
    (no cache) with the tree attention mask.

    mode "static": the tree shape of ``paths``; a node's children are the top tokens of q
    (deterministic) or, when sampling, i.i.d. draws from q (a SpecInfer-style stochastic tree).
    mode "dynamic": EAGLE-2's dynamic tree (deterministic).
    """

    name = "test-tree"

    def __init__(self, model, paths=PATHS, mode="static", depth=4, top_k=3, num_nodes=12):
        super().__init__(num_draft_tokens=max(len(p) for p in paths))
        self.model, self.paths, self.mode = model, paths, mode
        self.depth, self.top_k, self.num_nodes = depth, top_k, num_nodes

    def _probs(self, state, tree, nodes):
        """Draft q after the context of each node (-1: the root) -> [n, V]."""
        prefix = torch.cat([state.tokens, tree.tokens[None]], dim=1) if tree is not None else state.tokens
        length = state.length
        mask = torch.full((prefix.shape[1], prefix.shape[1]), torch.finfo(torch.float32).min).triu(1)
        positions = torch.arange(prefix.shape[1])
        if tree is not None and tree.size:
            mask[length:] = tree_attention_mask(tree, length)[0, 0]
            positions[length:] = tree_position_ids(tree, length)[0]
        logits = self.model(input_ids=prefix, attention_mask=mask[None, None], position_ids=positions[None]).logits[0]
        self.forwards += 1
        rows = torch.as_tensor(nodes) + length  # row length - 1 = after the root
        return logits_to_probs(logits[rows], self.context.sampling)

    def propose(self, state, max_tokens):
        if self.mode == "dynamic":
            root = self._probs(state, None, [-1])[0]
            tree = dynamic_tree(root, lambda cand, nodes: self._probs(state, cand, nodes),
                                depth=self.depth, top_k=self.top_k, num_nodes=self.num_nodes)
            return Draft.from_tree(tree)
        sampling = self.context.sampling
        skeleton = TokenTree.from_paths(self.paths, torch.zeros(len(self.paths), dtype=torch.long))
        tokens = torch.zeros(skeleton.size, dtype=torch.long)
        probs = torch.zeros(skeleton.size, self.model.config.vocab_size)
        for d in range(1, skeleton.max_depth + 1):
            layer = [i for i in range(skeleton.size) if int(skeleton.depth[i]) == d]
            partial = None if d == 1 else TokenTree(tokens[: layer[0]], skeleton.parents[: layer[0]])
            parents = skeleton.parents[layer].tolist()
            q = self._probs(state, partial, parents)  # [n, V]
            for node, row in zip(layer, q):
                rank = skeleton.children(int(skeleton.parents[node])).index(node)
                if sampling.do_sample:
                    u = torch.rand(1, generator=self.context.generator)
                    tokens[node] = sample_from_probs(row[None], u)[0]
                else:
                    tokens[node] = row.topk(rank + 1).indices[rank]
                probs[node] = row
        return Draft.from_tree(TokenTree(tokens, skeleton.parents, probs if sampling.do_sample else None))


class OracleTreeDrafter(Drafter):
    """Test-only drafter: knows the AR continuation and hides it at a random sibling of a random
    path of the tree (stopping early with probability 0.05 per level), random tokens elsewhere."""

    name = "test-oracle-tree"

    def __init__(self, reference_new_tokens, vocab, paths=PATHS, seed=0):
        super().__init__(num_draft_tokens=4)
        self.reference, self.vocab, self.paths = reference_new_tokens, vocab, paths
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, state, max_tokens):
        skeleton = TokenTree.from_paths(self.paths, torch.zeros(len(self.paths), dtype=torch.long))
        tokens = torch.randint(3, self.vocab - 20, (skeleton.size,), generator=self.gen)
        done = state.new_tokens.shape[1]
        node = -1
        for step in range(skeleton.max_depth):
            kids = skeleton.children(node)
            if not kids or done + step >= len(self.reference) or torch.rand(1, generator=self.gen) < 0.05:
                break
            node = kids[int(torch.randint(len(kids), (1,), generator=self.gen))]
            tokens[node] = self.reference[done + step]
        return Draft.from_tree(TokenTree(tokens, skeleton.parents))


MAX_NEW = 20


@pytest.fixture(scope="module", params=["llama", "llava", "gemma3"])
def ar_case(request):
    case = make_tiny(request.param)
    with torch.inference_mode():
        reference = case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW)
    return case, reference


def test_greedy_tree_decoding_equals_ar(ar_case):
    case, reference = ar_case
    ref_new = reference[0, case.prompt_len :].tolist()
    drafters = {
        "oracle": OracleTreeDrafter(ref_new, case.vocab_size),
        "independent static": TreeModelDrafter(make_text_only_draft(case.vocab_size, seed=7)),
    }
    for name, drafter in drafters.items():
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=MAX_NEW, **case.inputs)
        assert torch.equal(out.sequences, reference), name
        assert out.stats.new_tokens == MAX_NEW and out.stats.tree_nodes > 0
    oracle = mmspec.generate(case.model, drafter=OracleTreeDrafter(ref_new, case.vocab_size), max_new_tokens=MAX_NEW, **case.inputs)
    # deep paths, through non-first siblings, were accepted
    assert oracle.stats.mean_accepted_length > 1.8 and oracle.stats.accepted_per_position[2] > 0


def test_greedy_tree_self_draft_and_dynamic_tree_on_llama():
    case = make_tiny("llama")
    with torch.inference_mode():
        reference = case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW)
    # the target drafting for itself: the greedy path is always the first branch, fully accepted
    out = mmspec.generate(case.model, drafter=TreeModelDrafter(case.model), max_new_tokens=MAX_NEW, **case.inputs)
    assert torch.equal(out.sequences, reference)
    assert out.stats.mean_accepted_length == pytest.approx(19 / 4)  # 4 steps of 4 + 1 (the last one cut)
    # EAGLE-2 tree drafted by the target: the greedy path is kept as deep as the rerank allows
    out = mmspec.generate(case.model, drafter=TreeModelDrafter(case.model, mode="dynamic"), max_new_tokens=MAX_NEW, **case.inputs)
    assert torch.equal(out.sequences, reference)
    assert out.stats.mean_accepted_length > 2.0
    eos = reference[0, case.prompt_len + 6].item()
    with torch.inference_mode():
        expected = case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
    out = mmspec.generate(case.model, drafter=TreeModelDrafter(case.model), max_new_tokens=MAX_NEW, eos_token_id=eos, **case.inputs)
    assert torch.equal(out.sequences, expected)


def test_chain_tree_drafts_reproduce_linear_sampling():
    """A drafter returning its linear draft as a chain tree gives the same samples, seed for seed,
    under speculative sampling (whose tree form is its chain form on a chain; block verification,
    the default, judges a linear chain jointly and a tree node by node)."""
    from mmspec.drafters import ModelDrafter

    class ChainOf(ModelDrafter):
        def propose(self, state, max_tokens):
            draft = super().propose(state, max_tokens)
            q = None if draft.probs is None else draft.probs[0]
            return Draft.from_tree(TokenTree.chain(draft.tokens[0], q))

    case = make_tiny("llama")
    draft_model = make_text_only_draft(case.vocab_size, seed=7)
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=1.5, seed=5, acceptance="speculative", **case.inputs)
    linear = mmspec.generate(case.model, drafter=ModelDrafter(draft_model, num_draft_tokens=3), **kwargs)
    chain = mmspec.generate(case.model, drafter=ChainOf(draft_model, num_draft_tokens=3), **kwargs)
    assert torch.equal(linear.sequences, chain.sequences)
    assert linear.stats.accepted == chain.stats.accepted


# end to end: the loop with stochastic and deterministic trees samples the target's distribution ----
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_loop_with_trees_samples_target_distribution(mode):
    from distribution_check import pvalue, two_stage
    from test_distribution import NEW, PROMPT, TEMPERATURE, TOP_K, VOCAB, exact_marginals, tiny_llama

    target = tiny_llama(0)
    exact = exact_marginals(target)
    runs = 1500
    if mode == "static":
        drafter = TreeModelDrafter(tiny_llama(1), paths=[(0,), (1,), (0, 0), (1, 0)])
    else:
        drafter = TreeModelDrafter(tiny_llama(1), mode="dynamic", depth=2, top_k=2, num_nodes=4)
    counts = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    accepted = 0

    def draw(seed):
        nonlocal accepted
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, seed=seed, input_ids=PROMPT)
        accepted += out.stats.accepted
        for i, token in enumerate(out.sequences[0, PROMPT.shape[1] :].tolist()):
            counts[i, token] += 1

    runs, found = two_stage(runs, draw, lambda n: [pvalue(counts[i], exact[i]) for i in range(NEW)])
    assert accepted > runs / 15, drafter.mode
    assert min(found) > 1e-4, (drafter.mode, found, counts, [e * runs for e in exact])


def test_dynamic_tree_stops_expanding_when_told():
    """expand_while sees the best log V of the nodes about to be expanded; False ends the tree."""
    vocab = 6
    root = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), -1)
    calls, seen = [], []

    def child_probs(candidates, nodes):
        calls.append(len(nodes))
        return torch.full((len(nodes), vocab), 1.0 / vocab)

    def expand_while(best_log_value):
        seen.append(best_log_value)
        return len(seen) < 3

    tree = dynamic_tree(root, child_probs, depth=6, top_k=2, num_nodes=100, expand_while=expand_while)
    assert len(calls) == 2 and tree.max_depth == 3  # layers 2 and 3 drafted, layer 4 refused
    assert seen[0] == pytest.approx(float(root.max().log()))
    assert seen[1] == pytest.approx(float(root.max().log()) + math.log(1.0 / vocab))
    full = dynamic_tree(root, child_probs, depth=6, top_k=2, num_nodes=100)
    assert full.max_depth == 6
