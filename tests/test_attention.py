"""The batch-invariant attention (mmspec.modeling.attention): it is attention (float64 reference,
chains, 2-D / 4-D / additive masks, grouped heads, head sizes off the 16-lane chunks), every query
row is computed alone (a chain's rows, and a tree node whose ancestors sit at other cache slots,
give bitwise what one-token steps give), its two builds agree, and the models that use it verify
with exactly the logits of one-token steps."""

import pytest
import torch
import torch.nn.functional as F
from kernel_support import BUILT, needs_kernel

from mmspec.modeling import attention
from mmspec.modeling.attention import attend, attention_backend, few_rows_attention
from mmspec.modeling.fast_linear import bf16_kernel_available, cpu_flags, optimize

VARIANTS = ["avx2"] + (["avx512"] if "avx512f" in cpu_flags() else [])


def inputs(dtype, batch=2, heads=8, kv_heads=2, n=5, length=37, dim=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, dim, generator=g).to(dtype).transpose(1, 2)  # strided, as a projection gives it
    k = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    return q, k, v


def reference(q, k, v, allowed):
    """float64 attention: allowed [B or 1, 1, n, L] bool -> [B, n, H, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim,heads,kv_heads", [(24, 8, 2), (64, 4, 4), (128, 6, 3), (8, 2, 1)])
def test_it_is_attention(dtype, dim, heads, kv_heads):
    q, k, v = inputs(dtype, heads=heads, kv_heads=kv_heads, dim=dim)
    n, length = q.shape[2], k.shape[2]
    chain = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    torch.testing.assert_close(attend(q, k, v).double(), reference(q, k, v, chain[None, None]), **TOLERANCE[dtype])
    torch.testing.assert_close(attend(q, k, v, chain).double(), reference(q, k, v, chain[None, None]), **TOLERANCE[dtype])
    allowed = torch.rand(2, 1, n, length, generator=torch.Generator().manual_seed(1)) > 0.5
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    want = reference(q, k, v, allowed)
    torch.testing.assert_close(attend(q, k, v, allowed).double(), want, **TOLERANCE[dtype])
    torch.testing.assert_close(attend(q, k, v, additive).double(), want, **TOLERANCE[dtype])
    one = allowed[:1]  # broadcast over the batch
    torch.testing.assert_close(attend(q, k, v, one).double(), reference(q, k, v, one), **TOLERANCE[dtype])
    assert attend(q, k, v).dtype == dtype and attend(q, k, v).shape == (2, n, heads, dim)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 24])
def test_every_row_is_computed_alone(dtype, variant, dim):
    """A chain's row i = a one-token step over the first L - n + i + 1 keys, and a tree node =
    a one-token step over the prefix and its ancestors laid out as a chain: bitwise."""
    q, k, v = inputs(dtype, dim=dim, length=41)
    n, length, scale = q.shape[2], k.shape[2], dim**-0.5
    chain = few_rows_attention(q, k, v, None, scale, variant)
    for i in range(n):
        keys = length - n + i + 1
        step = few_rows_attention(q[:, :, i : i + 1], k[:, :, :keys], v[:, :, :keys], None, scale, variant)
        assert torch.equal(step[:, 0], chain[:, i])
    parents, prefix = [-1, -1, 0, 2, 0], length - n  # node 3's path: 0 -> 2 -> 3
    allowed = torch.zeros(1, n, length, dtype=torch.bool)
    allowed[:, :, :prefix] = True
    for node, parent in enumerate(parents):
        allowed[0, node, prefix + node] = True
        while parent >= 0:
            allowed[0, node, prefix + parent], parent = True, parents[parent]
    tree = few_rows_attention(q, k, v, allowed, scale, variant)
    path = [prefix + 0, prefix + 2, prefix + 3]
    as_chain = lambda t: torch.cat([t[:, :, :prefix], t[:, :, path]], dim=2)  # noqa: E731
    step = few_rows_attention(q[:, :, 3:4], as_chain(k), as_chain(v), None, scale, variant)
    assert torch.equal(step[:, 0], tree[:, 3])
    assert not torch.equal(tree[:, 3], chain[:, 3])  # the tree changed what node 3 sees


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim,n,length", [(40, 9, 300), (64, 1, 300), (64, 17, 37), (128, 3, 16), (8, 5, 5), (256, 2, 50)])
def test_both_builds_compute_the_same_values(dtype, dim, n, length):
    """The AVX2 build (16 lanes as two registers) and the AVX-512 one (one register) are two
    instantiations of one body: bitwise the same, chains and masks, every head size path."""
    q, k, v = inputs(dtype, dim=dim, length=length, n=n)
    assert torch.equal(few_rows_attention(q, k, v, None, 0.2, "avx2"), few_rows_attention(q, k, v, None, 0.2, "avx512"))
    allowed = torch.rand(2, n, length, generator=torch.Generator().manual_seed(dim)) > 0.5
    allowed[..., 0] = True
    assert torch.equal(few_rows_attention(q, k, v, allowed, 0.2, "avx2"), few_rows_attention(q, k, v, allowed, 0.2, "avx512"))


def test_the_backend_is_chosen_once_per_process(monkeypatch):
    for value, match in (("flash", "name one of c, sdpa"),):
        monkeypatch.setenv("MMSPEC_ATTENTION", value)
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match=match):
            attention_backend()
    monkeypatch.setenv("MMSPEC_ATTENTION", "sdpa")
    attention_backend.cache_clear()
    try:
        assert attention_backend() == "sdpa"
        q, k, v = inputs(torch.float32, heads=4, kv_heads=4)
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        assert torch.equal(attend(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2))
    finally:
        monkeypatch.delenv("MMSPEC_ATTENTION")
        attention_backend.cache_clear()
    assert attention_backend() == ("c" if BUILT else "sdpa")


def test_gradients_and_other_devices_take_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "few_rows_attention", lambda *a, **k: calls.append(1))
    q, k, v = inputs(torch.float32, heads=4, kv_heads=4)
    q.requires_grad_(True)
    out = attend(q, k, v)
    out.sum().backward()
    assert not calls and q.grad is not None
    attend(q.detach().half(), k.half(), v.half())  # fp16: PyTorch's attention
    assert not calls


def chain_and_steps(forward, make_cache, prompt, tokens):
    """Logits of ``tokens`` [1, n] as one chain after the prompt's cache, and as n one-token steps."""
    cache = make_cache()
    forward(prompt, cache)
    chain = forward(tokens, cache)
    cache = make_cache()
    forward(prompt, cache)
    steps = torch.cat([forward(tokens[:, i : i + 1], cache) for i in range(tokens.shape[1])], dim=1)
    return chain, steps


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lean_llama_verifies_with_the_logits_of_one_token_steps(dtype):
    from transformers import LlamaConfig, LlamaModel

    from mmspec.core.cache import make_cache
    from mmspec.modeling.lean import lean_forward

    if dtype == torch.bfloat16 and not bf16_kernel_available():
        pytest.skip("bf16 linears are batch-invariant only through the AVX512-BF16 kernels")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaModel(config).eval().to(dtype)
    optimize(model)
    x = torch.randn(1, 30, 64).to(dtype)
    with torch.inference_mode():
        chain, steps = chain_and_steps(lambda e, c: lean_forward(model, e, c), lambda: make_cache(config), x[:, :22], x[:, 22:])
    assert torch.equal(chain, steps)


@needs_kernel
def test_the_llamagen_generator_verifies_with_the_logits_of_one_token_steps():
    from tiny_models import tiny_llamagen

    model = tiny_llamagen(0, dim=96, vocab=16, side=4).model  # FFN 256: (PyTorch's SiLU is row-invariant on
    # rows of whole 64-float blocks only, as the embedded models' 768 and 1536 are)
    optimize(model)
    caption = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 16, (1, 7), generator=torch.Generator().manual_seed(3))

    def forward(inputs, cache):
        if inputs is None:
            return model(caption=caption, past_key_values=cache).logits
        return model(inputs, past_key_values=cache).logits

    from mmspec.core.cache import make_cache

    with torch.inference_mode():
        chain, steps = chain_and_steps(forward, lambda: make_cache(None), None, tokens)
    assert torch.equal(chain, steps)
