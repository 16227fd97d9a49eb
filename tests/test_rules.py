"""The acceptance-rule registry (mmspec.core.rules): declared parameters and their validation, the
decoding modes, the tree forms of typical acceptance and GSD, and adding a rule by registering a class."""

import math

import pytest
import torch
from tiny_models import make_text_only_draft, make_tiny

import mmspec
from mmspec.core.relaxed import gsd_verify, neighbour_table, tree_gsd_verify
from mmspec.core.rules import RULES, AcceptanceRule, GreedyRule, RuleParams, register_rule, resolve_rule
from mmspec.core.sampling import SamplingConfig
from mmspec.core.tree import TokenTree
from mmspec.core.verify import PAD, tree_typical_verify, typical_verify

GREEDY, SAMPLE = SamplingConfig(do_sample=False), SamplingConfig(do_sample=True)
TABLE = neighbour_table(torch.arange(16, dtype=torch.float)[:, None], 3)


def test_registry_declares_every_rule():
    assert {"greedy", "speculative", "typical", "lantern", "lantern++", "gsd", "topk-tolerance", "group"} <= set(RULES)
    # PCG's group acceptance: a multi-draft tree walk over overlapping groups is not derived; CSpD:
    # continuous drafts are linear
    chain_only = {"group", "cspd", "cspd-tempered"}
    for name, rule in RULES.items():
        assert rule.name == name and issubclass(rule.Params, RuleParams) and rule.sampling in ("greedy", "sampling", "either")
        assert rule.supports_tree() != (name in chain_only), name  # every other built-in rule has a tree form
    assert RULES["greedy"].lossless and RULES["speculative"].lossless and RULES["cspd"].lossless
    assert [name for name, rule in RULES.items() if rule.continuous] == ["cspd", "cspd-tempered"]
    assert not RULES["cspd-tempered"].lossless
    assert not any(RULES[name].lossless for name in ("typical", "lantern", "lantern++", "gsd", "topk-tolerance", "group"))


def test_auto_and_modes():
    assert resolve_rule(None, GREEDY).name == "greedy" and resolve_rule("auto", SAMPLE).name == "block"
    assert resolve_rule("lantern", GREEDY, {"neighbours": TABLE}).name == "lantern"  # either mode
    assert resolve_rule("lantern", SAMPLE, {"neighbours": TABLE}).name == "lantern"
    with pytest.raises(ValueError, match="needs do_sample=True; for greedy decoding use 'lantern'"):
        resolve_rule("gsd", GREEDY, {"neighbours": TABLE})
    with pytest.raises(ValueError, match="would not sample"):
        resolve_rule("greedy", SAMPLE)
    with pytest.raises(ValueError, match="unknown acceptance rule 'best'"):
        resolve_rule("best", SAMPLE)
    with pytest.raises(ValueError, match="only with a rule name"):
        resolve_rule(GreedyRule(), GREEDY, {"delta": 0.1})


@pytest.mark.parametrize("name,kwargs,match", [
    ("lantern", {"neighbours": TABLE, "delta": math.nan}, "delta must be a finite number >= 0 and <= 1"),
    ("lantern", {"neighbours": TABLE, "delta": 1.5}, "delta"),
    ("lantern", {"delta": 0.1}, "needs rule_kwargs\\['neighbours'\\]"),
    ("lantern", {"neighbours": TABLE.float()}, "LongTensor"),
    ("lantern", {"neighbours": TABLE[:, :0]}, "k >= 1"),
    ("lantern++", {"neighbours": TABLE, "lam": 0.5}, "lam must be a finite number >= 1"),
    ("lantern++", {"neighbours": TABLE, "lam": math.inf}, "lam"),
    ("gsd", {"neighbours": TABLE, "top_m": 0}, "top_m must be an integer >= 1"),
    ("gsd", {"neighbours": TABLE, "top_m": 2.5}, "top_m must be an integer"),
    ("typical", {"posterior_threshold": math.nan}, "posterior_threshold"),
    ("typical", {"posterior_alpha": -1.0}, "posterior_alpha"),
    ("gsd", {"neighbours": TABLE, "delta": 0.1}, "takes no parameter 'delta' \\(its parameters: neighbours, top_m\\)"),
    ("speculative", {"top_m": 5}, "takes no parameter 'top_m' \\(its parameters: none\\)"),
])
def test_parameters_are_validated(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_rule(name, SAMPLE, kwargs)


def test_scalar_values_are_checked_without_a_table():
    """A setting (``mmspec t2i --delta``) is checked before the model, and so its neighbour
    table, exists: check_values checks the scalars alone, validate adds the table."""
    params = RULES["lantern"].Params(delta=0.2)
    params.check_values("lantern")
    with pytest.raises(ValueError, match="needs rule_kwargs"):
        params.validate("lantern")
    with pytest.raises(ValueError, match="delta must be"):
        RULES["lantern"].Params(delta=2.0).check_values("lantern")
    with pytest.raises(ValueError, match="top_m must be"):
        RULES["gsd"].Params(top_m=0).check_values("gsd")


def test_defaults_live_in_the_parameters():
    rule = resolve_rule("gsd", SAMPLE, {"neighbours": TABLE})
    assert rule.describe() == {"acceptance": "gsd", "neighbours_k": 3, "top_m": 50}
    assert resolve_rule("lantern", GREEDY, {"neighbours": TABLE}).params.delta == 0.05
    assert resolve_rule("typical", SAMPLE).describe() == {"acceptance": "typical", "posterior_threshold": 0.09,
                                                            "posterior_alpha": 0.3}


# tree forms ----------------------------------------------------------------------------------------
def _random_case(seed, batch=64, k=4, vocab=16):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 2, -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(batch, k)
    return draft, q, p, torch.rand(batch, k, generator=g), torch.rand(batch, generator=g)


def test_typical_on_a_chain_is_the_linear_rule():
    draft, _, p, _, s = _random_case(0)
    kw = dict(posterior_threshold=0.09, posterior_alpha=0.3)
    linear = typical_verify(draft, p, s, **kw)
    tree = tree_typical_verify(TokenTree.chain(draft), p, s, **kw)
    assert linear.num_accepted.float().mean() > 0.3  # the case accepts something
    assert torch.equal(linear.tokens, tree.tokens) and torch.equal(linear.num_accepted, tree.num_accepted)


@pytest.mark.parametrize("greedy", [False, True])
def test_topk_tolerance_on_a_chain_is_the_linear_rule(greedy):
    from mmspec.core.relaxed import topk_tolerance_verify, tree_topk_tolerance_verify

    draft, _, p, _, s = _random_case(1)
    s = None if greedy else s
    linear = topk_tolerance_verify(draft, p, top_k=4, sample_uniforms=s)
    tree = tree_topk_tolerance_verify(TokenTree.chain(draft), p, top_k=4, sample_uniforms=s)
    assert linear.num_accepted.float().mean() > 0.3
    assert torch.equal(linear.tokens, tree.tokens) and torch.equal(linear.num_accepted, tree.num_accepted)


def test_typical_on_a_tree_takes_the_longest_passing_path():
    # root -> a (node 0, token 1, a leaf), root -> b (node 1, token 2) -> c (node 2, token 3)
    tree = TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]))
    vocab = 6
    p = torch.full((1, 4, vocab), 1e-6)
    p[0, 0, 1], p[0, 0, 2] = 0.5, 0.5  # both children of the root pass
    p[0, 1, 0] = 1.0  # after a
    p[0, 2, 3] = 1.0  # after b: c passes
    p[0, 3, 4] = 1.0  # after c: the bonus token is 4
    p = p / p.sum(-1, keepdim=True)
    v = tree_typical_verify(tree, p, torch.tensor([0.5]), posterior_threshold=0.09, posterior_alpha=0.3)
    assert v.num_accepted.tolist() == [2] and v.path.tolist() == [[1, 2]] and v.tokens.tolist() == [[2, 3, 4]]
    p[0, 2, 3], p[0, 2, 5] = 1e-6, 1.0  # c fails: both paths have depth 1, the first in try order wins
    v = tree_typical_verify(tree, p / p.sum(-1, keepdim=True), torch.tensor([0.5]), posterior_threshold=0.09, posterior_alpha=0.3)
    assert v.path.tolist() == [[0, PAD]] and v.tokens.tolist() == [[1, 0, PAD]]


def test_gsd_on_a_chain_is_the_linear_rule_bit_for_bit():
    table = neighbour_table(torch.randn(16, 2, generator=torch.Generator().manual_seed(1)), 4)
    for seed, deterministic in ((0, False), (1, True)):
        draft, q, p, r, s = _random_case(seed)
        q = None if deterministic else q
        linear = gsd_verify(draft, q, p, table, r, s, top_m=5)
        tree = tree_gsd_verify(TokenTree.chain(draft, q), p, table, r, s, top_m=5)
        assert 0 < linear.num_accepted.float().mean() < 4
        assert torch.equal(linear.tokens, tree.tokens) and torch.equal(linear.num_accepted, tree.num_accepted)


def test_gsd_on_a_tree_tries_siblings_on_the_residual():
    # codes on a line: code 1's neighbour is 2; two deterministic children of the root: 5 then 1
    table = neighbour_table(torch.tensor([[0.0], [1.0], [1.1], [5.0], [9.0], [20.0]]), 1)
    tree = TokenTree(torch.tensor([5, 1]), torch.tensor([-1, -1]))
    p = torch.tensor([[[0.02, 0.3, 0.6, 0.04, 0.02, 0.02], *[[1 / 6] * 6] * 2]])
    r = torch.tensor([[0.5, 0.7]])  # node 0: 0.5 >= p(5) = 0.02, rejected
    v = tree_gsd_verify(tree, p, table, r, torch.tensor([0.5]), top_m=2)
    # node 1 on the residual (5 removed): C = {1, 2}, mass 0.9 / 0.98 > 0.7: accepted
    assert v.path.tolist() == [[1]] and v.tokens[0, 0] == 1
    v = tree_gsd_verify(tree, p, table, r, torch.tensor([0.5]), top_m=1)  # only code 2 is likely: C = {1, 2}
    assert v.path.tolist() == [[1]]
    r = torch.tensor([[0.5, 0.95]])  # 0.95 > 0.918: rejected; the token comes from p without 5, 1, 2
    v = tree_gsd_verify(tree, p, table, r, torch.tensor([0.5]), top_m=2)
    assert v.num_accepted.tolist() == [0] and int(v.tokens[0, 0]) in (0, 3, 4)


# through the loop ----------------------------------------------------------------------------------
def test_typical_and_gsd_run_on_trees_in_the_loop():
    from test_tree import TreeModelDrafter

    case = make_tiny("llama")
    table = neighbour_table(torch.randn(case.vocab_size, 4, generator=torch.Generator().manual_seed(0)), 3)
    for acceptance, kwargs in (("typical", {}), ("gsd", {"neighbours": table, "top_m": 8})):
        out = mmspec.generate(case.model, drafter=TreeModelDrafter(case.model), max_new_tokens=10, do_sample=True, seed=3,
                              acceptance=acceptance, rule_kwargs=kwargs, eos_token_id=[], **case.inputs)
        again = mmspec.generate(case.model, drafter=TreeModelDrafter(case.model), max_new_tokens=10, do_sample=True, seed=3,
                                acceptance=acceptance, rule_kwargs=kwargs, eos_token_id=[], **case.inputs)
        assert out.stats.new_tokens == 10 and out.stats.tree_nodes > 0 and out.stats.config["acceptance"] == acceptance
        assert torch.equal(out.sequences, again.sequences)


def test_medusa_with_its_own_rule():
    """Medusa's setting: typical acceptance on the heads' static tree."""
    from test_conformance import random_heads

    from mmspec.drafters import MedusaDrafter

    case = make_tiny("llama")
    drafter = MedusaDrafter(case.model, random_heads(case.model, "medusa"))
    out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=12, do_sample=True, seed=0, acceptance="typical",
                          eos_token_id=[], **case.inputs)
    assert out.stats.new_tokens == 12 and out.stats.tree_nodes > 0 and out.stats.config["tree"] == "static"


def test_a_rule_without_a_tree_form_refuses_trees():
    from test_tree import TreeModelDrafter

    class LinearOnly(GreedyRule):
        name = "linear-only"
        verify_tree = AcceptanceRule.verify_tree

    case = make_tiny("llama")
    assert not LinearOnly.supports_tree()
    with pytest.raises(ValueError, match="'linear-only' is not implemented for token trees; use one of greedy"):
        mmspec.generate(case.model, drafter=TreeModelDrafter(case.model), max_new_tokens=4, acceptance=LinearOnly(),
                        **case.inputs)


def test_adding_a_rule_is_one_registered_class():
    from dataclasses import dataclass

    @dataclass(frozen=True, eq=False)
    class StrictParams(RuleParams):
        margin: float = 0.0

    class Strict(GreedyRule):  # greedy, but only accepts drafts whose target probability beats the margin
        name = "strict-greedy"
        Params = StrictParams

        def verify(self, draft, target_logits, sampling, uniforms):
            probs = target_logits.float().softmax(-1)
            sure = probs.max(-1).values[:, : draft.length] > self.params.margin
            return super().verify(draft.__class__(tokens=torch.where(sure, draft.tokens, -2)), target_logits, sampling, uniforms)

    register_rule(Strict)
    try:
        case = make_tiny("llama")
        draft = make_text_only_draft(case.vocab_size)
        plain = mmspec.generate(case.model, drafter=draft, max_new_tokens=8, **case.inputs)
        strict = mmspec.generate(case.model, drafter=draft, max_new_tokens=8, acceptance="strict-greedy",
                                 rule_kwargs={"margin": 1.0}, **case.inputs)  # accepts nothing, still exact
        assert torch.equal(plain.sequences, strict.sequences) and strict.stats.accepted == 0
        assert strict.stats.config["margin"] == 1.0
        with pytest.raises(ValueError, match="already registered"):
            register_rule(Strict)
    finally:
        del RULES["strict-greedy"]
