"""Ladder level 6: rollback == recomputation from scratch, for every field of the sequence state."""

import pytest
import torch
from tiny_models import FAMILIES, make_tiny

from mmspec.adapters.hf import TransformersTarget
from mmspec.core.cache import PreallocatedLayer, SequenceState, crop_cache, layer_prefix_view, make_cache


def test_preallocated_layer_append_crop_grow():
    layer = PreallocatedLayer()
    layer.min_capacity = 4
    k = torch.arange(2 * 3 * 1 * 2, dtype=torch.float32).view(2, 3, 1, 2)
    chunks = [k + i for i in range(7)]
    for chunk in chunks[:5]:
        keys, values = layer.update(chunk, -chunk)
    assert layer.get_seq_length() == 5 and torch.equal(keys, torch.cat(chunks[:5], dim=2))
    layer.crop(-2)
    assert torch.equal(layer.keys, torch.cat(chunks[:3], dim=2))
    keys, values = layer.update(torch.cat(chunks[5:7], dim=2), -torch.cat(chunks[5:7], dim=2))
    assert torch.equal(keys, torch.cat(chunks[:3] + chunks[5:7], dim=2)) and torch.equal(values, -keys)
    with pytest.raises(ValueError):
        layer.crop(1)


def _assert_cache_equal(a, b, length):
    assert a.get_seq_length() == b.get_seq_length() == length
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.values, lb.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_equals_recompute(family):
    case = make_tiny(family)
    target = TransformersTarget(case.model)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
        prompt_len = state.length
        committed = torch.randint(3, 400, (1, 3), generator=gen)
        state.tokens = torch.cat([state.tokens, committed[:, :1]], dim=1)
        # a verification forward of the pending token + 5 drafts; keep 2 drafts + a bonus token
        drafts = torch.randint(3, 400, (1, 5), generator=gen)
        target.forward(state, torch.cat([state.tokens[:, -1:], drafts], dim=1))
        accepted = torch.cat([drafts[:, :2], committed[:, 1:2]], dim=1)
        state.commit(accepted)
        # ... and then an explicit rollback of one committed token
        state.rollback(state.length - 1)
        logits_after = target.forward(state, state.tokens[:, -1:]).logits
        # from scratch: prefill the same prompt, feed the committed tokens in one go
        fresh, _ = target.prefill(case.inputs)
        fresh_logits = target.forward(fresh, state.tokens[:, prompt_len:]).logits[:, -1:]
    assert state.tokens.shape[1] == prompt_len + 3
    _assert_cache_equal(state.cache, fresh.cache, prompt_len + 3)
    torch.testing.assert_close(logits_after, fresh_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.position_ids(2), torch.tensor([[prompt_len + 3, prompt_len + 4]]))


def test_layer_prefix_view_shares_layers():
    case = make_tiny("llama")
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
    view = layer_prefix_view(state.cache, 1)
    assert view.layers[0] is state.cache.layers[0] and len(view.layers) == 1
    layer = view.layers[0]
    with torch.inference_mode():
        layer.update(torch.zeros_like(layer.keys[..., :2, :]), torch.zeros_like(layer.values[..., :2, :]))
    assert state.cache.layers[0].get_seq_length() == case.prompt_len + 2
    crop_cache(view, case.prompt_len)
    assert state.cache.get_seq_length() == case.prompt_len


def test_state_rejects_bad_rollback():
    state = SequenceState(torch.zeros(1, 5, dtype=torch.long), make_cache(make_tiny("llama").model.config), prompt_length=3)
    with pytest.raises(ValueError):
        state.rollback(2)
    with pytest.raises(ValueError):
        SequenceState(torch.zeros(2, 5, dtype=torch.long), state.cache, prompt_length=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_token_forward_logits_equal_the_models_own(family):
    """Several tokens go through the base model and the adapter's own LM-head product; the logits
    (and hidden states) equal the model's own forward on the same inputs, for every family."""
    case = make_tiny(family)
    target = TransformersTarget(case.model)
    tokens = torch.randint(5, 50, (1, 4), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
        assert target.own_lm_head is True
        length = state.cache_length
        ours = target.forward(state, tokens, hidden_layer=-1)
        crop_cache(state.cache, length)
        target.own_lm_head = False  # the model's own forward, as for one token
        theirs = target.forward(state, tokens, hidden_layer=-1)
    torch.testing.assert_close(ours.logits.float(), theirs.logits.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.hidden_states, theirs.hidden_states)


def test_soft_capped_logits_keep_the_models_own_head():
    case = make_tiny("llama")
    case.model.config.final_logit_softcapping = 30.0  # a family whose logits are not a plain product
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        target.prefill(case.inputs)
    assert target.own_lm_head is False
