"""Ladder levels 3-5 and 7: every supported architecture, every drafter, against transformers.

Tiny random models of each family (configs built in tiny_models.py, never downloaded), fp32.
Pixtral appears twice: inside Mistral3 (``mistral3``) and in Pixtral-12B's own layout, transformers'
LLaVA class with a Pixtral vision tower (``pixtral``).
"""

import pytest
import torch
from tiny_models import FAMILIES, make_text_only_draft, make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.drafters import Eagle2Drafter, EagleDrafter, HydraDrafter, KangarooDrafter, MedusaDrafter, ModelDrafter
from mmspec.modeling.heads import DraftHeads, EagleHead, KangarooAdapter

K = 4
MAX_NEW = 1 + 3 * (K + 1)  # the prefill token, then three full verification steps


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return make_tiny(request.param)


@pytest.fixture(scope="module")
def reference(case):
    with torch.inference_mode():
        return case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW)


def drafter_specs(case):
    return {
        "ar": None,
        "prompt-lookup": "prompt-lookup",
        "layer-skip:1": "layer-skip:1",
        "random draft (SPD for VLMs)": make_text_only_draft(case.vocab_size, seed=7),
        "same model": ModelDrafter(case.model, num_draft_tokens=K),
        "eagle (random head)": EagleDrafter(case.model, random_eagle_head(case.model), num_draft_tokens=K),
        "eagle2 (random head)": Eagle2Drafter(case.model, random_eagle_head(case.model), depth=K, top_k=3, num_nodes=8),
        "eagle2 (draft vocabulary)": Eagle2Drafter(case.model, random_eagle_head(case.model), depth=K, top_k=3, num_nodes=8,
                                                   draft_vocabulary=torch.randperm(case.vocab_size, generator=torch.Generator().manual_seed(2))[: case.vocab_size // 2]),
        "medusa (random heads)": MedusaDrafter(case.model, random_heads(case.model, "medusa")),
        "hydra (random heads)": HydraDrafter(case.model, random_heads(case.model, "hydra")),
        "kangaroo (random adapter)": KangarooDrafter(case.model, random_kangaroo(case.model), exit_layer=1, num_draft_tokens=K, stop_threshold=0.0),
    }


def random_heads(model, kind):
    torch.manual_seed(4)
    heads = DraftHeads(model.get_output_embeddings().weight.shape[1], num_heads=4, kind=kind)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.to(model.dtype).eval()


def random_kangaroo(model):
    torch.manual_seed(8)
    return KangarooAdapter(text_decoder(model).config).to(model.dtype).eval()


def random_eagle_head(model):
    torch.manual_seed(3)
    return EagleHead(text_decoder(model).config).to(model.dtype).eval()


@pytest.mark.parametrize("name", ["ar", "prompt-lookup", "layer-skip:1", "random draft (SPD for VLMs)", "same model", "eagle (random head)", "eagle2 (random head)",
                                  "eagle2 (draft vocabulary)", "medusa (random heads)", "hydra (random heads)", "kangaroo (random adapter)"])
def test_greedy_identical_to_transformers(case, reference, name):
    out = mmspec.generate(case.model, drafter=drafter_specs(case)[name], max_new_tokens=MAX_NEW, num_draft_tokens=K, **case.inputs)
    assert out.sequences.shape == reference.shape
    assert torch.equal(out.sequences, reference)
    assert out.stats.new_tokens == MAX_NEW


def test_self_draft_accepts_everything(case):
    """Level 5: the target drafting for itself accepts every draft: acceptance 1, tau = K + 1."""
    out = mmspec.generate(case.model, drafter=ModelDrafter(case.model, num_draft_tokens=K), max_new_tokens=MAX_NEW, **case.inputs)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.mean_accepted_length == K + 1
    assert out.stats.verify_steps == 3 and out.stats.target_forwards == 4
    assert out.stats.acceptance_per_position == [1.0] * K


def test_vlm_draft_sees_the_image(case):
    if not case.is_vlm:
        pytest.skip("text-only family")
    drafter = ModelDrafter(case.model, num_draft_tokens=K)
    out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=MAX_NEW, **case.inputs)
    assert out.stats.config["sees_image"] is True
    spd = mmspec.generate(case.model, drafter=make_text_only_draft(case.vocab_size, seed=7), max_new_tokens=MAX_NEW, **case.inputs)
    assert spd.stats.config["sees_image"] is False


def test_stops_at_eos_like_transformers(case, reference):
    """An EOS in the middle of an accepted draft ends generation exactly where AR decoding ends."""
    generated = reference[0, case.prompt_len :].tolist()
    eos = generated[6]
    with torch.inference_mode():
        expected = case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert expected.shape[1] < reference.shape[1]  # the EOS really stops early
    for name, spec in drafter_specs(case).items():
        out = mmspec.generate(case.model, drafter=spec, max_new_tokens=MAX_NEW, eos_token_id=eos, num_draft_tokens=K, **case.inputs)
        assert torch.equal(out.sequences, expected), name


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_exact(case, reference, max_new):
    out = mmspec.generate(case.model, drafter=ModelDrafter(case.model, num_draft_tokens=K), max_new_tokens=max_new, **case.inputs)
    assert torch.equal(out.sequences, reference[:, : case.prompt_len + max_new])


def test_seeded_sampling_is_deterministic(case):
    """Level 3: same seed, same output; a different seed gives a different sample."""
    kwargs = dict(drafter=make_text_only_draft(case.vocab_size, seed=7), max_new_tokens=12, do_sample=True, temperature=1.5, **case.inputs)
    a = mmspec.generate(case.model, seed=11, **kwargs)
    b = mmspec.generate(case.model, seed=11, **kwargs)
    c = mmspec.generate(case.model, seed=12, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_pixels_encoded_once(case):
    """The image goes through the vision encoder in the prefill only, never again while decoding
    (the first prefill over a model encodes it twice: through the model's forward, and again to
    check the lean prefill's embeddings against it; every later prefill once, a new target's over
    the same model included, as ``mmspec.generate(model, ...)`` makes one per call)."""
    if not case.is_vlm:
        pytest.skip("text-only family")
    fresh = make_tiny(case.family)  # a model no target has prefilled yet (the module's case is shared)
    inner = fresh.model.model
    vision = getattr(inner, "vision_tower", None) or getattr(inner, "vision_model")
    calls = []
    handle = vision.register_forward_hook(lambda *args: calls.append(1))
    target = TransformersTarget(fresh.model)
    try:
        outs = [mmspec.generate(target, drafter="prompt-lookup", max_new_tokens=MAX_NEW, **fresh.inputs) for _ in range(2)]
        first = 2 if target.lean_prefill else 1
        assert len(calls) == first + 1
        again = mmspec.generate(fresh.model, drafter="prompt-lookup", max_new_tokens=MAX_NEW, **fresh.inputs)  # a new target
    finally:
        handle.remove()
    assert all(out.stats.target_forwards > 2 for out in outs) and len(calls) == first + 2
    assert torch.equal(again.sequences, outs[0].sequences)


def test_lean_prefill_is_the_models_forward(case):
    """Where the prompt's embeddings (image features merged) are the ones the model's forward feeds
    its decoder, prompts run through the lean decoder: the last logits and every cached key are the
    model's own (fp32); a family whose merge differs keeps the model's forward."""
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state, out = target.prefill(case.inputs)
        reference = case.model(**case.inputs, use_cache=True)
    expected = {"llama", "llava", "llava_next", "smolvlm"}  # a Llama decoder and transformers' merge
    assert target.lean_prefill == (case.family in expected)
    torch.testing.assert_close(out.logits.float(), reference.logits[:, -1:].float(), rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(state.cache.layers, reference.past_key_values.layers):
        torch.testing.assert_close(mine.keys[..., : state.cache_length, :], theirs.keys, rtol=1e-4, atol=1e-4)
    again, _ = target.prefill(case.inputs)  # later prefills take the same path
    assert again.cache_length == state.cache_length


def test_stats_time_the_drafter():
    case = make_tiny("llama")
    spec = mmspec.generate(case.model, drafter=ModelDrafter(make_text_only_draft(), num_draft_tokens=3), max_new_tokens=12,
                           **case.inputs).stats
    assert 0 < spec.draft_time_s < spec.wall_time_s and spec.draft_ms_per_step == pytest.approx(
        1000 * spec.draft_time_s / spec.verify_steps)
    assert "drafting" in spec.summary() and spec.to_dict()["draft_ms_per_step"] == spec.draft_ms_per_step
    ar = mmspec.generate(case.model, max_new_tokens=12, **case.inputs).stats
    assert ar.draft_time_s == 0 and "drafting" not in ar.summary()
