"""Bad inputs and unsupported combinations raise errors that say what to do."""

import pytest
import torch
from tiny_models import make_text_only_draft, make_tiny
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import mmspec


@pytest.fixture(scope="module")
def llama():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def llava():
    return make_tiny("llava")


@pytest.mark.parametrize(
    "inputs,match",
    [
        ({}, "input_ids"),
        ({"input_ids": torch.zeros((1, 0), dtype=torch.long)}, "empty"),
        ({"input_ids": torch.tensor([1, 2, 3])}, "2-D"),
        ({"input_ids": torch.tensor([[1.0, 2.0]])}, "integer"),
        ({"input_ids": torch.tensor([[0, 1, 2]]), "attention_mask": torch.tensor([[0, 1, 1]])}, "padded"),
    ],
)
def test_bad_prompts(llama, inputs, match):
    with pytest.raises(ValueError, match=match):
        mmspec.generate(llama.model, **inputs)


def test_pixels_on_text_model(llama):
    with pytest.raises(ValueError, match="text-only"):
        mmspec.generate(llama.model, input_ids=llama.inputs["input_ids"], pixel_values=torch.zeros(1, 3, 16, 16))


def test_vlm_image_tokens_without_pixels(llava):
    with pytest.raises(ValueError, match="no pixel_values"):
        mmspec.generate(llava.model, input_ids=llava.inputs["input_ids"])


def test_vlm_pixels_without_image_tokens(llava):
    text_only = llava.inputs["input_ids"][:, llava.inputs["input_ids"][0] != llava.image_token_id]
    with pytest.raises(ValueError, match="no image tokens"):
        mmspec.generate(llava.model, input_ids=text_only, pixel_values=llava.inputs["pixel_values"])


@pytest.mark.parametrize(
    "drafter,match",
    [("medusa-of-nothing", "unknown drafter"), ("layer-skip", "number of layers"), ("layer-skip:2", "1 <= N < 2"), (3, "drafter must be")],
)
def test_bad_drafters(llama, drafter, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mmspec.generate(llama.model, drafter=drafter, **llama.inputs)


def test_draft_with_larger_vocabulary(llama):
    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        mmspec.generate(llama.model, drafter=big, **llama.inputs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"acceptance": "typical"}, "needs do_sample=True"),
        ({"acceptance": "greedy", "do_sample": True}, "would not sample"),
        ({"acceptance": "best"}, "unknown acceptance"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"seed": "x"}, r"seed must be an integer or None, got 'x' \(str\)"),  # issue 44: a TypeError deep inside
        ({"seed": 2**64, "do_sample": True}, r"seed must be between 0 and 2\*\*63 - 1"),  # not torch's "Overflow ..."
        ({"seed": -1}, r"seed must be between 0 and 2\*\*63 - 1, got -1"),  # as the CLI's --seed
        ({"do_sample": True, "temperature": "hot"}, r"temperature must be a number, got 'hot' \(str\)"),
        ({"on_step": 5}, r"on_step must be a function or None, got 5 \(int\)"),  # (failed after the prefill)
    ],
)
def test_bad_settings(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mmspec.generate(llama.model, drafter="prompt-lookup", **kwargs, **llama.inputs)


def test_a_model_name_or_other_object_is_not_a_model():
    """The stop-74 audit: a name gave AttributeError: 'str' object has no attribute 'config'."""
    with pytest.raises(TypeError, match=r"generate takes a loaded model, not the name 'smollm2': .*load_causal_lm\('smollm2'\)"):
        mmspec.generate("smollm2", input_ids=torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="generate takes a transformers model or an mmspec Target, got int"):
        mmspec.generate(5, input_ids=torch.tensor([[1, 2]]))


def test_encoder_decoder_rejected():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="encoder-decoder"):
        mmspec.generate(t5, input_ids=torch.tensor([[1, 2]]))


def test_unsupported_multimodal_family():
    """A multimodal family outside VLM_FAMILIES (PaliGemma: a bidirectional prefix) is refused in one line."""
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    config = PaliGemmaConfig(
        text_config=GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         image_size=16, patch_size=8),
        image_token_index=63,
    )
    with pytest.raises(ValueError, match="multimodal family mmspec does not support yet"):
        mmspec.generate(PaliGemmaForConditionalGeneration(config), input_ids=torch.tensor([[1, 2]]))


def test_typical_acceptance_runs_and_is_marked(llama):
    out = mmspec.generate(llama.model, drafter=make_text_only_draft(llama.vocab_size), acceptance="typical",
                          do_sample=True, seed=0, max_new_tokens=8, **llama.inputs)
    assert out.stats.config["acceptance"] == "typical" and out.stats.new_tokens == 8


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_token_ids_outside_the_vocabulary(llama, bad_id):
    ids = llama.inputs["input_ids"].clone()
    ids[0, 1] = bad_id
    with pytest.raises(ValueError, match=f"token id {bad_id}, outside the model's vocabulary"):
        mmspec.generate(llama.model, input_ids=ids)


def test_attention_mask_of_another_length(llama):
    ids = llama.inputs["input_ids"]
    with pytest.raises(ValueError, match="attention_mask has shape"):
        mmspec.generate(llama.model, input_ids=ids, attention_mask=torch.ones(1, ids.shape[1] - 1, dtype=torch.long))


@pytest.mark.parametrize("value", [2.5, "8", True, None])
def test_max_new_tokens_must_be_an_integer(llama, value):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        mmspec.generate(llama.model, max_new_tokens=value, **llama.inputs)


def test_integer_like_max_new_tokens_still_work(llama):
    import numpy as np

    for value in (np.int64(3), torch.tensor(3)):
        assert mmspec.generate(llama.model, max_new_tokens=value, **llama.inputs).stats.new_tokens == 3


def test_numpy_seeds_and_flags_are_their_python_values(llama):
    """The stop-78 audit: seed=np.int64(0) failed in torch.Generator ("an integer is required"),
    do_sample=np.bool_(True) was refused."""
    import numpy as np

    plain = mmspec.generate(llama.model, do_sample=True, seed=5, max_new_tokens=6, **llama.inputs)
    numpy = mmspec.generate(llama.model, do_sample=np.bool_(True), seed=np.int64(5), max_new_tokens=6,
                            temperature=np.float32(1.0), **llama.inputs)
    assert torch.equal(plain.sequences, numpy.sequences) and type(numpy.stats.config["seed"]) is int


def test_submodules_are_attributes_of_a_fresh_import():
    """``import mmspec; mmspec.hub.load_causal_lm(...)``, as the docs and generate's own refusal say,
    raised AttributeError in a fresh interpreter (the lazy package, stop 77)."""
    import subprocess
    import sys

    code = "import mmspec; print(mmspec.hub.load_causal_lm.__name__, mmspec.adapters.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["load_causal_lm", "mmspec.adapters"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_token": 4}, "unknown argument 'max_new_token'.*did you mean 'max_new_tokens'"),
        ({"num_beams": 2}, "unknown argument 'num_beams'"),
        ({"past_key_values": None}, "managed by mmspec"),
    ],
)
def test_unknown_keyword_arguments(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mmspec.generate(llama.model, **kwargs, **llama.inputs)


def test_model_inputs_of_a_vlm_are_accepted(llava):
    out = mmspec.generate(llava.model, max_new_tokens=2, vision_feature_layer=-1, **llava.inputs)
    assert out.stats.new_tokens == 2


def test_prompt_longer_than_the_context(llama):
    context = llama.model.config.max_position_embeddings
    long_ids = llama.inputs["input_ids"][:, :1].repeat(1, context + 1)
    with pytest.raises(ValueError, match=f"more than .*context of {context}"):
        mmspec.generate(llama.model, input_ids=long_ids)
    with pytest.warns(UserWarning, match="exceeds the model's context"):
        mmspec.generate(llama.model, input_ids=long_ids[:, : context - 1], max_new_tokens=3)


def test_training_mode_is_off_for_the_call_and_restored(llama):
    reference = mmspec.generate(llama.model, drafter="prompt-lookup", max_new_tokens=8, **llama.inputs).sequences
    for module in llama.model.modules():  # dropout that would change every forward in training mode
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.9
    llama.model.train()
    llama.model.lm_head.eval()  # a mixed state, to be restored module by module
    try:
        out = mmspec.generate(llama.model, drafter="prompt-lookup", max_new_tokens=8, **llama.inputs)
        assert torch.equal(out.sequences, reference)
        assert llama.model.training and llama.model.model.training and not llama.model.lm_head.training
    finally:
        llama.model.eval()
        for module in llama.model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.0


@pytest.mark.parametrize("device,match", [("bogus", "unknown device 'bogus'"), ("meta", "not supported")])
def test_devices_that_do_not_exist(device, match):
    from mmspec.hub import load_causal_lm, resolve_device

    with pytest.raises(ValueError, match=match):
        resolve_device(device)
    with pytest.raises(ValueError, match=match):
        load_causal_lm("/nonexistent/model", device=device)
    with pytest.raises(ValueError, match=match):
        mmspec.pipeline("image-captioning", model="/nonexistent/model", device=device)


@pytest.mark.parametrize("value", ["False", None, 1])
def test_load_causal_lm_takes_trust_remote_code_as_a_bool_only(value):
    """trust_remote_code="False" (a string) read as True would run a checkpoint's code; None made
    transformers ask on the terminal. Refused before anything loads."""
    from mmspec.hub import load_causal_lm

    with pytest.raises(ValueError, match=r"^trust_remote_code must be True or False, got "):
        load_causal_lm("/nonexistent/model", trust_remote_code=value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_says_what_to_pass():
    from mmspec.hub import resolve_device

    with pytest.raises(ValueError, match="not available on this machine.*use cpu, or auto"):
        resolve_device("cuda")


def test_batched_seeds_of_another_type(llama):
    from mmspec.api import generate_rows

    rows = [{"input_ids": llama.inputs["input_ids"]}] * 2
    with pytest.raises(ValueError, match=r"seed must be an integer or None, got 'x' \(str\)"):
        generate_rows(llama.model, rows, seed=[0, "x"])


def test_weights_trained_for_another_model_are_one_line(tmp_path):
    """A head whose saved tensors do not fit the module built for this model (a head trained for
    another one): one ValueError line naming the file, not torch's many-line state_dict report."""
    from safetensors.torch import save_file

    from mmspec.modeling.persistence import load_weights

    save_file(torch.nn.Linear(2, 3).state_dict(), str(tmp_path / "head.safetensors"))
    with pytest.raises(ValueError, match=r"head.safetensors do not fit the Linear .*trained for another model\?\): size mismatch") as error:
        load_weights(torch.nn.Linear(2, 4), tmp_path, "head.safetensors")
    assert "\n" not in str(error.value)


def test_a_checkpoint_without_a_tokenizer_is_one_line_before_its_weights_load(tmp_path, monkeypatch):
    """transformers' five lines about sentencepiece / tiktoken, after the weights loaded."""
    import transformers

    from mmspec.hub import load_causal_lm

    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(tmp_path)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"has no tokenizer transformers can load \(.*\): put the tokenizer the model was "
                                         r"trained with \(tokenizer.json, tokenizer_config.json\) beside its config.json"):
        load_causal_lm(tmp_path, dtype="fp32")


def test_a_causal_lm_directory_named_as_a_trained_head_is_told_to_be_a_draft_model(tmp_path):
    """eagle:DIR with a plain causal LM pointed at eagle3 (whose engine layout has the same file
    names), which then refused it; an SJD init that does not exist was found after the load."""
    from mmspec.pipelines.captioning.methods import check_drafter_name

    make_tiny("llama").model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds no eagle drafter \(eagle_config.json missing\); it holds what spd reads"):
        check_drafter_name(f"eagle:{tmp_path}")
    with pytest.raises(ValueError, match="unknown SJD init 'bogus'"):
        check_drafter_name("sjd:bogus", auto=False)


@pytest.mark.parametrize("kwargs,match", [({"temperature": 0.5}, "temperature applies only when sampling"),
                                          ({"top_k": 5, "top_p": 0.9}, "top_k, top_p apply only when sampling")])
def test_sampling_options_with_greedy_decoding_are_warned_about(llama, kwargs, match):
    """Greedy decoding ignored them without a word (the CLI refuses them without --do-sample;
    transformers' generate warns, and so does mmspec.generate), at the caller's line."""
    with pytest.warns(UserWarning, match=match + ", and do_sample is False: greedy decoding ignores it") as record:
        mmspec.generate(llama.model, drafter="prompt-lookup", max_new_tokens=4, **kwargs, **llama.inputs)
    assert record[0].filename == __file__
