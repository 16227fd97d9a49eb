"""The lean Llama forward (mmspec.modeling.lean) equals transformers' forward of the same model:
hidden states and cache contents through a prefill, single steps, multi-token chains after a cache,
a token tree's 4-D masks (additive and boolean) and a rollback; grouped-query attention; the codec
LM and the EAGLE head that use it; and it declines what it does not compute."""

import pytest
import torch
from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralModel

from mmspec.core.cache import crop_cache, make_cache
from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig
from mmspec.modeling.heads import EagleHead
from mmspec.modeling.lean import lean_forward, lean_supported


def llama(kv_heads=4, layers=2, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=64, attn_implementation="sdpa",
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaModel(config).eval()
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_forward(model, embeds, cache, positions, mask):
    return model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=cache is not None,
                 cache=cache).last_hidden_state


def tree_mask(cached, parents, dtype=torch.float32, boolean=False):
    """A 4-D mask [1, 1, n, cached + n]: every node sees the cache, itself and its ancestors."""
    n = len(parents)
    allowed = torch.zeros(n, cached + n, dtype=torch.bool)
    allowed[:, :cached] = True
    for i, parent in enumerate(parents):
        allowed[i, cached + i] = True
        while parent >= 0:
            allowed[i, cached + parent] = True
            parent = parents[parent]
    if boolean:
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def run_script(model, forward):
    """The same sequence of forwards through ``forward``: outputs and the final cache's keys."""
    torch.manual_seed(1)
    x = torch.randn(1, 20, model.config.hidden_size)
    cache, outs = make_cache(model.config), []
    with torch.no_grad():
        outs.append(forward(model, x[:, :7], cache, None, None))  # prefill (causal, no cache)
        outs.append(forward(model, x[:, 7:8], cache, torch.tensor([[7]]), None))  # one step
        outs.append(forward(model, x[:, 8:12], cache, torch.arange(8, 12)[None], None))  # a chain after the cache
        crop_cache(cache, 10)  # two rejected
        parents = [-1, -1, 0, 0, 2]
        depth = torch.tensor([[10, 10, 11, 11, 12]])
        outs.append(forward(model, x[:, 12:17], cache, depth, tree_mask(10, parents)))  # a tree, additive mask
        crop_cache(cache, 10)
        outs.append(forward(model, x[:, 12:17], cache, depth, tree_mask(10, parents, boolean=True)))  # boolean mask
    return outs, cache.layers[0].keys[..., : cache.get_seq_length(), :].clone()


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_lean_forward_equals_transformers(kv_heads):
    model = llama(kv_heads)
    assert lean_supported(model)
    want, want_keys = run_script(model, hf_forward)
    got, got_keys = run_script(model, lean_forward)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_keys, want_keys, rtol=1e-5, atol=1e-5)


def test_lean_forward_is_not_trivially_equal():
    """The comparisons can fail: a step at the wrong position after the cache, or a tree whose mask
    shows every node, gives other outputs."""
    model = llama()
    x = torch.randn(1, 10, 32)
    outs = []
    with torch.no_grad():
        for position, mask in ((5, None), (6, None), (5, tree_mask(5, [-1, 0, -1])), (5, tree_mask(5, [-1, 0, 1]))):
            cache = make_cache(model.config)
            lean_forward(model, x[:, :5], cache)
            n = 1 if mask is None else 3
            outs.append(lean_forward(model, x[:, 5 : 5 + n], cache, torch.arange(position, position + n)[None], mask)[:, -1])
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)
    assert not torch.allclose(outs[2], outs[3], atol=1e-4)


def test_lean_supported_declines():
    model = llama()
    assert not lean_supported(model, torch.ones(1, 5, dtype=torch.long))  # a 2-D padding mask
    config = MistralConfig(vocab_size=1, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    assert not lean_supported(MistralModel(config))  # another family
    scaled = LlamaConfig(vocab_size=1, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)
    assert not lean_supported(LlamaModel(scaled))  # a scaled rotary embedding


def test_codec_lm_and_eagle_head_lean_equal_transformers():
    torch.manual_seed(0)
    lm = CodecLM(CodecLMConfig(text_vocab=12, num_codebooks=2, codebook_size=8, dim=32, layers=2, heads=2, ffn=48)).eval()
    head = EagleHead(lm.backbone.config).eval()
    x = torch.randn(1, 9, 32)
    results = []
    for lean in (False, True):
        lm.lean = head.lean = lean
        cache, head_cache = make_cache(lm.backbone.config), make_cache(head.config)
        with torch.no_grad():
            logits, hidden = lm(x[:, :6], past_key_values=cache)
            step_logits, step_hidden = lm(x[:, 6:9], past_key_values=cache, position_ids=torch.arange(6, 9)[None])
            guess = head(hidden, x[:, :6], head_cache, torch.arange(6)[None])
            more = head(guess[:, -1:], x[:, 6:7], head_cache, torch.tensor([[6]]))
        results.append((logits, hidden, step_logits, step_hidden, guess, more))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_narrow_eagle_head_saves_and_loads_its_own_mlp_width(tmp_path):
    """EagleHead(config, intermediate_size): the layer's MLP width is the head's own, and load
    rebuilds it from the saved config (the target's width elsewhere)."""
    target = llama()
    head = EagleHead(target.config, intermediate_size=16)
    assert head.decoder.layers[0].mlp.gate_proj.out_features == 16
    head.save(tmp_path)
    loaded = EagleHead.load(tmp_path, target)
    assert loaded.decoder.layers[0].mlp.gate_proj.out_features == 16
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)
    assert EagleHead(target.config).decoder.layers[0].mlp.gate_proj.out_features == 48


def test_lean_states_keep_the_hidden_states_transformers_outputs():
    """lean_states(hidden_layer=i) is transformers' hidden_states[i]: 0 the inputs, i after i
    layers, -1 the normed output."""
    from mmspec.modeling.lean import lean_states

    model = llama(layers=3)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        want = model(inputs_embeds=x, output_hidden_states=True).hidden_states
        for index in (0, 1, 2, 3, -1):
            last, kept = lean_states(model, x, hidden_layer=index)
            torch.testing.assert_close(kept, want[index], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(last, want[-1], rtol=1e-5, atol=1e-5)
        assert lean_states(model, x)[1] is None
        assert not torch.allclose(lean_states(model, x, hidden_layer=1)[1], want[2])  # negative control
        with pytest.raises(IndexError):
            lean_states(model, x, hidden_layer=4)


@pytest.mark.parametrize("family", ["llama", "smolvlm", "llava"])
def test_transformers_target_steps_run_lean_with_the_models_logits(family):
    """A Llama-decoder target's steps, chains, trees and hidden states through the lean path equal
    the model's own forward (target.lean = False), and greedy speculative decoding is unchanged."""
    import mmspec
    from tiny_models import make_tiny

    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.tree import TokenTree

    case = make_tiny(family)
    target = TransformersTarget(case.model)
    assert type(target.lean_decoder).__name__ == "LlamaModel"
    tokens = torch.randint(3, 400, (1, 5), generator=torch.Generator().manual_seed(0))
    tree = TokenTree(tokens=tokens[0, :4], parents=torch.tensor([-1, 0, 0, 1]))
    results = []
    for lean in (False, True):
        target.lean = lean
        with torch.inference_mode():
            state, _ = target.prefill(case.inputs, hidden_layer=-1)
            step = target.forward(state, tokens[:, :1], hidden_layer=-1)
            chain = target.forward(state, tokens[:, 1:5], hidden_layer=1)
            crop_cache(state.cache, state.cache.get_seq_length() - 4)  # the chain rejected
            branch = target.forward(state, tokens[:, :4], tree=tree)
        results.append([step.logits, step.hidden_states, chain.logits, chain.hidden_states, branch.logits])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    target.lean = True
    ar = mmspec.generate(case.model, max_new_tokens=10, **case.inputs)
    spec = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=10, **case.inputs)
    assert torch.equal(spec.sequences, ar.sequences)


def test_other_decoders_keep_the_models_forward():
    from tiny_models import make_tiny

    from mmspec.adapters.hf import TransformersTarget

    assert TransformersTarget(make_tiny("gemma3").model).lean_decoder is None  # not a LlamaModel
