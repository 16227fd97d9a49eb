"""LoRA adapters: training wrappers and the merge at load time give the same model."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmspec.modeling.lora import LoRALinear, add_lora, lora_scale, lora_state, merge_lora_state


def tiny(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def test_wrapped_model_starts_unchanged_and_merge_reproduces_it():
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    wrapped = tiny(0)
    before = wrapped(ids).logits
    assert add_lora(wrapped.model, rank=4, alpha=8.0) == 2 * 7
    assert torch.allclose(wrapped(ids).logits, before)  # B = 0 at the start
    with torch.no_grad():
        for module in wrapped.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0, 0.2)
    trained = wrapped(ids).logits
    assert not torch.allclose(trained, before, atol=1e-3)

    state = lora_state(wrapped)
    assert len(state) == 28 and all(".lora_" in k for k in state)
    plain = tiny(0)
    assert merge_lora_state(plain, state, lora_scale(wrapped)) == 14
    torch.testing.assert_close(plain(ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_merge_refuses_an_adapter_without_a_layer():
    with pytest.raises(ValueError, match="no linear layer"):
        merge_lora_state(tiny(0), {"model.nope.lora_a": torch.zeros(1, 1), "model.nope.lora_b": torch.zeros(1, 1)}, 1.0)
