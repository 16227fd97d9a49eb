"""Hardware-aware draft sizes from a verification cost curve."""

import pytest
import torch
from tiny_models import make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.core.cost import CostModel, measure_verification_cost
from mmspec.drafters import Eagle2Drafter
from mmspec.modeling.heads import EagleHead


def test_forward_cost_interpolates_and_extrapolates():
    model = CostModel({1: 1.0, 4: 1.0, 16: 2.0})
    assert model.forward_cost(1) == 1.0 and model.forward_cost(2) == 1.0
    assert model.forward_cost(10) == pytest.approx(1.5)
    assert model.forward_cost(28) == pytest.approx(3.0)


def test_best_size_follows_the_curve():
    gains = torch.tensor([0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05])
    flat = CostModel({1: 1.0, 64: 1.0})  # a GPU-like flat curve: verify everything
    steep = CostModel({1: 1.0, 2: 2.0, 16: 16.0})  # cost proportional to tokens: nothing pays
    cpu = CostModel({1: 1.0, 4: 1.0, 8: 1.6, 16: 2.6})  # this CPU's shape: a few tokens are free
    assert flat.best_size(gains) == 8
    assert steep.best_size(gains) == 0
    assert cpu.best_size(gains) == 3  # (1 + 0.9 + 0.8 + 0.7) / C(4) = 3.4 beats 3.9 / C(5) = 3.39
    assert cpu.best_size(gains, drafting_time=0.5) >= cpu.best_size(gains)  # drafting cost amortised over more tokens


def test_measured_curve_has_every_size():
    case = make_tiny("llama")
    curve = measure_verification_cost(TransformersTarget(case.model), sizes=(1, 3), context=8, repeats=1)
    assert set(curve) == {1, 3} and all(t > 0 for t in curve.values())


def test_measured_sizes_take_turns_after_the_prompt():
    """Each round times every size once (a drift of the machine's speed falls on all of them), and
    every forward starts from the prompt alone (the appended entries are dropped)."""
    target = TransformersTarget(make_tiny("llama").model)
    calls, forward = [], target.forward

    def recording(state, tokens, *args, **kwargs):
        calls.append((tokens.shape[1], state.cache_length))
        return forward(state, tokens, *args, **kwargs)

    target.forward = recording  # (an attribute of mmspec's own target object, for this test)
    curve = measure_verification_cost(target, sizes=(1, 3, 2), context=8, repeats=2)
    assert [n for n, _ in calls] == [1, 3, 2] * 3 and {length for _, length in calls} == {8}
    assert list(curve) == [1, 3, 2]


def test_eagle2_auto_tree_is_lossless_and_reports_its_choice():
    case = make_tiny("llama")
    torch.manual_seed(3)
    head = EagleHead(text_decoder(case.model).config).eval()
    reference = mmspec.generate(case.model, max_new_tokens=12, **case.inputs)
    out = mmspec.generate(case.model, drafter=Eagle2Drafter(case.model, head, depth=3, top_k=3), max_new_tokens=12, **case.inputs)
    assert torch.equal(out.sequences, reference.sequences)
    assert out.stats.config["num_nodes"] == "auto" and 0 <= out.stats.config["mean_tree_nodes"] <= 64


def test_depth_calibration_tracks_observed_acceptance():
    """Confidences that say 0.9 per depth while only the first token is ever accepted: rho_1 -> 1/0.9,
    deeper rho -> 0; a drafter that is right keeps rho = 1."""
    from mmspec.core.cost import DepthCalibration

    calibration = DepthCalibration(max_depth=3, decay=0.5)
    assert torch.equal(calibration.factors(), torch.ones(4))
    for _ in range(40):
        calibration.update(torch.tensor([0.0, 0.9, 0.81, 0.729]), accepted_length=1)
    rho = calibration.factors()
    assert rho[1] == pytest.approx(1 / 0.9, rel=1e-3) and rho[2] == pytest.approx(0.05) and rho[3] == pytest.approx(0.05)
    honest = DepthCalibration(max_depth=2, decay=0.5)
    for _ in range(40):
        honest.update(torch.tensor([0.0, 1.0, 1.0]), accepted_length=2)
    assert torch.allclose(honest.factors()[1:], torch.ones(2))
    shallow = DepthCalibration(max_depth=3)
    shallow.update(torch.tensor([0.0, 0.5]), accepted_length=0)  # a depth-1 tree leaves depths 2-3 alone
    assert shallow.factors()[2] == 1 and shallow.factors()[1] < 1


def test_path_calibration_conditions_each_depth_on_the_one_above():
    """q = 0.9 per depth while only the first token is ever accepted: r_1 -> 1/0.9, r_2 -> 0 (its
    floor 0.05), so rho_2 and rho_3 (products) fall to ~0.06 although depth 3 was never reached; a rejection at depth 1
    moves r_1 only, and accepted steps that stop at depth 2 bring rho_3 back (a per-depth mean of
    acceptance keeps it low: the trees that no longer reach depth 3 never update it)."""
    from mmspec.core.cost import DepthCalibration, PathCalibration

    overconfident = PathCalibration(max_depth=3, decay=0.5)
    assert torch.equal(overconfident.factors(), torch.ones(4))
    for _ in range(40):
        overconfident.update(torch.tensor([0.0, 0.9, 0.9, 0.0]), accepted_length=1)  # depth 2 verified and rejected
    rho = overconfident.factors()
    assert rho[1] == pytest.approx(1 / 0.9, rel=1e-3) and rho[2] == pytest.approx(0.05 / 0.9, rel=1e-3)
    assert rho[3] == pytest.approx(rho[2])  # r_2 at its floor, r_3 = 1
    assert overconfident.accepted[3] == 1 and overconfident.predicted[3] == 1  # never reached: untouched

    path, per_depth = PathCalibration(max_depth=3, decay=0.5), DepthCalibration(max_depth=3, decay=0.5)
    path.update(torch.tensor([0.0, 0.9]), accepted_length=0)  # a three-deep chain rejected at its first token
    per_depth.update(torch.tensor([0.0, 0.9, 0.8, 0.7]), accepted_length=0)
    assert path.factors()[3] == pytest.approx(path.factors()[1]) and path.factors()[1] < 1  # only r_1 moved
    low = float(per_depth.factors()[3])
    for _ in range(10):  # then two-node chains, both accepted
        path.update(torch.tensor([0.0, 0.95, 0.95, 0.0]), accepted_length=2)
        per_depth.update(torch.tensor([0.0, 0.95, 0.95]), accepted_length=2)
    assert float(per_depth.factors()[3]) == low < 0.6  # frozen
    assert float(path.factors()[3]) > 0.95  # r_1, r_2 restored, r_3 untouched


def test_path_sums_are_the_children_of_the_accepted_path():
    from mmspec.core.cost import PathCalibration

    parents = torch.tensor([-1, -1, 0, 0, 2])
    log_v = torch.tensor([0.9, 0.05, 0.9 * 0.6, 0.9 * 0.3, 0.9 * 0.6 * 0.5]).log()
    sums = PathCalibration.path_sums(parents, log_v, [0, 2])  # nodes 0 then 2 accepted
    assert torch.allclose(sums, torch.tensor([0.0, 0.95, 0.9, 0.5]))  # depth 3: node 2's only child, q = 0.5
    assert torch.allclose(PathCalibration.path_sums(parents, log_v, []), torch.tensor([0.0, 0.95]))


def test_chain_acceptance_is_a_product_of_conditional_rates():
    from mmspec.core.cost import ChainAcceptance

    chain = ChainAcceptance(max_depth=4, decay=0.5)
    assert chain.survival().tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]  # trusted until evidence arrives
    chain.update(drafted_depth=4, accepted_length=1)  # depth 1 accepted, depth 2 rejected; 3, 4 not reached
    assert chain.rates.tolist() == [1.0, 1.0, 0.5, 1.0, 1.0]
    assert chain.survival().tolist() == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.5])
    chain.update(drafted_depth=2, accepted_length=0)  # a shallow step: only depth 1 is reached
    assert chain.rates.tolist() == [1.0, 0.5, 0.5, 1.0, 1.0]
    # the deeper rates keep their conditional values, so the plan can grow again
    assert chain.survival()[4] == pytest.approx(0.25)


def test_tree_budgets_timed_by_a_clock_or_counted():
    """The timed budget reads its clock (c_layer a running mean of the gaps between layers, t the
    time since the step began); the nominal one counts head forwards in units of C(1)."""
    from mmspec.drafters.tree_budget import NominalBudget, TimedBudget, budget_class

    ticks = iter([10.0, 10.5, 11.0, 12.0, 13.0])
    timed = TimedBudget(CostModel({1: 1.0, 8: 2.0}), clock=lambda: next(ticks))
    timed.begin_step()  # 10.0
    assert timed.layer_done() == 1 and timed.layer_cost is None  # 10.5: the first layer starts
    assert timed.layer_done() == 2 and timed.layer_cost == pytest.approx(0.5)  # 11.0
    assert timed.layer_done() == 3 and timed.layer_cost == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)  # 12.0
    assert timed.spent() == pytest.approx(3.0)  # 13.0
    nominal = NominalBudget(CostModel({1: 1.0, 64: 2.0}), layer_cost=0.1)
    nominal.begin_step()
    assert nominal.spent() == pytest.approx(0.1)  # the catch-up forward
    nominal.layer_done(), nominal.layer_done()
    assert nominal.spent() == pytest.approx(0.3) and nominal.describe() == {"tree_budget": "nominal", "layer_cost_c1": 0.1}
    assert budget_class("auto", output_follows_draft=True) is NominalBudget
    assert budget_class("auto", output_follows_draft=False) is TimedBudget
    with pytest.raises(ValueError, match="unknown tree budget"):
        budget_class("fast", output_follows_draft=False)


def test_another_tree_layer_must_repay_its_drafting_and_verification_at_the_current_cost_per_token():
    """EAGLE-2's depth rule: before any step a token is worth C(1) and a node's verification is
    free (rho V C(1) > c_layer); once a step is verified, a token is worth that step's cost per
    committed token and a node costs what one more node adds to the verified tree's forward,
    C(n + 2) - C(n + 1) (not the tree's mean per node, which a convex curve understates), so on a
    steep cost curve a confidence that paid before no longer does."""
    import math

    from mmspec.core.tree import TokenTree
    from mmspec.drafters.tree_budget import NominalBudget, TreeBudgetPolicy

    curve = CostModel({1: 1.0, 4: 1.15, 16: 4.15})  # a CPU whose FMAs bind from 4 rows: then 0.25 C(1) a row
    policy = TreeBudgetPolicy(NominalBudget(curve, layer_cost=0.05), max_depth=8)

    def third_layer_drafted(value: float) -> bool:
        policy.begin_step()
        rule = policy.expand_while(sampled=False)
        rule(0.0), rule(0.0)  # layers 2 and 3 are always drafted
        return rule(math.log(value))

    assert third_layer_drafted(0.1)  # 0.1 C(1) > 0.05: the rule as before
    tree = TokenTree(torch.arange(8), torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6]), scores=torch.linspace(-0.1, -3.0, 8))
    kept = policy.settle(tree, sampled=False)
    policy.on_verified(kept.max_depth, kept.size, num_accepted=3)
    per_node = curve.forward_cost(kept.size + 2) - curve.forward_cost(kept.size + 1)
    assert policy.node_cost == pytest.approx(0.25) == pytest.approx(per_node)
    assert (curve.forward_cost(kept.size + 1) - 1.0) / kept.size < 0.2  # the tree's mean per node: less
    step = curve.forward_cost(kept.size + 1) + 0.05 * 4  # the verification; the catch-up forward and 3 layers drafted
    assert policy.token_cost == pytest.approx(step / 4)
    assert not third_layer_drafted(0.1)  # 0.1 T_tok < 0.05 + dC
    assert third_layer_drafted(0.9)
