"""The EAGLE head's vision option (ViSpec-style, :class:`mmspec.modeling.heads.VisionEagleHead`):
save / load, the drafter's cache layout against the training forward, exact greedy decoding on a
tiny LLaVA and on the embedded captioner, the training option's checks."""

import argparse
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.core.drafter import DraftContext
from mmspec.core.sampling import SamplingConfig
from mmspec.drafters import Eagle2Drafter, EagleDrafter
from mmspec.modeling.heads import EagleHead, VisionEagleHead
from mmspec.train.drafter import collate, eagle_loss, image_features, with_vision_option

K = 4


@pytest.fixture(scope="module")
def llava():
    return make_tiny("llava")


def _vision_head(model, seed: int = 0) -> VisionEagleHead:
    """A vision-aware head with every weight random (the global projection too, which training
    starts at zero), so that the image context changes what it drafts."""
    torch.manual_seed(seed)
    head = VisionEagleHead(text_decoder(model).config, vision_tokens=K)
    torch.nn.init.normal_(head.vision.global_proj.weight, std=0.05)
    return head.eval()


def _features(model, inputs, ids=None):
    """The target's last hidden states over its prompt (+ ``ids`` appended): [1, L, H]."""
    with torch.no_grad():
        out = model(**{**inputs, "input_ids": inputs["input_ids"] if ids is None else ids,
                       "attention_mask": torch.ones_like(inputs["input_ids"] if ids is None else ids)},
                    output_hidden_states=True)
    return out.hidden_states[-1]


def test_save_load_roundtrip_records_the_option(llava, tmp_path):
    head = _vision_head(llava.model)
    head.save(tmp_path / "head", target="tiny")
    loaded = EagleHead.load(tmp_path / "head", llava.model)
    assert type(loaded) is VisionEagleHead and loaded.vision_tokens == K
    assert set(loaded.state_dict()) == set(head.state_dict())
    for name, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    plain = EagleHead(text_decoder(llava.model).config)
    plain.save(tmp_path / "plain")
    assert type(EagleHead.load(tmp_path / "plain", llava.model)) is EagleHead  # the option stays off by default


def test_extend_keeps_the_plain_heads_weights_and_checks_the_count(llava):
    torch.manual_seed(1)
    plain = EagleHead(text_decoder(llava.model).config)
    extended = with_vision_option(plain, K)
    assert isinstance(extended, VisionEagleHead)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, extended.state_dict()[name]), name
    assert not extended.vision.global_proj.weight.any()  # g starts at zero
    assert with_vision_option(plain, 0) is plain
    with pytest.raises(ValueError, match="--vision-tokens 4"):
        with_vision_option(extended, 8)


def test_drafting_cache_matches_the_training_forward(llava):
    """The drafter's prefix in the head cache (positions 0..k-1, pairs at k + t, the global feature
    added) gives the predicted feature the cache-free training forward gives for the same pairs."""
    model = llava.model.float()
    head = _vision_head(model)
    target = TransformersTarget(model)
    drafter = EagleDrafter(model, head, num_draft_tokens=3)
    state, prefill = target.prefill(dict(llava.inputs), hidden_layer=-1)
    state.tokens = torch.cat([state.tokens, prefill.logits[:, -1:].argmax(-1)], dim=1)
    drafter.start(DraftContext(target, SamplingConfig(), torch.Generator().manual_seed(0), llava.inputs), state)
    drafter.on_verified(0, 0, prefill)
    assert drafter.vision is not None and drafter.position_base == -K
    assert len(drafter.image_positions) == int((llava.inputs["input_ids"] == llava.image_token_id).sum()) > 0
    predicted = drafter._catch_up(state)  # [1, 1, H]: after the committed pairs of the prompt

    ids, features = state.tokens, prefill.hidden_states
    with torch.no_grad():
        vision = head.vision_context(*image_features(ids[:, :-1], features, llava.image_token_id))
        reference = head.teacher_forced(features, model.get_input_embeddings()(ids[:, 1:]), vision)[:, -1:]
        without = head.teacher_forced(features, model.get_input_embeddings()(ids[:, 1:]), None)[:, -1:]
    torch.testing.assert_close(predicted, reference, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(predicted, without, atol=1e-3)  # the image context is read


@pytest.mark.parametrize("spec", ["eagle", "eagle2", "eagle3", "eagle3-tree"])
def test_vision_head_greedy_equals_plain_decoding(llava, spec, tmp_path):
    model = llava.model.float()
    (_vision_eagle3 if spec.startswith("eagle3") else _vision_head)(model).save(tmp_path / "head")
    plain = mmspec.generate(model, max_new_tokens=16, **llava.inputs)
    out = mmspec.generate(model, drafter=f"{spec}:{tmp_path / 'head'}", max_new_tokens=16, **llava.inputs)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.stats.config["vision_tokens"] == K


def test_vision_head_is_refused_on_a_text_target(tmp_path):
    tiny = make_tiny("llama")
    head = VisionEagleHead(text_decoder(tiny.model).config, vision_tokens=K)
    with pytest.raises(ValueError, match="vision option.*--vision-tokens"):
        EagleDrafter(tiny.model, head)


def test_loss_trains_the_adaptor_and_needs_an_image_in_every_row(llava):
    model = llava.model.float()
    prompt = llava.inputs["input_ids"]
    with torch.no_grad():
        ids = model.generate(**llava.inputs, max_new_tokens=12, do_sample=False)[0]
    learn = torch.zeros(len(ids), dtype=torch.bool)
    learn[prompt.shape[1]:] = True
    record = {"ids": ids, "learn": learn, "features": _features(model, llava.inputs, ids[None])[0]}
    head = with_vision_option(EagleHead(text_decoder(model).config), K).train()
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    loss, _ = eagle_loss(head, embed, lm_head, collate([record, record]), image_token_id=llava.image_token_id)
    loss.backward()
    for name in ("vision.queries", "vision.attention.in_proj_weight", "vision.global_proj.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name
    text_only = {**record, "ids": torch.where(ids == llava.image_token_id, 0, ids)}
    with pytest.raises(ValueError, match="no image token"):
        eagle_loss(head, embed, lm_head, collate([record, text_only]), image_token_id=llava.image_token_id)


def test_training_option_is_checked_before_anything_loads():
    from mmspec.train.drafter import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="option of the EAGLE head"):
        run(parser.parse_args(["--target", "captioner", "--method", "medusa", "--vision-tokens", "4"]))
    with pytest.raises(ValueError, match="VLM target"):
        run(parser.parse_args(["--target", "smollm2", "--vision-tokens", "4"]))
    with pytest.raises(ValueError, match="--families"):
        run(parser.parse_args(["--target", "captioner", "--families", "scenes,nope"]))


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_embedded_captioner_greedy_is_exact_with_a_vision_head(tmp_path):
    """fp32: the captioner's answer with a vision-aware head (extended from the shipped head, its
    adaptor random) equals plain decoding, through eagle:DIR and eagle2:DIR."""
    from mmspec.hub import models_dir

    pipe = mmspec.pipeline("image-captioning", model=None, drafter="prompt-lookup", device="cpu", dtype=torch.float32)
    model = pipe.target.model
    head = with_vision_option(EagleHead.load(models_dir() / "smolcap-eagle", model), K)
    torch.manual_seed(0)
    torch.nn.init.normal_(head.vision.global_proj.weight, std=0.02)
    head.save(tmp_path / "head")
    image = Path(__file__).resolve().parents[1] / "samples" / "scenes.png"
    for spec in ("eagle", "eagle2"):
        pipe.drafter, pipe.chosen_drafter, pipe.drafter_reason = pipe.resolve_drafter(f"{spec}:{tmp_path / 'head'}")
        out = pipe(image, prompt="Explain what this image shows in detail.", max_new_tokens=20, compare_baseline=True)
        assert out.text and out.text == out.baseline_text, spec
        assert out.stats.config["vision_tokens"] == K and out.stats.new_tokens > 5


def test_the_adaptor_gets_its_own_learning_rate_scale(llava):
    from mmspec.train.drafter import parameter_groups

    plain = EagleHead(text_decoder(llava.model).config)
    assert [g["lr_scale"] for g in parameter_groups(plain, 10.0)] == [1.0]
    head = with_vision_option(plain, K)
    groups = parameter_groups(head, 10.0)
    assert [g["lr_scale"] for g in groups] == [1.0, 10.0]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in head.vision.parameters()}
    assert sum(len(g["params"]) for g in groups) == len(list(head.parameters()))


# -- the vision option of the EAGLE-3 head -----------------------------------------------------------

def _vision_eagle3(model, seed: int = 0):
    """A vision-aware EAGLE-3 head, every weight random (the global projection too)."""
    from mmspec.modeling.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    head = with_vision_option(Eagle3Head(Eagle3Config.for_target(text_decoder(model).config)), K)
    torch.nn.init.normal_(head.vision.global_proj.weight, std=0.05)
    return head.eval()


def _states(model, inputs, ids, aux_layers):
    """The target's fused-layer states over ``ids`` [1, L] (the prompt's image included): [1, L, 3 H]."""
    from mmspec.core.target import select_hidden_states

    with torch.no_grad():
        out = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}, output_hidden_states=True)
    return select_hidden_states(out.hidden_states, tuple(aux_layers))


def test_eagle3_vision_head_saves_loads_and_is_not_exported(llava, tmp_path):
    from mmspec.modeling.eagle3 import Eagle3Head, VisionEagle3Head

    head = _vision_eagle3(llava.model)
    head.save(tmp_path / "head")
    loaded = Eagle3Head.load(tmp_path / "head", llava.model)
    assert type(loaded) is VisionEagle3Head and loaded.vision_tokens == K
    for name, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    plain = Eagle3Head(head.config)
    extended = with_vision_option(plain, K)
    assert all(torch.equal(v, extended.state_dict()[n]) for n, v in plain.state_dict().items())
    assert not extended.vision.global_proj.weight.any()  # g starts at zero
    with pytest.raises(ValueError, match="vision option.*without --vision-tokens"):
        head.export(tmp_path / "out", "vllm-eagle3")
    assert not (tmp_path / "out").exists()


def test_eagle3_vision_drafting_matches_the_training_unroll(llava):
    """The drafter's prefix keys (positions 0..k-1, pairs at k + t, the global feature added to
    every feature) give the feature the training-time test's step 0 gives for the same pairs."""
    from mmspec.drafters import Eagle3Drafter
    from mmspec.train.eagle3 import unroll

    model = llava.model.float()
    head = _vision_eagle3(model)
    target = TransformersTarget(model)
    drafter = Eagle3Drafter(model, head, num_draft_tokens=3)
    aux = tuple(head.config.aux_layers)
    state, prefill = target.prefill(dict(llava.inputs), hidden_layer=aux)
    state.tokens = torch.cat([state.tokens, prefill.logits[:, -1:].argmax(-1)], dim=1)
    drafter.start(DraftContext(target, SamplingConfig(), torch.Generator().manual_seed(0), llava.inputs), state)
    drafter.on_verified(0, 0, prefill)
    assert drafter.vision is not None and drafter.position_base == -K and not drafter._fusable()
    predicted = drafter._catch_up(state)  # [1, 1, H]: after the prompt's pairs

    ids, states = state.tokens, prefill.hidden_states  # [1, L + 1], [1, L, 3 H]
    padded_ids, padded = torch.cat([ids, ids[:, -1:]], dim=1), torch.cat([states, states[:, -1:]], dim=1)  # (one more pair)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        vision = head.vision_context(*image_features(ids[:, :-1], states, llava.image_token_id))
        (reference,) = unroll(head, embed, padded_ids, padded, 1, vision)
        (without,) = unroll(head, embed, padded_ids, padded, 1)
    torch.testing.assert_close(predicted[:, 0], reference[:, states.shape[1] - 1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(predicted[:, 0], without[:, states.shape[1] - 1], atol=1e-3)  # the image context is read


def test_eagle3_vision_loss_trains_the_adaptor(llava):
    from mmspec.modeling.eagle3 import Eagle3Head
    from mmspec.train.drafter import vision_image_token
    from mmspec.train.eagle3 import collate_ids, eagle3_loss

    model = llava.model.float()
    head = with_vision_option(_vision_eagle3(model), K).train()
    with torch.no_grad():
        ids = model.generate(**llava.inputs, max_new_tokens=12, do_sample=False)[0]
    learn = torch.zeros(len(ids), dtype=torch.bool)
    learn[llava.inputs["input_ids"].shape[1]:] = True
    batch = collate_ids([{"ids": ids, "learn": learn}] * 2)
    states = _states(model, llava.inputs, ids[None], head.config.aux_layers).expand(2, -1, -1)
    token = vision_image_token(head, model)
    assert token == llava.image_token_id and vision_image_token(Eagle3Head(head.config), model) is None
    vision = head.vision_context(*image_features(batch["ids"], states, token))
    loss, _ = eagle3_loss(head, model.get_input_embeddings().weight.detach(), batch, states, 2, vision)
    loss.backward()
    for name in ("vision.queries", "vision.attention.in_proj_weight", "vision.global_proj.weight", "fc.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name

