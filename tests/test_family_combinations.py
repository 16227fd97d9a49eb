"""Every issue-45 VLM family x the combinations that are not chain drafting: the drafter name
``"eagle2"``, an EAGLE-2 token tree, a batch of rows, CUDA graphs (``CapturedTransformersTarget``,
run eagerly on a CPU).

Each combination either works, giving transformers' greedy tokens (a batch: each row its batch-1
output), or is refused with one ``ValueError`` line saying why and what to use instead -- never
another exception, never a traceback from inside transformers. Which of the two is pinned per
family (:data:`REFUSED`), the same table as docs/families.md. Tiny random models of each family
(the builders of the family tests), fp32; every family of issue 45.
"""

import pytest
import torch
from test_conformance import random_eagle_head

import mmspec
from mmspec.adapters.hf import CapturedTransformersTarget
from mmspec.api import generate_rows
from mmspec.drafters import Eagle2Drafter


K, MAX_NEW = 3, 6


def _mrope(family):
    from tiny_mrope import make_mrope

    case = make_mrope(family)
    return case.model, case.inputs


def _vlm_family(family):
    from tiny_vlm_families import make_tiny_family

    case = make_tiny_family(family)
    return case.model, case.inputs


def _gemma4(_):
    from test_gemma4 import vlm, vlm_inputs

    return vlm(), vlm_inputs()


def _hybrid(family):
    from test_hybrid import BUILD, inputs_of

    return BUILD[family](0), inputs_of(family)


#: every issue-45 family (the hybrid text models too)
BUILDERS = {"qwen2_vl": _mrope, "qwen2_5_vl": _mrope, "qwen3_vl": _mrope, "qwen3_vl_moe": _mrope, "llava_onevision": _vlm_family,
            "internvl": _vlm_family, "mllama": _vlm_family, "gemma4": _gemma4, "qwen3_5_vl": _hybrid, "qwen3_5_moe_vl": _hybrid,
            "qwen3_5": _hybrid, "qwen3_5_moe": _hybrid, "lfm2": _hybrid, "lfm2_moe": _hybrid, "lfm2_vl": _hybrid}
HYBRID = ("qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "lfm2_vl")
#: what each refusal's line must say (a family not named for a combination runs it)
NO_GRAPHS = "captured forwards need a Llama decoder.*drop cuda_graphs"
REFUSED = {
    # no trained head ships for a random model: the line names the drafter:PATH form and the training command
    "eagle2 (name)": {**{family: "no trained eagle2 drafter ships.*pass drafter='eagle2:PATH'.*mmspec train drafter --method eagle"
                         for family in BUILDERS},
                      # a recurrent target refuses the tree drafter before looking for its weights
                      **{family: "a token tree would need a state per branch. Use a chain drafter" for family in HYBRID}},
    "eagle2 tree": {family: "a token tree would need a state per branch. Use a chain drafter" for family in HYBRID},
    "batch": {},  # every family batches
    "cuda_graphs": {family: NO_GRAPHS for family in BUILDERS},
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request):
    model, inputs = BUILDERS[request.param](request.param)
    with torch.inference_mode():
        reference = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    return request.param, model, inputs, reference


def _run(combination, model, inputs, reference):
    """Run one combination; assert its output where it runs."""
    if combination == "eagle2 (name)":
        out = mmspec.generate(model, drafter="eagle2", max_new_tokens=MAX_NEW, **inputs)
        assert torch.equal(out.sequences, reference)
    elif combination == "eagle2 tree":
        drafter = Eagle2Drafter(model, random_eagle_head(model), depth=K, top_k=2, num_nodes=6)
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, **inputs)
        assert torch.equal(out.sequences, reference)
    elif combination == "batch":
        out = generate_rows(model, [inputs, inputs], drafter="prompt-lookup", max_new_tokens=MAX_NEW, num_draft_tokens=K)
        for row in out.sequences:
            assert torch.equal(row[-MAX_NEW:], reference[0, -MAX_NEW:])
    else:
        target = CapturedTransformersTarget(model)
        out = mmspec.generate(target, drafter="prompt-lookup", max_new_tokens=MAX_NEW, num_draft_tokens=K, **inputs)
        assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("combination", list(REFUSED))
def test_a_combination_works_or_is_refused_in_one_line(case, combination):
    family, model, inputs, reference = case
    refusal = REFUSED[combination].get(family)
    if refusal is None:
        _run(combination, model, inputs, reference)
        return
    with pytest.raises(ValueError) as raised:  # (any other exception type fails the test)
        _run(combination, model, inputs, reference)
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    assert raised.match(refusal), message
