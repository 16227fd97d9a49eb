"""Ladder level 2 for every issue-45 family: speculative sampling samples the target's own
distribution.

One tiny random model per family (the builders of the family tests), a few sampled tokens, one
chain drafter per family, rotated over the kinds (prompt lookup, a draft model -- a same-family VLM
or a text-only one (SPD) -- layer skip, an EAGLE head): each position's token frequencies over
seeded runs pass a chi-square test against the target's exact marginals (enumerated by full
forwards, :mod:`distribution_check`; in two stages, :func:`~distribution_check.two_stage`: half
the runs, all of them where a p-value is under 0.2), drafts were both accepted and rejected, and
the same first-token counts fail against another random model of the family (negative control:
the test can fail).
Gemma 4 (tests/test_gemma4.py) and Qwen3.5's text model (tests/test_hybrid.py, a rejected draft
replayed inside the verification) have their own tests.
"""

import pytest
import torch
from distribution_check import exact_marginals, pvalue, sampled_counts, two_stage

from mmspec.core.sampling import SamplingConfig
from mmspec.drafters import EagleDrafter, ModelDrafter

NEW, RUNS = 4, 200
SAMPLING = SamplingConfig(do_sample=True, temperature=1.5, top_k=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: the hybrids' depthwise convolutions wait on OpenMP barriers on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sharpen(model, scale: float = 4.0):
    """Sharper next-token distributions than a random init gives: a real top-k support."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "vision_start_token_id",
                "vision_end_token_id")


def _text_outputs(model):
    """Zero the LM-head rows of the image / video placeholder tokens (logit 0, far below a top-4):
    a sampled placeholder would be an image without pixels in the enumeration's forwards."""
    with torch.no_grad():
        for name in PLACEHOLDERS:
            token = getattr(model.config, name, None)
            if token is not None:
                model.get_output_embeddings().weight[token].zero_()
    return model


def _mrope(family, seed):
    from tiny_mrope import make_mrope

    case = make_mrope(family, seed=seed)
    return _text_outputs(_sharpen(case.model)), case.inputs


def _vlm_family(family, seed):
    from tiny_vlm_families import make_tiny_family

    case = make_tiny_family(family, seed=seed)
    return _text_outputs(case.model), case.inputs


def _hybrid(family, seed):
    from test_hybrid import BUILD, inputs_of

    return _text_outputs(BUILD[family](seed)), inputs_of(family)


def _token_eagle(model):
    """An EAGLE head (the family's layer) that passes the drafted token's embedding through (fc =
    [I, 0], the layer's output projections zero): q = the LM head on e(x_{t+1}), which in these
    tiny models agrees with the target often enough for both accepted and rejected drafts."""
    from test_conformance import random_eagle_head

    head = random_eagle_head(model)
    hidden = head.fc.weight.shape[0]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        for name, parameter in head.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()
    return EagleDrafter(model, head, num_draft_tokens=2)


def _near_copy(scale):
    """A same-family draft: the target with noise of ``scale`` x each weight's std."""
    from test_mrope import near_copy

    return lambda model: ModelDrafter(near_copy(model, scale), num_draft_tokens=2)


def _own_text_model(model):
    """SPD: the VLM's own text decoder and LM head as a text-only causal LM (it sees the prompt
    without its image tokens, so it agrees with the target often, not always)."""
    from transformers import AutoModelForCausalLM

    from mmspec.adapters.hf import text_decoder

    draft = AutoModelForCausalLM.from_config(model.config.get_text_config())
    draft.model.load_state_dict(text_decoder(model).state_dict())
    draft.get_output_embeddings().load_state_dict(model.get_output_embeddings().state_dict())
    return ModelDrafter(draft.eval(), num_draft_tokens=2)


def _layer_skip(layers):
    return lambda model: f"layer-skip:{layers}"


def _prompt_lookup(model):
    return "prompt-lookup"


def _self_written(build):
    """The family's prompt followed by 16 tokens of the target's own greedy decoding: prompt lookup
    then finds n-grams the target continues as it wrote them."""
    from distribution_check import extended

    def written(family, seed):
        model, inputs = build(family, seed)
        with torch.inference_mode():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=16)
        return model, extended(inputs, ids[:, inputs["input_ids"].shape[1]:])
    return written


#: family -> (builder(family, seed) -> (model, inputs), drafter(model) -> drafter spec)
CASES = {
    "qwen2_vl": (_mrope, _near_copy(0.2)),
    "qwen2_5_vl": (_mrope, _token_eagle),
    "qwen3_vl": (_self_written(_mrope), _prompt_lookup),
    "qwen3_vl_moe": (_mrope, _layer_skip(1)),
    "llava_onevision": (_vlm_family, _own_text_model),
    "internvl": (_vlm_family, _layer_skip(1)),
    "mllama": (_vlm_family, _layer_skip(2)),  # (through its cross-attention layer)
    "qwen3_5_vl": (_hybrid, _near_copy(0.05)),
    "qwen3_5_moe_vl": (_hybrid, _layer_skip(2)),
    "qwen3_5_moe": (_hybrid, _layer_skip(4)),
    "lfm2": (_hybrid, _layer_skip(2)),
    "lfm2_moe": (_hybrid, _near_copy(0.2)),
    "lfm2_vl": (_hybrid, _own_text_model),
}


@pytest.mark.parametrize("family", list(CASES))
def test_speculative_sampling_samples_the_target_distribution(family):
    build, drafter = CASES[family]
    model, inputs = build(family, 0)
    exact = exact_marginals(model, inputs, SAMPLING, NEW)
    spec, counts, tally = drafter(model), torch.zeros(NEW, exact[0].numel(), dtype=torch.float64), [0, 0]

    def draw(seed):  # (the runs in two stages: tests/distribution_check.two_stage)
        seed_counts, seed_drafted, seed_accepted = sampled_counts(model, spec, inputs, SAMPLING, NEW, range(seed, seed + 1))
        counts.add_(seed_counts)
        tally[0], tally[1] = tally[0] + seed_drafted, tally[1] + seed_accepted

    runs, found = two_stage(RUNS, draw, lambda n: [pvalue(counts[i], exact[i]) for i in range(NEW)])
    drafted, accepted = tally
    assert accepted > 10 * runs / RUNS and drafted - accepted > 10 * runs / RUNS, (drafted, accepted)  # both paths taken
    assert min(found) > 1e-4, (found, [(c.nonzero().flatten(), e.nonzero().flatten()) for c, e in zip(counts, exact)])
    # negative control: another random model of the family, whose first token's support differs (its
    # marginal of one token: one forward; a token outside a support gives p = 0 at any number of runs)
    other = exact_marginals(build(family, 1)[0], inputs, SAMPLING, 1)
    assert pvalue(counts[0], other[0]) < 1e-4
