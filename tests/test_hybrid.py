"""Hybrid recurrent targets: Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + full attention; text models
and the multimodal classes, whose prompts take 3-D M-RoPE positions), LFM2, LFM2-MoE and LFM2-VL
(short convolutions + full attention), tiny random configs built here, fp32, one thread.

Ladder levels 2 (sampled distribution), 4 (greedy == transformers' generate with every chain
drafter), 5 (self draft accepts everything) and 6 (rollback to every accepted length == a fresh
prefill of that prefix, every layer's state compared), batches (rows = batch-1 rows, each row's
recurrent state rewound to its own accepted length; rows joining and leaving), the refusal of
trees and the bound on what the state history holds.
"""

import pytest
import torch
from test_batch import _near_copy
from distribution_check import exact_marginals, extended, pvalue, sampled_counts
from transformers import (Lfm2Config, Lfm2ForCausalLM, Lfm2VlConfig, Lfm2VlForConditionalGeneration, Qwen3_5ForCausalLM,
                          Qwen3_5TextConfig)

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.api import generate_rows
from mmspec.adapters.recurrent import RecurrentLayer, held_bytes
from mmspec.core.cache import PreallocatedLayer, crop_cache
from mmspec.core.sampling import SamplingConfig
from mmspec.drafters import ModelDrafter

K = 4
MAX_NEW = 1 + 3 * (K + 1)
IMAGE_TOKEN = 60


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The depthwise convolutions of these models wait on OpenMP barriers that cost tens of ms on a
    shared 2-core machine; one thread keeps the file fast (and results do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _finish(model, seed):
    """Sharper, more varied next-token distributions than a random init gives (so drafts are both
    accepted and rejected), no EOS."""
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn_like(head) * 0.5)
    model.generation_config.eos_token_id = None
    return model.eval()


def tiny_qwen3_5(seed=0, vocab=64, layers=8):
    """Qwen3.5's layout: every 4th layer full attention, the others Gated DeltaNet (2 layers: one of each)."""
    torch.manual_seed(seed)
    types = ["linear_attention", "full_attention"] if layers == 2 else None
    config = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, layer_types=types,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8,
                               linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                               max_position_embeddings=128, tie_word_embeddings=False,
                               initializer_range=0.1)  # (at the default 0.02 a wrong recurrent state rarely moves an argmax)
    return _finish(Qwen3_5ForCausalLM(config), seed)


def tiny_qwen3_5_moe(seed=0, vocab=64):
    """Qwen3.5-MoE's text model: the same Gated DeltaNet / attention layout, sparse MLPs."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                                  linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1)
    return _finish(Qwen3_5MoeForCausalLM(config), seed)


def tiny_lfm2_moe(seed=0, vocab=64):
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    text = {k: v for k, v in _lfm2_text(vocab).items() if k != "full_attn_idxs"}
    config = Lfm2MoeConfig(**text, moe_intermediate_size=32, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                           layer_types=["conv", "full_attention", "conv", "full_attention"])
    return _finish(Lfm2MoeForCausalLM(config), seed)


def _lfm2_text(vocab):
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, full_attn_idxs=[1, 3], max_position_embeddings=128, tie_word_embeddings=False,
                initializer_range=0.3)  # (the default init repeats one token after a few)


def tiny_lfm2(seed=0, vocab=64):
    torch.manual_seed(seed)
    return _finish(Lfm2ForCausalLM(Lfm2Config(**_lfm2_text(vocab))), seed)


def tiny_lfm2_vl(seed=0):
    torch.manual_seed(seed)
    config = Lfm2VlConfig(
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, patch_size=4, num_patches=16, num_channels=3),
        text_config=dict(model_type="lfm2", **_lfm2_text(64)), image_token_id=IMAGE_TOKEN, projector_hidden_size=32,
        downsample_factor=2, tie_word_embeddings=False)
    return _finish(Lfm2VlForConditionalGeneration(config), seed)


def tiny_qwen3_5_vl(seed=0, moe=False):
    """Qwen3.5's multimodal class (``Qwen3_5ForConditionalGeneration``, or the MoE one) over a 4-layer
    hybrid decoder (Gated DeltaNet, attention, Gated DeltaNet, attention) and a tiny Qwen3-VL-style
    vision tower (tests/tiny_mrope.py's ids and patch sizes); M-RoPE on half of each head
    (partial_rotary_factor 0.5: 4 rotary pairs split t, h, w = 2, 1, 1), attention sharpened so
    that a wrong position changes the greedy output."""
    from tiny_models import _finalize
    from tiny_mrope import _IDS, _VISION, _text, sharpen_attention
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(_text([2, 1, 1]), hidden_size=32, intermediate_size=64, num_hidden_layers=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.1,
                layer_types=["linear_attention", "full_attention"] * 2)
    text["rope_parameters"]["partial_rotary_factor"] = 0.5
    if moe:
        text.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    vision = dict(_VISION, depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16)
    config_class, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                                 else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    model = model_class(config_class(text_config=text, vision_config=vision, **_IDS))
    model = sharpen_attention(_finalize(_finish(model, seed)))
    return model


def qwen3_5_vl_inputs():
    """A Qwen processor's layout: text, an image of 1 x 4 x 6 patches (6 placeholders), a video of
    two timestamped frames of 4 x 4 patches (4 placeholders each), text; ``mm_token_type_ids`` included."""
    from tiny_mrope import mrope_inputs

    return mrope_inputs(torch.Generator().manual_seed(100), video=True, timestamped_frames=True)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]


def inputs_of(family, prompt=PROMPT):
    if family.endswith("_vl") and family.startswith("qwen"):
        return qwen3_5_vl_inputs()
    ids = torch.tensor([prompt])
    if family != "lfm2_vl":
        return {"input_ids": ids}
    image = torch.full((1, 4), IMAGE_TOKEN)  # a 4x4-patch image, 2x2-downsampled: 4 image tokens
    gen = torch.Generator().manual_seed(3)
    return {"input_ids": torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1), "pixel_values": torch.randn(1, 16, 48, generator=gen),
            "spatial_shapes": torch.tensor([[4, 4]]), "pixel_attention_mask": torch.ones(1, 16, dtype=torch.bool)}


BUILD = {"qwen3_5": tiny_qwen3_5, "qwen3_5_moe": tiny_qwen3_5_moe, "qwen3_5_vl": tiny_qwen3_5_vl,
         "qwen3_5_moe_vl": lambda seed=0: tiny_qwen3_5_vl(seed, moe=True), "lfm2": tiny_lfm2, "lfm2_moe": tiny_lfm2_moe,
         "lfm2_vl": tiny_lfm2_vl}
#: past the first full-attention layer (layer-skip needs one)
SKIP_LAYERS = {"qwen3_5": 4, "qwen3_5_moe": 4, "qwen3_5_vl": 2, "qwen3_5_moe_vl": 2, "lfm2": 2, "lfm2_moe": 2, "lfm2_vl": 2}


@pytest.fixture(scope="module", params=list(BUILD))
def case(request):
    family = request.param
    model = BUILD[family](0)
    inputs = inputs_of(family)
    with torch.inference_mode():
        reference = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    return family, model, inputs, reference


def drafters(family, model):
    draft = BUILD[family](1)  # another random model of the family: a draft that is often rejected
    from mmspec.adapters.hf import text_decoder
    from mmspec.drafters import EagleDrafter, KangarooDrafter
    from mmspec.modeling.heads import EagleHead, KangarooAdapter

    specs = {"ar": None, "prompt-lookup": "prompt-lookup", "layer-skip": f"layer-skip:{SKIP_LAYERS[family]}",
             "draft model": ModelDrafter(draft, num_draft_tokens=K), "same model": ModelDrafter(model, num_draft_tokens=K)}
    if family.endswith("_vl"):  # a text-only hybrid draft over the same vocabulary (SPD: it sees the prompt without the image)
        vocab = model.get_output_embeddings().weight.shape[0]
        specs["text-only draft (SPD)"] = ModelDrafter((tiny_lfm2 if family == "lfm2_vl" else tiny_qwen3_5)(1, vocab=vocab),
                                                      num_draft_tokens=K)
    torch.manual_seed(3)
    config = text_decoder(model).config  # a head is one attention layer of the family (random weights here)
    specs["eagle"] = EagleDrafter(model, EagleHead(config).eval(), num_draft_tokens=K)
    # (Kangaroo normalises the shallow states with the decoder's final norm: LFM2's embedding_norm)
    specs["kangaroo"] = KangarooDrafter(model, KangarooAdapter(config).eval(), exit_layer=SKIP_LAYERS[family],
                                        num_draft_tokens=K, stop_threshold=0.0)
    return specs


def test_greedy_identical_to_transformers_with_every_chain_drafter(case):
    family, model, inputs, reference = case
    assert len(set(reference[0, -MAX_NEW:].tolist())) > 3  # not a degenerate repetition
    partial = 0
    for name, drafter in drafters(family, model).items():
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K, **inputs)
        assert torch.equal(out.sequences, reference), name
        if name == "text-only draft (SPD)":
            assert out.stats.config["sees_image"] is False
        partial += 0 < out.stats.accepted < out.stats.drafted
    assert partial  # some verification was cut inside its chain: a rollback replayed the recurrent state


def test_self_draft_accepts_everything(case):
    family, model, inputs, reference = case
    out = mmspec.generate(model, drafter=ModelDrafter(model, num_draft_tokens=K), max_new_tokens=MAX_NEW, **inputs)
    assert torch.equal(out.sequences, reference)
    assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length == K + 1


def _layer_states(cache):
    """Every layer's state: (keys, values) of attention layers, (conv window, recurrent state) of recurrent ones."""
    states = []
    for layer in cache.layers:
        if isinstance(layer, RecurrentLayer):
            states.append((layer.conv_states[0], layer.recurrent_states[0]))
        else:
            assert isinstance(layer, PreallocatedLayer)
            states.append((layer.keys, layer.values))
    return states


def test_rollback_to_every_accepted_length_equals_a_fresh_prefill(case):
    """Verify a chain of K + 1 tokens, roll back to every length the loop can keep (0 .. K + 1 of
    them), and compare every layer's state and the next forward's logits with a prefill of that prefix."""
    family, model, inputs, _ = case
    target = TransformersTarget(model)
    chain = torch.tensor([[11, 3, 17, 4, 29]])
    follow = torch.tensor([[8, 2]])
    with torch.inference_mode():
        for kept in range(K + 2):
            state, _ = target.prefill(inputs)
            prompt = state.cache_length
            target.forward(state, chain)
            crop_cache(state.cache, prompt + kept)
            fresh, _ = target.prefill(extended(inputs, chain[:, :kept]))
            assert state.cache_length == fresh.cache_length == prompt + kept
            for i, (ours, theirs) in enumerate(zip(_layer_states(state.cache), _layer_states(fresh.cache))):
                for a, b in zip(ours, theirs):
                    assert (a is None) == (b is None), (kept, i)
                    if a is not None:
                        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4), (kept, i)
            assert held_bytes(state.cache) == 0  # the crop settled: nothing kept for rollback
            ours, theirs = target.forward(state, follow).logits, target.forward(fresh, follow).logits
            # float32 through two orders of sums (a chunked prefill against steps): on an AMX Xeon the MoE
            # family's logits (|x| ~4) parted by up to 2.3e-5; a wrong rollback parts them by O(1)
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), kept


def test_rollback_reaches_only_the_positions_since_the_last_commit():
    target = TransformersTarget(tiny_qwen3_5())
    with torch.inference_mode():
        state, _ = target.prefill(inputs_of("qwen3_5"))
        prompt = state.cache_length
        target.forward(state, torch.tensor([[1, 2, 3]]))
        crop_cache(state.cache, prompt + 2)  # commits prompt + 2
        target.forward(state, torch.tensor([[4]]))
        with pytest.raises(ValueError, match="rolls back only within the positions since its last commit"):
            crop_cache(state.cache, prompt + 1)


def test_state_history_memory_is_bounded():
    """What rollback keeps alive: per Gated DeltaNet layer and forward since the last commit, its
    start states (conv window [1, C, k] and S [1, H_v, d_k, d_v] fp32) and its inputs (conv inputs
    [1, C, n], layer inputs [1, n, H]); per short-conv layer the window and the conv inputs. Nothing
    after a commit (docs/hybrid.md)."""
    model = tiny_qwen3_5()
    target = TransformersTarget(model)
    mixer = model.model.layers[0].linear_attn
    c, k, hidden = mixer.conv_dim, mixer.conv_kernel_size, model.config.hidden_size
    s = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim
    linear = sum(t == "linear_attention" for t in model.config.layer_types)
    n = K + 1
    with torch.inference_mode():
        state, _ = target.prefill(inputs_of("qwen3_5"))
        crop_cache(state.cache, state.cache_length)  # the prompt committed
        assert held_bytes(state.cache) == 0
        target.forward(state, torch.arange(n)[None])
        assert held_bytes(state.cache) == linear * 4 * (c * k + s + n * (c + hidden))
        crop_cache(state.cache, state.cache_length - 2)
        assert held_bytes(state.cache) == 0


def test_trees_are_refused_in_one_line():
    from mmspec.drafters import MedusaDrafter
    from mmspec.modeling.heads import DraftHeads

    model = tiny_qwen3_5()
    heads = DraftHeads(model.config.hidden_size, num_heads=4, kind="medusa").eval()

    class NoPrefill(TransformersTarget):
        def prefill(self, *args, **kwargs):
            raise AssertionError("the tree drafter is refused before the prefill")

    target = NoPrefill(model)
    with pytest.raises(ValueError, match="a token tree would need a state per branch. Use a chain drafter"):
        mmspec.generate(target, drafter=MedusaDrafter(model, heads), max_new_tokens=4, **inputs_of("qwen3_5"))
    for name in ("eagle2", "medusa", "sjd-pac"):  # by name: before looking for trained weights
        with pytest.raises(ValueError, match="a token tree would need a state per branch"):
            mmspec.generate(model, drafter=name, max_new_tokens=4, **inputs_of("qwen3_5"))


def batch_rows(family):
    """Three prompts of different lengths; for a multimodal family its image prompt and text ones."""
    if family.endswith("_vl") and family.startswith("qwen"):
        return [inputs_of(family), {"input_ids": torch.tensor([PROMPT[:-4]])}, {"input_ids": torch.tensor([[9, 3, *PROMPT]])}]
    return [inputs_of(family), inputs_of(family, PROMPT[:-4]), inputs_of(family, [9, 3, 5, 6, 7, 8, 5, 6, 7, 9, 2, 2, 5])]


BATCH_NEW = 12


@pytest.fixture
def cut_rows(monkeypatch):
    """Counts the commits of a batch whose rows kept different numbers of a verification's positions,
    some of them cut inside it (a per-row replay of the recurrent state)."""
    from mmspec.core.recurrent import StateHistory

    seen = []
    rewind_rows = StateHistory.rewind_rows

    def spy(self, kept, current):
        count = self.segments[-1].count if self.segments else 0
        seen.append(len(set(kept)) > 1 and any(0 < k < count for k in kept))
        return rewind_rows(self, kept, current)

    monkeypatch.setattr(StateHistory, "rewind_rows", spy)
    return seen


@pytest.mark.parametrize("family", list(BUILD))
def test_batch_rows_equal_batch_one_rows(family, cut_rows):
    """Rows of different prompt lengths decode together with prompt lookup, layer skip (through the
    batch cache's first layers, recurrent ones included) and a draft model of the family: each row
    is transformers' greedy output (with the draft model, the shortest row also its batch-1 mmspec
    generation step for step), while the rows' recurrent states are each rewound to their own accepted length."""
    model = BUILD[family](0)
    rows = batch_rows(family)
    with torch.inference_mode():
        references = [model.generate(**row, do_sample=False, max_new_tokens=BATCH_NEW)[0, row["input_ids"].shape[1]:] for row in rows]
    drafters = {"prompt-lookup": "prompt-lookup", "layer-skip": f"layer-skip:{SKIP_LAYERS[family]}",
                "draft model": ModelDrafter(_near_copy(model, 0.05), num_draft_tokens=K)}
    for name, drafter in drafters.items():
        batch = generate_rows(model, rows, drafter=drafter, max_new_tokens=BATCH_NEW, num_draft_tokens=K)
        for b, (row, reference) in enumerate(zip(rows, references)):
            assert torch.equal(batch.sequences[b, -BATCH_NEW:], reference), (name, b)
            if name == "draft model" and b == 1:
                single = mmspec.generate(model, drafter=drafter.for_batch(), max_new_tokens=BATCH_NEW, **row)
                assert batch.row_stats[b].committed_per_step == single.stats.committed_per_step, b
    assert any(cut_rows)  # rows were rewound to different lengths inside one verification


def test_batch_sampled_rows_equal_batch_one_rows(cut_rows):
    """Sampling: each row draws the random numbers of its batch-1 generation with the same seed."""
    model = tiny_qwen3_5()
    rows = batch_rows("qwen3_5")
    drafter = ModelDrafter(_near_copy(model, 0.05), num_draft_tokens=K)
    kwargs = dict(max_new_tokens=BATCH_NEW, do_sample=True, temperature=0.7, seed=5)
    batch = generate_rows(model, rows, drafter=drafter, **kwargs)
    for b, row in enumerate(rows):
        single = mmspec.generate(model, drafter=drafter.for_batch(), **kwargs, **row)
        assert torch.equal(batch.sequences[b, -BATCH_NEW:], single.sequences[0, -BATCH_NEW:]), b
    assert any(cut_rows)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_rows_join_and_leave_a_running_hybrid_batch(family):
    """Continuous batching: rows admitted after the first steps join the running batch (their
    recurrent states concatenated to the batch's), a cancelled row leaves (its states dropped);
    every row that runs to its end is its batch-1 output."""
    model = BUILD[family](0)
    rows = batch_rows(family)
    waiting = [[], [rows[2]]]
    streamed = {}

    def admit():
        return waiting.pop(0) if waiting else []

    def on_tokens(row, tokens):
        streamed.setdefault(row, []).append(tokens)

    out = generate_rows(model, rows[:2], drafter=ModelDrafter(_near_copy(model, 0.05), num_draft_tokens=K),
                        max_new_tokens=BATCH_NEW, num_draft_tokens=K, admit=admit, on_tokens=on_tokens,
                        cancelled=lambda row: row == 1 and len(streamed.get(1, [])) >= 2)
    assert len(out.row_stats) == 3 and out.row_stats[1].config["cancelled"]
    for b, row in enumerate(rows):
        with torch.inference_mode():
            reference = model.generate(**row, do_sample=False, max_new_tokens=BATCH_NEW)[0, row["input_ids"].shape[1]:]
        got = torch.cat(streamed[b], dim=1)[0]
        assert torch.equal(got, reference[: len(got)]) and (b == 1 or len(got) == BATCH_NEW), b


def test_left_padding_keeps_a_zero_state_zero_but_is_not_batch_one_bitwise():
    """Why mmspec prefills each row of a hybrid batch alone (then stacks the states) instead of one
    left-padded forward: transformers zeroes a pad's layer inputs (``apply_mask_to_padding_states``),
    so a state that starts at zero stays exactly zero through the pads (the delta rule adds
    k (beta (v - k^T S))^T = 0 and decays 0; the conv window of zero inputs is the initial one). But a
    pad still has a decay g = -exp(A_log) softplus(dt_bias) != 0, which the chunked kernel sums into
    its cumulative decays, and the padded attention rounds differently: the prompt's states come out
    equal only to rounding, not bit for bit. The stacked rows are bitwise their batch-1 states."""
    from transformers import DynamicCache

    model = tiny_qwen3_5()
    ids = torch.tensor([PROMPT])
    pads = torch.full((1, 5), 7)
    with torch.inference_mode():
        padded = DynamicCache(config=model.config)
        model(input_ids=torch.cat([torch.cat([pads, ids], 1), torch.cat([pads, ids], 1)]),
              attention_mask=torch.tensor([[0] * 5 + [1] * ids.shape[1], [1] * (5 + ids.shape[1])]), cache=padded)
        only_pads = DynamicCache(config=model.config)
        model(input_ids=torch.cat([pads, pads]), attention_mask=torch.tensor([[0] * 5, [1] * 5]), cache=only_pads)
        target = TransformersTarget(model)
        single, _ = target.prefill({"input_ids": ids})
        batch, _ = target.prefill_rows([{"input_ids": ids[:, :-3]}, {"input_ids": ids}])
    linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    for i in linear:
        assert not only_pads.layers[i].conv_states[0][0].any() and not only_pads.layers[i].recurrent_states[0][0].any()
    states = [(single.cache.layers[i].conv_states[0], single.cache.layers[i].recurrent_states[0]) for i in linear]
    padded_states = [(padded.layers[i].conv_states[0][:1], padded.layers[i].recurrent_states[0][:1]) for i in linear]
    stacked = [(batch.cache.layers[i].conv_states[0][1:], batch.cache.layers[i].recurrent_states[0][1:]) for i in linear]
    for (conv, s), (padded_conv, padded_s), (row_conv, row_s) in zip(states, padded_states, stacked):
        assert torch.allclose(s, padded_s, atol=1e-6) and torch.allclose(conv, padded_conv, atol=1e-5)
        assert torch.equal(conv, row_conv) and torch.equal(s, row_s)
    assert not all(torch.equal(s, padded_s) for (_, s), (_, padded_s) in zip(states, padded_states))


VOCAB, NEW, RUNS = 8, 3, 400
TEMPERATURE = 1.3


def test_speculative_sampling_keeps_the_target_distribution():
    """Level 2: a 2-layer Qwen3.5 (one Gated DeltaNet layer) sampled with a random Llama draft, one
    draft token a step: a rejected draft rolls the recurrent state back inside the verification
    (a replay) before the third token is drawn. Each new token's frequencies against the target's
    exact marginals (chi-square)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tiny_qwen3_5(0, vocab=VOCAB, layers=2)
    torch.manual_seed(1)
    draft = _finish(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)), 1)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    config = SamplingConfig(do_sample=True, temperature=TEMPERATURE)
    exact = exact_marginals(target, {"input_ids": prompt}, config, NEW)
    counts, drafted, accepted = sampled_counts(target, ModelDrafter(draft, num_draft_tokens=1), {"input_ids": prompt}, config,
                                               NEW, RUNS, num_draft_tokens=1)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)  # accepted and rejected drafts
    for i in range(NEW):
        assert pvalue(counts[i], exact[i]) > 1e-4, (i, counts[i], exact[i] * RUNS)


def test_bench_cost_measures_the_rollback():
    """`mmspec bench cost` on a hybrid target: the bare forward and the rollback to each kept length
    are measured and tabled (tiny model, one repeat: the figures exist and are positive)."""
    from mmspec.bench.cost import markdown_table, measure_recurrent

    model = tiny_qwen3_5()
    target = TransformersTarget(model)
    costs = measure_recurrent(target, model, [1, 3], inputs_of("qwen3_5"), repeats=1)
    assert set(costs["kept"]) == set(costs["bare"]) == {1, 3} and min([*costs["kept"].values(), *costs["bare"].values()]) > 0
    assert costs["rollback"][1] == {} and set(costs["rollback"][3]) == {1, 2} and min(costs["rollback"][3].values()) > 0
    results = {"meta": {"model": "tiny", "repeats": 1, "machine": {"dtype": "fp32", "threads": 1, "cpu": "x", "torch": "x"}},
               "variants": {"plain": {"ms": {"1": 2.0, "3": 3.0}, "kept_ms": {"1": 2.0, "3": 3.0}, "bare_ms": {"1": 2.0, "3": 2.5},
                                      "rollback_ms": {"1": {}, "3": {"1": 0.1, "2": 0.3}}}}}
    table = markdown_table(results)
    assert "| 3 | 3.00 | 2.50 | +20.0% | 1: 0.10, 2: 0.30 | 10.0% |" in table


def test_layer_skip_within_the_recurrent_layers_is_refused_in_one_line():
    """Qwen3.5's first three layers are Gated DeltaNet: a draft of them alone has no attention layer
    to count the cached positions: refused as the drafter is built (not at each draft, where a
    dataset run would fail every row), and so is a Kangaroo exit inside them."""
    from mmspec.adapters.hf import TransformersTarget, text_decoder, truncated_decoder
    from mmspec.drafters import resolve_drafter

    with pytest.raises(ValueError, match="the first 2 layers are all recurrent.*give N > 3"):
        mmspec.generate(tiny_qwen3_5(), drafter="layer-skip:2", max_new_tokens=4, **inputs_of("qwen3_5"))
    model = tiny_qwen3_5()
    with pytest.raises(ValueError, match="^layer-skip: the first 2 layers are all recurrent"):
        resolve_drafter("layer-skip:2", TransformersTarget(model))
    with pytest.raises(ValueError, match="^Kangaroo's exit layer: the first 2 layers"):
        truncated_decoder(text_decoder(model), 2, "Kangaroo's exit layer")
    assert len(truncated_decoder(text_decoder(model), 4).layers) == 4
    four = tiny_qwen3_5(layers=4)  # its only attention layer is the last: no N works, and the line says so
    with pytest.raises(ValueError, match="its only attention layer is the last, so no N works; use prompt-lookup"):
        resolve_drafter("layer-skip:3", TransformersTarget(four))


def test_captioning_pipeline_and_cli_on_a_saved_lfm2_vl_checkpoint(tmp_path_factory, tmp_path, capsys):
    """A tiny LFM2-VL saved with save_pretrained plus its real processor (tests/tiny_checkpoints.py):
    the captioning pipeline's speculative captions equal its baseline's, a batch of two images (of
    different sizes: prompts of different lengths) gives each image's own caption, and ``mmspec
    caption --model DIR`` gives the pipeline's caption."""
    import json

    import numpy as np
    from PIL import Image
    from tiny_checkpoints import cached_tiny_checkpoint

    from mmspec.cli import main

    directory = cached_tiny_checkpoint("lfm2_vl", tmp_path_factory)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((40, 24, 3), (16, 48, 3))]
    captioner = mmspec.pipeline("image-captioning", model=directory, dtype="fp32", drafter="prompt-lookup")
    results = captioner(images[:1], max_new_tokens=6, compare_baseline=True)
    assert results[0].identical_to_baseline and results[0].stats.new_tokens == 6
    batch = captioner(images, max_new_tokens=6, batch_size=2)
    assert batch[0].text == results[0].text and batch[1].text == captioner(images[1:], max_new_tokens=6)[0].text
    images[0].save(tmp_path / "a.png")
    code = main(["caption", str(tmp_path / "a.png"), "--model", str(directory), "--dtype", "fp32", "--max-new-tokens", "6",
                 "--drafter", "prompt-lookup", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["text"] == results[0].text
    # a tree drafter: refused from the config, before the weights load (the pipeline and the CLI)
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the tree drafter is refused before the model loads")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", no_load)
        with pytest.raises(ValueError, match="medusa.*a token tree would need a state per branch"):
            mmspec.pipeline("image-captioning", model=directory, dtype="fp32", drafter="medusa")
        code = main(["caption", str(tmp_path / "a.png"), "--model", str(directory), "--drafter", "eagle2"])
        assert code == 2 and "a token tree would need a state per branch" in capsys.readouterr().err


# the CUDA path (`pytest -m gpu`, skipped without a GPU) ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(BUILD))
def test_greedy_on_cuda_equals_transformers_on_cuda(family):
    """Every hybrid family on CUDA (fp32; transformers' own recurrent kernels, or its reference ones
    without flash-linear-attention): the chain drafters give transformers' greedy tokens, with
    verifications cut inside their chains (the recurrent replay on the GPU)."""
    model = BUILD[family](0).cuda()
    inputs = {k: v.cuda() for k, v in inputs_of(family).items()}
    with torch.inference_mode():
        reference = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    partial = 0
    for drafter in ("prompt-lookup", f"layer-skip:{SKIP_LAYERS[family]}", ModelDrafter(BUILD[family](1).cuda(), num_draft_tokens=K)):
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K, **inputs)
        assert out.sequences.device.type == "cuda" and torch.equal(out.sequences, reference), drafter
        partial += 0 < out.stats.accepted < out.stats.drafted
    assert partial
