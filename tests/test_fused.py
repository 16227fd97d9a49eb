"""Whole decoder layers in one C call (mmspec.modeling.fused): they compute the PyTorch layers'
forward (transformers' Llama layer with and without grouped heads and attention biases, mmspec's
LlamaGen block) over chains and tree masks, their verification rows are bitwise one-token steps,
and they step aside where they do not apply (gradients, MMSPEC_FUSED=0, linears as loaded, no
cache) or when the weights moved."""

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from mmspec.core.cache import crop_cache, make_cache
from mmspec.modeling import fused
from kernel_support import needs_kernel

from mmspec.modeling.fast_linear import (bf16_kernel_available, bf16_variants, cpu_flags, default_max_rows, optimize,
                                         packable)
from mmspec.modeling.fused import fused_enabled, fused_plans, layer_plan
from mmspec.modeling.lean import lean_forward

pytestmark = needs_kernel
DTYPES = [torch.float32] + ([torch.bfloat16] if bf16_kernel_available() else [])
TOLERANCE = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def llama(dtype, kv_heads=4, bias=False, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, attention_bias=bias, attn_implementation="sdpa")
    model = LlamaModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    model = model.to(dtype)
    optimize(model)
    return model


def script(model, forward):
    """A prefill, one step, a chain, a tree with an additive mask: the outputs of each."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    cache, outs = make_cache(model.config), []
    with torch.inference_mode():
        outs.append(forward(x[:, :12], cache, None, None))
        outs.append(forward(x[:, 12:13], cache, torch.tensor([[12]]), None))
        outs.append(forward(x[:, 13:17], cache, torch.arange(13, 17)[None], None))
        crop_cache(cache, 14)
        allowed = torch.zeros(4, 18, dtype=torch.bool)
        allowed[:, :14] = True
        for node, path in enumerate([[0], [1], [0, 2], [0, 2, 3]]):
            allowed[node, [14 + p for p in path]] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        outs.append(forward(x[:, 17:21], cache, torch.tensor([[14, 14, 15, 16]]), mask))
    return outs


def fused_and_modules(monkeypatch, where: str, run):
    """``run()`` with the fused layers (counting the calls of ``fused_layers`` as ``where`` imports
    it) and again with ``MMSPEC_FUSED=0`` -> (fused outputs, fused calls, module outputs)."""
    calls = []
    real = fused.fused_layers
    monkeypatch.setattr(where, lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run()
    count = len(calls)
    monkeypatch.setenv("MMSPEC_FUSED", "0")
    fused_enabled.cache_clear()
    try:
        want = run()
    finally:
        monkeypatch.delenv("MMSPEC_FUSED")
        fused_enabled.cache_clear()
    assert len(calls) == count  # nothing fused with MMSPEC_FUSED=0
    return got, count, want


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kv_heads,bias", [(4, False), (2, True)], ids=["mha", "gqa-bias"])
def test_fused_llama_layers_compute_the_pytorch_layers(monkeypatch, dtype, kv_heads, bias):
    model = llama(dtype, kv_heads, bias)
    assert all(layer_plan(layer) is not None for layer in model.layers)
    got, calls, want = fused_and_modules(monkeypatch, "mmspec.modeling.lean.fused_layers",
                                         lambda: script(model, lambda x, c, p, m: lean_forward(model, x, c, p, m)))
    assert calls == 4  # prefill (12 rows), step, chain, tree: each one call for the stack
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_verification_rows_are_one_token_steps(dtype):
    model = llama(dtype, kv_heads=2)
    x = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.inference_mode():
        cache = make_cache(model.config)
        lean_forward(model, x[:, :22], cache)
        chain = lean_forward(model, x[:, 22:], cache)
        cache = make_cache(model.config)
        lean_forward(model, x[:, :22], cache)
        steps = torch.cat([lean_forward(model, x[:, i : i + 1], cache) for i in range(22, 30)], dim=1)
        assert fused_plans(model.layers, cache, 8, dtype, x.device) is not None
    assert torch.equal(chain, steps)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_llamagen_blocks_compute_the_pytorch_blocks(monkeypatch, dtype):
    from tiny_models import tiny_llamagen

    model = tiny_llamagen(0, dim=128, vocab=16, side=4).model.to(dtype)
    optimize(model)
    if dtype == torch.bfloat16 and bf16_variants()[:1] == ("avx512bf16",):
        # packed for AVX512-BF16, q, k and v are found in the fused projection's copy only where each
        # starts at a group of 64 outputs: a width of 96 is not fused (its linears run one by one)
        narrow = tiny_llamagen(0, dim=96, vocab=16, side=4).model.to(dtype)
        optimize(narrow)
        assert all(layer_plan(layer) is None for layer in narrow.layers)
    caption = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(3))

    def run():
        cache = make_cache(None)
        with torch.inference_mode():
            model(caption=caption, past_key_values=cache)
            return [model(tokens[:, :1], past_key_values=cache).logits, model(tokens[:, 1:], past_key_values=cache).logits]

    assert all(layer_plan(layer) is not None for layer in model.layers)
    got, calls, want = fused_and_modules(monkeypatch, "mmspec.modeling.llamagen.fused_layers", run)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
    assert calls == 2  # the step and the chain, each one call for both blocks (the prefill before any cache layer)


def test_fused_layers_step_aside(monkeypatch):
    model = llama(torch.float32)
    cache = make_cache(model.config)
    with torch.inference_mode():
        lean_forward(model, torch.randn(1, 5, 64), cache)
        assert fused_plans(model.layers, cache, 4, torch.float32, torch.device("cpu")) is not None
        beyond = model.layers[0].mlp.up_proj.max_rows + 1  # (65 packed for the 16-lane kernel; 49 on the AVX2 one)
        assert beyond - 1 == default_max_rows("c", torch.float32, packable(model.layers[0].mlp.up_proj.weight))
        assert fused_plans(model.layers, cache, beyond, torch.float32, torch.device("cpu")) is None  # beyond max_rows
        assert fused_plans(model.layers, None, 1, torch.float32, torch.device("cpu")) is None
        assert fused_plans(model.layers, cache, 1, torch.bfloat16, torch.device("cpu")) is None
    if bf16_variants()[:1] == ("amx",):  # on the AMX kernel a fused layer takes up to 128 rows (a prompt), as asked
        model = llama(torch.bfloat16)
        cache = make_cache(model.config)
        with torch.inference_mode():
            lean_forward(model, torch.randn(1, 100, 64).bfloat16(), cache)
            assert fused_plans(model.layers, cache, 128, torch.bfloat16, torch.device("cpu")) is not None
            assert fused_plans(model.layers, cache, 129, torch.bfloat16, torch.device("cpu")) is None
        small = LlamaModel(model.config).eval().to(torch.bfloat16)
        optimize(small, max_rows=8)  # a smaller limit asked for is kept
        assert layer_plan(small.layers[0]).max_rows == 8
    assert fused_plans(model.layers, cache, 1, torch.float32, torch.device("cpu")) is None  # gradients on
    assert layer_plan(llama(torch.float32).layers[0].__class__(model.config, 0).eval()) is None  # nn.Linear as loaded
    monkeypatch.setenv("MMSPEC_FUSED", "yes")
    fused_enabled.cache_clear()
    try:
        with pytest.raises(ValueError, match="MMSPEC_FUSED='yes'"):
            fused_enabled()
    finally:
        monkeypatch.delenv("MMSPEC_FUSED")
        fused_enabled.cache_clear()


def test_a_plan_follows_the_weights():
    model = llama(torch.float32)
    first = layer_plan(model.layers[0])
    assert layer_plan(model.layers[0]) is first
    cache = make_cache(model.config)
    with torch.inference_mode():
        lean_forward(model, torch.randn(1, 3, 64), cache)
        stack = fused_plans(model.layers, cache, 1, torch.float32, torch.device("cpu"))
        assert stack[0] is first and fused_plans(model.layers, cache, 1, torch.float32, torch.device("cpu")) == stack
    if bf16_kernel_available():
        model.to(torch.bfloat16)  # new weight storage: new plans in the new dtype, for the layer and the stack
        again = layer_plan(model.layers[0])
        assert again is not first and again.dtype == torch.bfloat16
        cache = make_cache(model.config)
        with torch.inference_mode():
            lean_forward(model, torch.randn(1, 3, 64).bfloat16(), cache)
            plans = fused_plans(model.layers, cache, 1, torch.bfloat16, torch.device("cpu"))
        assert plans is not None and all(p.dtype == torch.bfloat16 for p in plans)


def test_a_cache_of_another_shape_is_refused():
    """The kernel writes into the cache's buffers: a cache of other rows or dtype is an error, not a write."""
    model = llama(torch.float32)
    plan = layer_plan(model.layers[0])
    cache = make_cache(model.config)
    with torch.inference_mode():
        lean_forward(model, torch.randn(2, 3, 64), cache)  # two rows cached
        x = torch.randn(1, 64)
        cos, sin = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
        with pytest.raises(ValueError, match="the cache holds keys"):
            fused.fused_layers(fused.PlanStack([plan]), x, 1, 1, cos, sin, 0, cache.layers, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_stack_keeps_any_layers_states(monkeypatch, dtype):
    """lean_states' kept hidden states (the stack run in two calls around them) and its normed output
    (the final norm in C) are the module path's, for one sequence and for a batch of two."""
    from mmspec.modeling.lean import lean_states

    model = llama(dtype)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)).to(dtype)

    def run(layer):
        cache = make_cache(model.config)
        with torch.inference_mode():
            lean_states(model, x[:, :6], cache)
            return lean_states(model, x[:, 6:], cache, hidden_layer=layer)

    for layer in (0, 1, 2, -1):
        got, calls, want = fused_and_modules(monkeypatch, "mmspec.modeling.lean.fused_layers", lambda: run(layer))
        assert calls == (3 if layer in (1,) else 2)  # the prefill, then the stack in one call or two around the kept layer
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOLERANCE[dtype])
        assert torch.equal(got[0], run(None)[0])
        if layer in (2, -1):
            assert torch.equal(got[1], got[0])
    one = x[1:]  # the batch's second sequence alone: its rows of the batch's kept states, bitwise
    cache = make_cache(model.config)
    with torch.inference_mode():
        lean_states(model, one[:, :6], cache)
        alone = lean_states(model, one[:, 6:], cache, hidden_layer=1)
        both = run(1)
    assert torch.equal(alone[0][0], both[0][1]) and torch.equal(alone[1][0], both[1][1])


def prompt_chunk(model, dtype) -> int:
    """The rows a fused call of ``model``'s stack takes here (0 where none), as a long prompt's chunks."""
    with torch.inference_mode():
        plans = fused_plans(model.layers, make_cache(model.config), 1, dtype, torch.device("cpu"))
    return 0 if plans is None else min(p.max_rows for p in plans)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_a_prompt_beyond_the_row_limit_runs_fused_in_chunks(monkeypatch, dtype):
    """A causal prompt of 2 chunks and 44 rows more (the AMX kernel: 128 rows a call, the packed
    vector kernels 64) runs through the fused stack in chunks, each after the earlier ones: bitwise
    the prompt given in those pieces, and within rounding of the module path; its kept hidden states
    too; each row of a batch of such prompts gets bitwise its batch-1 prefill; a tree mask beyond
    the limit stays on the modules."""
    from mmspec.modeling.lean import PROMPT_CHUNK_ROWS, lean_states

    model = llama(dtype)
    chunk = prompt_chunk(model, dtype)
    if chunk < PROMPT_CHUNK_ROWS:
        pytest.skip(f"this CPU's fused {dtype} layers take {chunk} rows a call: long prompts stay on the modules")
    length = 2 * chunk + 44
    x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(7)).to(dtype)

    def whole(rows=x[:1], layer=None):
        cache = make_cache(model.config)
        with torch.inference_mode():
            return lean_states(model, rows, cache, hidden_layer=layer), lean_states(model, rows[:, :1], cache)[0]

    (got, kept), after = whole(layer=1)
    pieces = make_cache(model.config)
    with torch.inference_mode():
        parts = [lean_states(model, x[:1, a:b], pieces, hidden_layer=1) for a, b in ((0, chunk), (chunk, 2 * chunk), (2 * chunk, length))]
        assert torch.equal(after, lean_states(model, x[:1, :1], pieces)[0])  # the same cache after the prompt
    assert torch.equal(got, torch.cat([p[0] for p in parts], 1)) and torch.equal(kept, torch.cat([p[1] for p in parts], 1))
    (batch, batch_kept), batch_after = whole(x, layer=1)
    for b in range(2):
        (alone, alone_kept), alone_after = whole(x[b : b + 1], layer=1)
        assert torch.equal(batch[b], alone[0]) and torch.equal(batch_kept[b], alone_kept[0])
        assert torch.equal(batch_after[b], alone_after[0])
    fused_out, calls, modules = fused_and_modules(monkeypatch, "mmspec.modeling.lean.fused_layers", lambda: whole()[0][0])
    assert calls == 4  # three chunks of the prompt (the whole stack each), then the one-row step
    torch.testing.assert_close(fused_out, modules, **TOLERANCE[dtype])
    with torch.inference_mode():
        cache = make_cache(model.config)
        mask = torch.ones(1, 1, chunk + 2, chunk + 2, dtype=torch.bool).tril()
        assert fused_plans(model.layers, cache, chunk + 2, dtype, torch.device("cpu")) is None
        calls = []
        real = fused.fused_layers
        monkeypatch.setattr("mmspec.modeling.lean.fused_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
        lean_states(model, x[:1, : chunk + 2], cache, attention_mask=mask)
        assert not calls


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the 16-lane element-wise path needs AVX-512")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_the_wide_build_is_bitwise_the_narrow_one(dtype):
    """On an AVX-512 CPU a plan runs the 16-lane SiLU (and attention): bitwise what the 8-lane
    code gives, over an MLP width with a tail of 8 (136) and rows of a prefill and a step."""
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=1, hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaModel(config).eval().to(dtype)
    optimize(model)
    x = torch.randn(1, 21, 64, generator=torch.Generator().manual_seed(3)).to(dtype)

    def run():
        cache = make_cache(model.config)
        with torch.inference_mode():
            return [lean_forward(model, x[:, :20], cache), lean_forward(model, x[:, 20:], cache)]

    wide = run()
    with torch.inference_mode():
        specs = fused_plans(model.layers, make_cache(model.config), 1, dtype, torch.device("cpu")).specs
    assert all(spec.wide for spec in specs)
    try:
        for spec in specs:
            spec.wide = 0
        narrow = run()
    finally:
        for spec in specs:
            spec.wide = 1
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))


def test_rotary_table_is_the_rotary_module():
    """lean's rotary table gives bitwise what the model's rotary module gives, for contiguous
    positions after a cache, explicit positions, and after it grew."""
    from mmspec.modeling.lean import rotary

    for dtype in (torch.float32, torch.bfloat16):
        model = llama(torch.float32).to(dtype)
        x = torch.randn(2, 5, 64).to(dtype)
        for cached in (0, 3, 250, 700):
            want = model.rotary_emb(x, torch.arange(cached, cached + 5)[None])
            got = rotary(model, x, cached, None)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        positions = torch.tensor([[7, 7, 8, 9, 1000], [0, 1, 2, 3, 4]])
        want = model.rotary_emb(x, positions)
        assert all(torch.equal(a, b) for a, b in zip(rotary(model, x, 0, positions), want))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_image_eagle_head_runs_its_block_fused(monkeypatch, dtype):
    """The image EAGLE head's LlamaGen block takes the fused stack once its cache holds preallocated
    layers (chains and a tree expansion mask), with the module path's outputs."""
    from mmspec.core.tree import expansion_mask
    from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead

    torch.manual_seed(0)
    head = ImageEagleHead(ImageEagleConfig(dim=64, n_head=2, grid=(4, 4))).eval().to(dtype)
    optimize(head)

    def run():
        cache, outs = make_cache(None), []
        g = torch.Generator().manual_seed(1)
        f, e = torch.randn(2, 13, 64, generator=g).to(dtype), torch.randn(1, 13, 64, generator=g).to(dtype)
        with torch.inference_mode():
            outs.append(head(f[:, :6], e[:, :6], cache, torch.arange(6)[None]))
            outs.append(head(f[:, 6:7], e[:, 6:7], cache, torch.tensor([[6]])))
            outs.append(head(f[:, 7:10], e[:, 7:10], cache, torch.arange(7, 10)[None]))
            seen = torch.tensor([[True, False], [False, True], [True, False]])  # cache entries 8, 9 as fed tree nodes
            outs.append(head(f[:, 10:13], e[:, 10:13], cache, torch.tensor([[8, 8, 9]]), expansion_mask(seen, 8, dtype)))
        return outs

    got, calls, want = fused_and_modules(monkeypatch, "mmspec.modeling.heads.fused_layers", run)
    assert calls == 3  # every call after the first (which creates the cache's layers)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])


@pytest.mark.skipif(bf16_variants()[:1] != ("amx",), reason="packed weights are read by the AMX kernel only")
def test_packed_weights_give_the_strided_kernels_results_and_follow_updates():
    """A bf16 stack optimized with packed weights (the AMX kernel's tile order) computes bitwise what
    the same stack reading its weights in place computes, over a prefill, a step and a tree; after an
    in-place update of one middle weight the packed plans are rebuilt (not a stale copy)."""
    models = [llama(torch.bfloat16, kv_heads=2), llama(torch.bfloat16, kv_heads=2)]
    for model, pack in zip(models, (True, False)):
        optimize(model, pack=pack)  # (llama() optimized already: the modules keep their packing)
        for m in model.modules():
            if hasattr(m, "pack"):
                m.pack = pack
    for model, code in zip(models, (4, 3)):
        with torch.inference_mode():
            plans = fused_plans(model.layers, make_cache(model.config), 1, torch.bfloat16, torch.device("cpu"))
        assert [p.spec.linear for p in plans] == [code] * len(plans)

    def run(model):
        return script(model, lambda x, cache, positions, mask: lean_forward(model, x, cache, positions, mask))

    assert all(torch.equal(a, b) for a, b in zip(run(models[0]), run(models[1])))
    for model in models:
        with torch.no_grad():
            model.layers[0].mlp.up_proj.weight.mul_(-1.5)  # in place: same storage, new version
    assert all(torch.equal(a, b) for a, b in zip(run(models[0]), run(models[1])))


def test_the_c_cache_compaction_is_the_layers_own():
    """compact_cache through the C compaction (registered by mmspec.modeling.fused) leaves every
    layer's keys, values and length as the layers' own compact does; indices that do not increase
    strictly, or run past the cache, are left to the layers."""
    from mmspec.core.cache import PreallocatedLayer, compact_cache
    from mmspec.modeling.fused import compact_layers

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for indices in ([0], [0, 2, 5], [1, 3, 4, 7], [], [3]):
            keys = [torch.randn(2, 3, 12, 8, generator=generator).to(dtype) for _ in range(4)]
            values = [torch.randn(2, 3, 12, 8, generator=generator).to(dtype) for _ in range(4)]
            caches = []
            for _ in range(2):
                cache = make_cache(LlamaConfig(num_hidden_layers=4, hidden_size=48, num_attention_heads=6, num_key_value_heads=3))
                cache.layers = [PreallocatedLayer.from_tensors(k, v) for k, v in zip(keys, values)]
                caches.append(cache)
            moved = torch.tensor(indices, dtype=torch.long)
            assert compact_layers(caches[0].layers, 3, moved)
            for layer in caches[1].layers:
                layer.compact(3, moved)
            compact_cache(caches[0], 0, torch.arange(3 + len(indices)))  # (a no-op compaction, through the registry)
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert a.get_seq_length() == b.get_seq_length() == 3 + len(indices)
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    cache = make_cache(LlamaConfig(num_hidden_layers=1, hidden_size=48, num_attention_heads=6, num_key_value_heads=3))
    cache.layers = [PreallocatedLayer.from_tensors(torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))]
    assert not compact_layers(cache.layers, 1, torch.tensor([2, 2]))
    assert not compact_layers(cache.layers, 1, torch.tensor([1, 5]))
    assert cache.layers[0].get_seq_length() == 6


def _int8_reference(x, weight, bias):
    """x W^T + b with W quantised per output row and each row of x per row, both symmetric int8
    (round to nearest even, clamped to +-127), the products summed exactly, then scaled in fp32."""
    w, xf = weight.float(), x.float()
    w_top, x_top = w.abs().amax(1), xf.abs().amax(1)
    w_scale = torch.where(w_top > 0, w_top / 127, torch.ones_like(w_top))
    x_scale = torch.where(x_top > 0, x_top / 127, torch.ones_like(x_top))
    q = (w / w_scale[:, None]).round().clamp(-127, 127).long()
    a = (xf / x_scale[:, None]).round().clamp(-127, 127).long()
    y = (a @ q.T).float() * (x_scale[:, None] * w_scale[None, :])
    return (y if bias is None else y + bias.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernel_sums_the_quantised_products_exactly(dtype):
    """few_rows_linear_i8 (a drafter head's linears, fused.pack_int8's blob): bitwise the reference
    above on every path the CPU runs (VNNI, AMX-INT8 tiles where K % 64 == 0, AVX2, scalar),
    with and without a bias, a zero row, K not a multiple of 16, more than 16 rows and an odd count
    of 16-output blocks; within int8's error of the full-precision product."""
    generator = torch.Generator().manual_seed(0)
    for rows, n, k in [(1, 16, 4), (3, 256, 512), (5, 768, 256), (2, 32, 12), (19, 48, 192), (1, 32, 128)]:
        weight = torch.randn(n, k, generator=generator).to(dtype)
        x = torch.randn(rows, k, generator=generator).to(dtype)
        x[-1] = 0 if rows > 1 else x[-1]
        blob = fused.pack_int8(weight)
        assert blob.dtype == torch.uint8 and blob.numel() == n * k + 8 * n
        for bias in (None, torch.randn(n, generator=generator).to(dtype)):
            want = _int8_reference(x, weight, bias)
            for path in fused.int8_paths():
                fused.int8_linear(1 - x, blob, n, None, path=path)  # (other sums first: a reused scratch's stale ones cannot pass)
                got = fused.int8_linear(x, blob, n, bias, path=path)
                assert got.dtype == dtype and torch.equal(got, want), (rows, n, k, path)
            exact = x.float() @ weight.float().T + (0 if bias is None else bias.float())
            assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_an_int8_head_copy_follows_its_weights():
    """fused.int8_head packs a head's layer and fc once, reuses the copy while the weights stay,
    repacks after an in-place update, and declines projections the kernel cannot tile."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
    layer, fc, output = LlamaDecoderLayer(config, 0).eval(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 20)
    for module in (layer, fc, output):
        optimize(module, kernel="c")
    plans = fused.PlanStack([layer_plan(layer)])
    head = fused.int8_head(plans, layer, fc, output)
    assert head is not None and len(head.keep) == 8 and head.output is None  # 20 rows: not int8, read as the module is
    assert fused.int8_head(plans, layer, fc, output) is head
    with torch.no_grad():
        fc.weight.add_(1.0)
    again = fused.int8_head(plans, layer, fc, output)
    assert again is not head and torch.equal(again.keep[7], fused.pack_int8(fc.weight))
    layer.self_attn.q_proj.weight = torch.nn.Parameter(layer.self_attn.q_proj.weight.detach().clone() + 1)  # another tensor
    third = fused.int8_head(plans, layer, fc, output)
    assert third is not again and torch.equal(third.keep[0], fused.pack_int8(layer.self_attn.q_proj.weight))
    assert fused.int8_head(plans, layer, torch.nn.Linear(130, 64), output) is None  # K = 130: not a multiple of 4


def test_int8_linear_refuses_what_its_kernel_cannot_read():
    blob = fused.pack_int8(torch.randn(16, 8))
    for x, b in [(torch.randn(2, 8).double(), None), (torch.randn(8, 2).T, None), (torch.randn(2, 12), None),
                 (torch.randn(2, 8), torch.randn(15))]:
        with pytest.raises(ValueError, match="int8_linear needs"):
            fused.int8_linear(x, blob, 16, b)
    with pytest.raises(ValueError, match=r"int8 path 'sse' does not run here; this CPU runs \("):
        fused.int8_linear(torch.randn(2, 8), blob, 16, path="sse")


def _c_enum(header: str, name: str) -> dict[str, int]:
    """``enum name { A = 0, B = 1, ... };`` of the C header -> {A: 0, B: 1} (each member with its value written out)."""
    import re

    body = re.search(r"enum\s+" + name + r"\s*\{(.*?)\};", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return {member: int(value) for member, value in re.findall(r"(\w+)\s*=\s*(\d+)", body)}


def test_the_kernel_ids_are_the_c_enums():
    """mmspec.modeling.kernel_ids mirrors kernels/kernels.h's enums name by name and value by value,
    so that Python and C mean the same kernel by a number; LayerSpec's ctypes fields are the C
    struct's, in its order."""
    import re
    from pathlib import Path

    from mmspec.modeling.kernel_ids import Int8Path, LinearKernel

    header = (Path(fused.__file__).with_name("kernels") / "kernels.h").read_text()
    assert _c_enum(header, "linear_kernel") == {f"LINEAR_{k.name}": k.value for k in LinearKernel}
    assert _c_enum(header, "i8_path") == {f"I8_PATH_{p.name}": p.value for p in Int8Path}
    struct = re.search(r"typedef struct \{(.*?)\} LayerSpec;", header, re.S).group(1)
    struct = re.sub(r"/\*.*?\*/", "", struct, flags=re.S)
    fields = [name for declaration in struct.split(";") if declaration.strip()
              for name in re.findall(r"\*?\s*(\w+)\s*(?:,|$)", declaration.strip())]
    assert fields == [name for name, _ in fused.LayerSpec._fields_]
    # the names the rest of mmspec uses map onto them: every variant, and the int8 ids the C switch reads back
    assert [LinearKernel.variant(v) for v in ("avx2", "avx512", "avx512bf16", "amx", "amx packed")] == list(LinearKernel)[:5]
    assert fused.INT8_PATHS == {"scalar": 0, "vnni": 1, "amx": 2, "avx2": 3}
    for path in Int8Path:
        for bf16 in (True, False):
            code = LinearKernel.int8(path, bf16)
            assert ((code - LinearKernel.I8) // 2, (code - LinearKernel.I8) % 2 == 0) == (path, bf16)


@needs_kernel
def test_every_kernel_entry_is_exported():
    """Each kernel id's C entry (kernel_ids) is a symbol of the built library."""
    from mmspec.modeling.fast_linear import load_kernel
    from mmspec.modeling.kernel_ids import LinearKernel

    library = load_kernel()
    assert all(hasattr(library, kernel.entry) for kernel in LinearKernel)
