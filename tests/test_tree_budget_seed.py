"""Regression: EAGLE-2's automatic tree size must not make seeded sampling depend on the clock.

``num_nodes="auto"`` sizes the tree from the target's verification cost and the drafting time. When
those came from wall-clock timings, the same seed gave different captions / images from run to run:
the tree's shape decides how many random numbers are drawn, and which. The test replaces the clock
with a noisy one (a different noise per run, as different processes or a loaded machine would see)
and forgets the per-process cost curve between runs, so an auto-sized tree that reads the clock
changes from run to run; the output with the same seed must not.
"""

import random
import time

import pytest
import torch
from tiny_models import make_tiny

import mmspec
from mmspec.adapters.hf import text_decoder
from mmspec.adapters.image_gen import LlamaGenTarget
from mmspec.core import cost
from mmspec.drafters import Eagle2Drafter, ImageEagle2Drafter
from mmspec.modeling.heads import EagleHead, ImageEagleConfig, ImageEagleHead
from mmspec.modeling.llamagen import LlamaGenConfig, LlamaGenModel

SIDE, CODES, PREFIX, CAPTION_DIM = 4, 16, 3, 8


def noisy_clock(monkeypatch, noise_seed: int) -> None:
    """time.perf_counter -> a clock whose every reading advances by a random 0.1-100 ms."""
    rng = random.Random(noise_seed)
    now = [0.0]

    def perf_counter() -> float:
        now[0] += 10 ** rng.uniform(-4, -1)
        return now[0]

    monkeypatch.setattr(time, "perf_counter", perf_counter)
    monkeypatch.setattr(cost, "_CURVES", {})  # a fresh process: the cost curve is measured again


def text_case():
    case = make_tiny("llama")
    torch.manual_seed(4)
    head = EagleHead(text_decoder(case.model).config).eval()
    return case, head


def image_case():
    torch.manual_seed(0)
    config = LlamaGenConfig(dim=32, n_layer=2, n_head=2, vocab_size=CODES, cls_token_num=PREFIX, caption_dim=CAPTION_DIM,
                            block_size=SIDE * SIDE, multiple_of=16, rope_prefix="identity")
    model = LlamaGenModel(config).eval()
    with torch.no_grad():
        model.output.weight.mul_(3.0)
    torch.manual_seed(5)
    head = ImageEagleHead(ImageEagleConfig(dim=32, n_head=2, grid=(SIDE, SIDE))).eval()
    caption = torch.randn(1, PREFIX, CAPTION_DIM, generator=torch.Generator().manual_seed(3))
    return LlamaGenTarget(model), head, caption


@pytest.mark.parametrize("sampled_children", [None, False])
def test_same_seed_same_text_with_auto_tree_and_a_noisy_clock(monkeypatch, sampled_children):
    case, head = text_case()
    outputs, configs = [], []
    for noise in range(3):
        noisy_clock(monkeypatch, noise)
        drafter = Eagle2Drafter(case.model, head, depth=5, top_k=4, sampled_children=sampled_children)
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=32, do_sample=True, temperature=1.0,
                              seed=123, **case.inputs)
        outputs.append(out.sequences)
        configs.append(out.stats.config)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    assert configs[0]["tree_budget"] == "nominal"  # the size came from the deterministic cost model
    assert configs[0]["mean_tree_nodes"] == configs[1]["mean_tree_nodes"] == configs[2]["mean_tree_nodes"]


def test_same_seed_same_image_with_auto_tree_and_a_noisy_clock(monkeypatch):
    target, head, caption = image_case()
    outputs = []
    for noise in range(3):
        noisy_clock(monkeypatch, noise)
        drafter = ImageEagle2Drafter(target, head, depth=4, top_k=3, max_nodes=24)
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=SIDE * SIDE, do_sample=True, temperature=1.0,
                              top_k=8, seed=5, caption=caption, guidance_scale=2.0)
        outputs.append(out.sequences)
        assert out.stats.config["tree_budget"] == "nominal"
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_greedy_auto_tree_keeps_timing_and_reports_sensible_sizes():
    """Greedy output does not depend on the tree, so the clock may size it; the output is AR's and
    the stats name the timed budget and sizes within the limits."""
    case, head = text_case()
    reference = mmspec.generate(case.model, max_new_tokens=16, **case.inputs)
    drafter = Eagle2Drafter(case.model, head, depth=4, top_k=3, max_nodes=20)
    out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, **case.inputs)
    assert torch.equal(out.sequences, reference.sequences)
    config = out.stats.config
    assert config["tree_budget"] == "timed" and config["num_nodes"] == "auto"
    assert 0 <= config["mean_tree_nodes"] <= 20 and 1 <= config["mean_depth_drafted"] <= 4


def test_a_budget_can_be_chosen_by_name():
    case, head = text_case()
    runs = []
    for _ in range(2):
        drafter = Eagle2Drafter(case.model, head, depth=4, top_k=3, budget="nominal")
        runs.append(mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, **case.inputs))
    assert runs[0].stats.config["tree_budget"] == "nominal"
    assert runs[0].stats.config["mean_tree_nodes"] == runs[1].stats.config["mean_tree_nodes"]  # greedy too: no clock
    with pytest.raises(ValueError, match="budget"):
        Eagle2Drafter(case.model, head, budget="fastest")


def test_greedy_lantern_auto_tree_does_not_read_the_clock(monkeypatch):
    """Greedy LANTERN accepts drafted neighbours the target would not have chosen, so the tree's
    shape changes the image: its auto-sized tree takes the nominal budget, and the same inputs
    give the same image whatever the clock reads."""
    from mmspec.core.relaxed import neighbour_table

    target, head, caption = image_case()
    table = neighbour_table(torch.randn(CODES, 4, generator=torch.Generator().manual_seed(1)), 4)  # a stand-in codebook
    outputs = []
    for noise in range(3):
        noisy_clock(monkeypatch, noise)
        drafter = ImageEagle2Drafter(target, head, depth=4, top_k=3, max_nodes=24)
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=SIDE * SIDE, acceptance="lantern",
                              rule_kwargs={"neighbours": table, "delta": 0.3}, caption=caption, guidance_scale=2.0)
        outputs.append(out.sequences)
        assert out.stats.config["tree_budget"] == "nominal"
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_greedy_trees_carry_their_calibration_across_generations_and_sampled_trees_do_not():
    """Exact greedy decoding's output does not depend on the tree, so a drafter's next generation
    starts from the confidences' calibration its last one left (a caption's first steps no longer
    trust the head afresh); a sampled generation starts from rho = 1, so a seed still reproduces it."""
    case, head = text_case()
    with torch.no_grad():
        head.decoder.norm.weight.mul_(30.0)  # a confident head: trees are kept, and rejected
    reference = mmspec.generate(case.model, max_new_tokens=16, **case.inputs)
    drafter = Eagle2Drafter(case.model, head, depth=4, top_k=3, max_nodes=20)
    mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, **case.inputs)
    learned = drafter.policy.calibration
    assert not torch.equal(learned.factors(), torch.ones(5))  # the first generation saw evidence
    second = mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, **case.inputs)
    assert drafter.policy.calibration is learned and torch.equal(second.sequences, reference.sequences)
    sampled = [mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, do_sample=True, seed=3, **case.inputs)
               for _ in range(2)]
    assert drafter.policy.calibration is not learned and torch.equal(sampled[0].sequences, sampled[1].sequences)
    drafter.carry_calibration = False
    mmspec.generate(case.model, drafter=drafter, max_new_tokens=16, **case.inputs)
    assert drafter.policy.calibration is not learned
