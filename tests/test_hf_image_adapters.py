"""transformers' text-to-image families (Janus, Emu3, Chameleon/Anole) behind the image-target
interface, on tiny random models: cached forward == full forward over image codes (Emu3 with its
end-of-line tokens), guided logits == CFG of two independent sequences (padded prompts), greedy SJD
== AR == the families' own generate(), sampling within the codebook, VQ tokenizers' shapes."""

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from transformers import (
    ChameleonConfig,
    ChameleonForConditionalGeneration,
    Emu3Config,
    Emu3ForConditionalGeneration,
    Emu3TextConfig,
    JanusConfig,
    JanusForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

import mmspec
from mmspec.adapters.image import image_target_for, image_tokenizer_for
from mmspec.adapters.image.chameleon import ChameleonVQDecoder
from mmspec.adapters.image.emu3 import Emu3State
from mmspec.core.loop import speculative_decode
from mmspec.core.sampling import SamplingConfig, cfg_combine
from mmspec.core.tree import TokenTree

torch.set_num_threads(1)

HIDDEN, CODES, GUIDANCE = 32, 16, 3.0
JANUS_BOI, JANUS_PAD = 3, 0
EMU3_EOL, EMU3_BOI, EMU3_WRAPPER, EMU3_CODE0, EMU3_GRID = 4, 5, 6, 40, (3, 2)
CHAMELEON_BOI, CHAMELEON_CODE0 = 5, 30
CHAMELEON_IDS = [CHAMELEON_CODE0 + CODES - 1 - c for c in range(CODES)]  # code -> token id, decreasing (gathered head)


def sharpen(model, head, scale: float = 3.0):
    """O(1) activations (weights at 1/sqrt(fan_in) outside the VQ model) and a sharper head, so the
    tiny models' distributions are peaked and vary with the input."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if "vqmodel" in name:
                continue
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0, 1.0)
        head.weight.mul_(scale)
    return model.eval()


def tiny_janus():
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, pad_token_id=JANUS_PAD,
                       eos_token_id=2)
    vision = JanusVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=8, patch_size=4, num_image_tokens=4, projection_dim=HIDDEN)  # 2 x 2 grid
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=CODES, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                          num_res_blocks=1, projection_dim=HIDDEN, image_token_embed_dim=HIDDEN)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=5)
    model = JanusForConditionalGeneration(config)
    model.generation_config.generation_kwargs = {"boi_token_id": JANUS_BOI}
    return sharpen(model, model.model.generation_head.vision_head)


def tiny_emu3():
    torch.manual_seed(0)
    special = {"<pad>": 0, "<|extra_203|>": 1, "<|extra_204|>": 2, "<image>": 3, "<|extra_200|>": EMU3_EOL,
               "<|image start|>": EMU3_BOI, "<|image token|>": EMU3_WRAPPER, "<|extra_201|>": 7, "<|image end|>": 8}
    vocab = {**{f"tok{i}": i for i in range(9, EMU3_CODE0)}, **special,
             **{f"<|visual token {c:06d}|>": EMU3_CODE0 + c for c in range(CODES)}}
    text = Emu3TextConfig(vocab_size=EMU3_CODE0 + CODES, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
    vq = dict(codebook_size=CODES, embed_dim=4, latent_channels=4, temporal_downsample_factor=1, base_channels=32,
              channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], hidden_size=32)
    model = Emu3ForConditionalGeneration(Emu3Config(text_config=text, vq_config=vq, vocabulary_map=vocab))
    return sharpen(model, model.lm_head)


def tiny_chameleon():
    torch.manual_seed(0)
    letters = lambda code: "".join(chr(ord("A") + int(d)) for d in str(code))  # noqa: E731 (Chameleon's IMGIMG naming)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<image>": 4, "<racm3:break>": CHAMELEON_BOI, "<eoss>": 6,
             **{f"tok{i}": i for i in range(7, CHAMELEON_CODE0)},
             **{f"IMGIMG{letters(c)}Z": CHAMELEON_IDS[c] for c in range(CODES)}}
    vq = dict(embed_dim=8, num_embeddings=CODES, latent_channels=32, resolution=8, base_channels=32,
              channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[])  # 4 x 4 grid
    config = ChameleonConfig(vocab_size=CHAMELEON_CODE0 + CODES, hidden_size=HIDDEN, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=3, vq_config=vq, vocabulary_map=vocab)
    model = ChameleonForConditionalGeneration(config)
    return sharpen(model, model.lm_head)


# ---- reference: one full forward over [prompt, codes] -> logits over the codes [n + 1, V] --------
def janus_full(model, prompt, codes):
    embeds = torch.cat([model.get_input_embeddings()(torch.tensor([prompt])),
                        model.prepare_embeddings_for_image_generation(torch.tensor([codes], dtype=torch.long))], dim=1)
    hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
    return model.model.generation_head(hidden)[0, len(prompt) - 1 :]


def emu3_full(model, prompt, codes):
    stream, read = list(prompt), [len(prompt) - 1]
    for j, code in enumerate(codes):
        stream.append(EMU3_CODE0 + code)
        if (j + 1) % EMU3_GRID[1] == 0:
            stream.append(EMU3_EOL)  # Emu3's row format: the end-of-line token after every row
        read.append(len(stream) - 1)
    return model(input_ids=torch.tensor([stream])).logits[0, read, EMU3_CODE0 : EMU3_CODE0 + CODES]


def chameleon_full(model, prompt, codes):
    stream = torch.tensor([prompt + [CHAMELEON_IDS[c] for c in codes]])
    hidden = model.model(input_ids=stream).last_hidden_state  # (the model's forward masks image tokens out)
    return model.lm_head(hidden)[0, len(prompt) - 1 :, CHAMELEON_IDS]


@dataclass
class Family:
    build: Callable
    full: Callable
    prompt: list[int]  # what the target is given
    cond: list[int]  # the conditional sequence the model sees
    uncond: list[int]  # the official unconditional sequence
    target_kwargs: dict = field(default_factory=dict)
    extra_inputs: dict = field(default_factory=dict)


EMU3_PROMPT = [1, 10, 11, 12, EMU3_BOI, 20, 21, EMU3_WRAPPER]  # BOS text <|image start|>h*w<|image token|>
EMU3_NEGATIVE = [1, 13, 14, 15, 16, 17, EMU3_BOI, 20, 21, EMU3_WRAPPER]  # longer: the conditional row gets padded
FAMILIES = {
    "janus": Family(tiny_janus, janus_full, [1, 10, 11, 12], [1, 10, 11, 12, JANUS_BOI],
                    [1, JANUS_PAD, JANUS_PAD, JANUS_PAD, JANUS_BOI]),
    "emu3": Family(tiny_emu3, emu3_full, EMU3_PROMPT, EMU3_PROMPT, [1, EMU3_BOI, 20, 21, EMU3_WRAPPER],
                   target_kwargs={"grid": EMU3_GRID}),
    "emu3-negative": Family(tiny_emu3, emu3_full, EMU3_PROMPT, EMU3_PROMPT, EMU3_NEGATIVE, target_kwargs={"grid": EMU3_GRID},
                            extra_inputs={"negative_input_ids": torch.tensor([EMU3_NEGATIVE])}),
    "chameleon": Family(tiny_chameleon, chameleon_full, [1, 10, 11, 12], [1, 10, 11, 12, CHAMELEON_BOI], [1, CHAMELEON_BOI]),
}
_models = {}


def setup(name):
    family = FAMILIES[name]
    if family.build not in _models:
        _models[family.build] = family.build()
    model = _models[family.build]
    return family, model, image_target_for(model, **family.target_kwargs)


def inputs(family, guidance_scale):
    return {"input_ids": torch.tensor([family.prompt]), "guidance_scale": guidance_scale, **family.extra_inputs}


def generate(name, drafter, guidance_scale, do_sample=False, seed=0):
    family, _, target = setup(name)
    return mmspec.generate(target, drafter=drafter, max_new_tokens=target.num_image_tokens, do_sample=do_sample, seed=seed,
                           num_draft_tokens=3, **inputs(family, guidance_scale))


CODES_IN = [7, 3, 12, 0, 5]  # crosses Emu3's row ends (2 codes per row)


@pytest.mark.parametrize("name", ["janus", "emu3", "chameleon"])
def test_cached_forward_matches_full_forward(name):
    family, model, target = setup(name)
    with torch.no_grad():
        full = family.full(model, family.cond, CODES_IN)
        state, first = target.prefill(inputs(family, None))
        step = target.forward(state, torch.tensor([CODES_IN[:3]]))
        rest = target.forward(state, torch.tensor([CODES_IN[3:]]))
    assert first.logits.shape == (1, 1, CODES)
    torch.testing.assert_close(first.logits[0, 0], full[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.logits[0], full[1:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest.logits[0], full[4:6], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["janus", "emu3", "emu3-negative", "chameleon"])
def test_guided_logits_are_cfg_of_independent_sequences(name):
    family, model, target = setup(name)
    with torch.no_grad():
        cond = family.full(model, family.cond, CODES_IN[:3])
        uncond = family.full(model, family.uncond, CODES_IN[:3])
        state, first = target.prefill(inputs(family, GUIDANCE))
        step = target.forward(state, torch.tensor([CODES_IN[:3]]))
    expected = cfg_combine(cond, uncond, GUIDANCE)
    assert state.cache.layers[0].keys.shape[0] == 2  # both halves in one cache
    torch.testing.assert_close(torch.cat([first.logits, step.logits], dim=1)[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["janus", "chameleon", "emu3"])
def test_chain_tree_forward_matches_linear_forward(name):
    family, _, target = setup(name)
    chain = TokenTree.chain(torch.tensor(CODES_IN[:3]))
    with torch.no_grad():
        state, _ = target.prefill(inputs(family, GUIDANCE))
        linear = target.forward(state, torch.tensor([CODES_IN[:3]]))
        state, _ = target.prefill(inputs(family, GUIDANCE))
        if name == "emu3":
            with pytest.raises(ValueError, match="not implemented for Emu3"):
                target.forward(state, chain.tokens[None], tree=chain)
            return
        tree = target.forward(state, chain.tokens[None], tree=chain)
    torch.testing.assert_close(tree.logits, linear.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("guidance_scale", [GUIDANCE, None])
@pytest.mark.parametrize("name", ["janus", "emu3", "emu3-negative", "chameleon"])
def test_greedy_sjd_equals_ar(name, guidance_scale):
    ar = generate(name, None, guidance_scale)
    assert ar.stats.new_tokens == setup(name)[2].num_image_tokens
    for drafter in ("sjd:random", "sjd-coupled:vertical"):
        out = generate(name, drafter, guidance_scale)
        assert torch.equal(out.sequences, ar.sequences), drafter


def test_janus_matches_its_own_generate():
    family, model, _ = setup("janus")
    ours = generate("janus", "sjd:random", GUIDANCE).sequences[0, len(family.cond) :]
    ids = torch.tensor([family.cond])
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="image", do_sample=False,
                               guidance_scale=GUIDANCE, max_new_tokens=4)
    assert ours.tolist() == reference[0].tolist()


@pytest.mark.parametrize("name", ["emu3", "emu3-negative"])
def test_emu3_matches_its_own_generate_with_end_of_line_tokens(name):
    """Emu3's documented recipe: prefix_allowed_tokens_fn forcing the row format and a negative
    prompt through transformers' unbatched CFG."""
    family, model, _ = setup(name)
    rows, columns = EMU3_GRID

    def allowed(batch_id, input_ids):
        offset = input_ids.shape[0] - int(torch.nonzero(input_ids == EMU3_WRAPPER)[0, 0])
        return [EMU3_EOL] if offset % (columns + 1) == 0 else list(range(EMU3_CODE0, EMU3_CODE0 + CODES))

    ids = torch.tensor([family.prompt])
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, guidance_scale=GUIDANCE,
                               negative_prompt_ids=torch.tensor([family.uncond]), prefix_allowed_tokens_fn=allowed,
                               max_new_tokens=rows * (columns + 1), pad_token_id=0)[0, ids.shape[1] :]
    is_eol = [(i + 1) % (columns + 1) == 0 for i in range(reference.shape[0])]
    assert [t == EMU3_EOL for t in reference.tolist()] == is_eol  # the reference kept the row format
    codes = [c - EMU3_CODE0 for c in reference.tolist() if c != EMU3_EOL]
    for drafter in (None, "sjd:vertical"):
        assert generate(name, drafter, GUIDANCE).sequences[0, ids.shape[1] :].tolist() == codes


def test_emu3_cache_holds_codes_and_end_of_line_tokens():
    family, _, target = setup("emu3")
    state, stats = speculative_decode(target, inputs(family, GUIDANCE), None, SamplingConfig(), target.num_image_tokens)
    assert isinstance(state, Emu3State) and stats.new_tokens == 6
    # 5 cached codes (all but the pending one) + 2 end-of-line tokens after the 2 full rows among them
    assert state.cache_length == len(EMU3_PROMPT) + 5 + 2 == state.cache_entries(state.length)
    state.rollback(state.prompt_length + 3)
    assert state.cache_length == len(EMU3_PROMPT) + 2 + 1


@pytest.mark.parametrize("name", ["janus", "emu3", "chameleon"])
def test_sampling_returns_grid_many_codes(name):
    family, _, target = setup(name)
    for drafter in (None, "sjd-coupled:vertical"):
        out = generate(name, drafter, GUIDANCE, do_sample=True, seed=1)
        codes = out.sequences[0, len(family.cond) :]
        assert codes.shape[0] == target.num_image_tokens == out.stats.new_tokens
        assert int(codes.min()) >= 0 and int(codes.max()) < target.vocab_size == CODES


@pytest.mark.parametrize("name", ["janus", "emu3", "chameleon"])
def test_tokenizer_decodes_generated_codes(name):
    family, model, target = setup(name)
    kwargs = {"grid": EMU3_GRID} if name == "emu3" else {}
    if name == "chameleon":
        with pytest.raises(ValueError, match="no decoder"):
            image_tokenizer_for(model).decode(torch.zeros(1, 16, dtype=torch.long))
        torch.manual_seed(0)
        kwargs = {"decoder": ChameleonVQDecoder(model.config.vq_config).eval()}
    tokenizer = image_tokenizer_for(model, **kwargs)
    assert tokenizer.grid == target.grid and tokenizer.vocab_size == target.vocab_size
    assert tokenizer.codebook_embeddings().shape[0] == CODES
    codes = generate(name, None, GUIDANCE).sequences[:, len(family.cond) :]
    rows, columns = tokenizer.grid
    with torch.no_grad():
        image = tokenizer.decode(codes)
        assert image.shape == (1, 3, 2 * rows, 2 * columns)  # the tiny VQs downsample by 2
        again = tokenizer.encode(image.clamp(-1, 1))
    assert again.shape == (1, rows * columns) and int(again.max()) < CODES


def test_unsupported_models_raise():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    for factory in (image_target_for, image_tokenizer_for):
        with pytest.raises(ValueError, match="supported: Janus .* Emu3 .* Chameleon"):
            factory(llama)
    with pytest.raises(ValueError, match="VQ model"):
        image_target_for(setup("janus")[1].model.vqmodel)


def test_prompt_errors():
    family, _, emu3 = setup("emu3")
    with pytest.raises(ValueError, match="must end with Emu3's image prefix"):
        emu3.prefill({"input_ids": torch.tensor([[1, 10, 11]]), "guidance_scale": None})
    with pytest.raises(ValueError, match="differ from the target's grid"):
        emu3.prefill({**inputs(family, None), "image_sizes": torch.tensor([[4, 4]])})
    # the prompt and the image's positions (Emu3's 3 x 2 codes and an end of line a row: 9) within the model's 128
    fits = [1] + [10] * (128 - 9 - 5) + [EMU3_BOI, 20, 21, EMU3_WRAPPER]
    emu3.prefill({"input_ids": torch.tensor([fits]), "guidance_scale": None})
    with pytest.raises(ValueError, match="a prompt of 120 tokens and the image's 9 positions exceed the model's 128: "
                                         "shorten the prompt to at most 119 tokens"):
        emu3.prefill({"input_ids": torch.tensor([[1, 10, *fits[1:]]]), "guidance_scale": None})
    big = image_target_for(emu3.model, grid=(12, 12))  # 12 rows of 12 codes and an end of line: 156 positions > 128
    with pytest.raises(ValueError, match=r"the image's 156 positions \(12 x 12 codes\) leave no room for a prompt in the "
                                         r"model's 128: generate a smaller image"):  # (was "... to at most 0 tokens")
        big.prefill({"input_ids": torch.tensor([fits]), "guidance_scale": None})
    chameleon = setup("chameleon")[2]
    with pytest.raises(ValueError, match="input images"):
        chameleon.prefill({"input_ids": torch.tensor([[1, 10, 4, 11]]), "guidance_scale": GUIDANCE})


@pytest.mark.parametrize("name", ["janus", "emu3", "chameleon"])
def test_unknown_keywords_are_refused_before_the_prefill(name):
    family, _, target = setup(name)
    with pytest.raises(ValueError, match="unknown argument 'guidance'.*did you mean 'guidance_scale'"):
        mmspec.generate(target, max_new_tokens=2, guidance=3.0, **inputs(family, None))
    for name in ("past_key_values", "cache"):  # (transformers 5.x's name for the KV cache, and its old one)
        with pytest.raises(ValueError, match=f"{name} is managed by mmspec"):
            mmspec.generate(target, max_new_tokens=2, **{name: None}, **inputs(family, None))


@pytest.mark.parametrize("name", ["janus", "chameleon"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_batched_rows_equal_batch_one(name, do_sample, monkeypatch):
    """Batches of a transformers image family (the unconditional row's shorter prompt padded per
    cache row): each row equals its batch-1 generation, for AR and SJD, with the cache squeezed."""
    from mmspec.api import generate_rows
    from mmspec.core.batch import BatchState
    from mmspec.drafters import JacobiDrafter

    monkeypatch.setattr(BatchState, "slack", 1)
    family, _, target = setup(name)
    prompts = [family.prompt, family.prompt[:2] + [13, 14, 15], family.prompt[:3]]
    rows = [{"input_ids": torch.tensor([p]), "guidance_scale": GUIDANCE} for p in prompts]
    for drafter in (None, JacobiDrafter(3)):
        options = dict(max_new_tokens=target.num_image_tokens, do_sample=do_sample, temperature=1.3)
        batch = generate_rows(target, rows, drafter=drafter, seed=[4, 5, 6], **options)
        for b, row in enumerate(rows):
            single = mmspec.generate(target, drafter=drafter, seed=4 + b, **options, **row)
            assert torch.equal(batch.sequences[b, -target.num_image_tokens :], single.sequences[0, -target.num_image_tokens :])


def test_emu3_says_it_needs_batch_size_one():
    from mmspec.api import generate_rows

    family, _, target = setup("emu3")
    with pytest.raises(ValueError, match="end-of-line token"):
        generate_rows(target, [inputs(family, GUIDANCE)] * 2, max_new_tokens=4)
