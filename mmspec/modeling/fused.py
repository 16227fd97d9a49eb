"""A whole decoder stack in one C call (``kernels/layer.c``) for the decoding steps of small models.

A decoding step of the embedded voices or text-to-image generator (width 256, six layers) is not
arithmetic: each layer is ~25 PyTorch calls (norms, seven projections, rotary embedding, cache
update, attention, activation, residuals) of 10-40 us each, ~370 us a layer on one core, of which
the arithmetic is a few percent. :func:`fused_layers` runs layers whose projections are few-row
linears (:func:`mmspec.optimize`, kernel "c"), all of a stack and the model's final norm in one
call of the same library (a Python call per layer was ~30 us more a layer), with the same
batch-invariant pieces (the few-row kernels, :mod:`mmspec.modeling.attention`), so verifications
still get exactly the outputs of one-token steps:

    h = x + W_o Attn(RoPE(W_q N1(x)), RoPE(W_k N1(x)), W_v N1(x))
    x' = h + W_down (SiLU(W_gate N2(h)) * W_up N2(h))

in the model's dtype with PyTorch's roundings (fp32 norm statistics; bf16 after each product, sum and
activation). Two layouts: transformers' ``LlamaDecoderLayer`` (rotate-half rotary embedding, the
lean forward of :mod:`mmspec.modeling.lean`) and mmspec's LlamaGen ``TransformerBlock`` (fused
``wqkv``, consecutive-pair rotary table). :func:`layer_plan` says whether a layer qualifies (CPU,
fp32 or bf16, its seven projections few-row linears of one dtype, SiLU, no MLP bias); the callers
fall back to their PyTorch path otherwise, and for more rows than a plan takes (its linears' limit,
or :data:`AMX_FUSED_ROWS` on the AMX kernel). ``MMSPEC_FUSED=0`` turns it off per process.
:func:`read_as_int8` has a stack's calls read its projections as int8 weights (another, quantised
model; the text-to-speech pipeline's ``int8=True``), :func:`int8_head` an EAGLE head's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..core.cache import CACHE_COMPACTORS, PreallocatedLayer
from ..core.sampling import SamplingConfig
from ..cpu import cpu_flags
from .attention import MAX_HEAD_DIM, mask_strides
from .fast_linear import (PACKED_GROUP_BLOCKS, FewRowLinear, bf16_variants, default_max_rows, fp32_variants, load_kernel,
                          pack_int8, weight_version)
from .kernel_ids import Int8Path, LinearKernel

#: rows a fused layer takes on the AMX kernel, beyond its linears' own limit (64): from 65 rows
#: oneDNN's linears are faster (a 256 x 256 bf16 linear at 96 rows 28 against 34 us, 1536 x 576 251
#: against 291 us, one core), but one C call saves a layer's ~25 module calls, which outweighs that
#: up to 128 rows: the voice's 92-row prompt 8.3 -> 5.6 ms (docs/benchmarks.md)
AMX_FUSED_ROWS = 128

#: what the fused layer's 16-lane activations are compiled for (layer.c's WIDE_TARGET)
WIDE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


class LayerSpec(ctypes.Structure):
    """The C ``LayerSpec`` (kernels/layer.c): what does not change from call to call."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("norm1", "norm2", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
                                                      "wg", "wu", "wd")]
                + [(name, ctypes.c_int64) for name in ("D", "H", "Hkv", "hd", "I")]
                + [(name, ctypes.c_float) for name in ("eps1", "eps2", "scale")]
                + [(name, ctypes.c_int) for name in ("rope", "bf16", "linear", "wide")])


@functools.cache
def _function():
    library = load_kernel()
    function = library.lean_layers
    function.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                         + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                    ctypes.c_float, ctypes.c_int])
    function.restype = ctypes.c_int
    return function


@functools.cache
def fused_enabled() -> bool:
    """``MMSPEC_FUSED`` unset or 1: on (where the kernels build); 0: off.

    Raises:
        ValueError: another value.
    """
    value = os.environ.get("MMSPEC_FUSED", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MMSPEC_FUSED={value!r}: set 1 (fused layers, the default) or 0 (PyTorch's modules)")
    if value == "0":
        return False
    from .attention import attention_backend

    return attention_backend() == "c"  # the layer's attention is the batch-invariant kernel


@dataclass
class LayerPlan:
    """A layer's C spec, the tensors it points into (kept alive) and the rows it takes (its linears'
    limit, or :data:`AMX_FUSED_ROWS` on the AMX kernel). Where it points into packed copies of the
    weights (:meth:`FewRowLinear.packed_weight`), ``weights`` are the weights they copy and
    ``versions`` their version counters at packing: an in-place update makes the plan stale."""

    spec: LayerSpec
    keep: tuple
    max_rows: int
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    weights: tuple = ()
    versions: tuple = ()

    def fresh(self) -> bool:
        return _unchanged(self.weights, self.versions)


def _unchanged(weights: tuple, versions: tuple) -> bool:
    """Whether none of ``weights`` was updated in place since ``versions`` were read."""
    return not weights or tuple(map(weight_version, weights)) == versions


_PLANS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # layer -> (probe, plan)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_draws(caller: str, k: int, temperature: float, uniforms: torch.Tensor | None, probs: torch.Tensor | None,
                 width: int) -> None:
    """Raise one ValueError unless a fused chain's draw buffers are what its C call reads and
    writes: sampling (``temperature`` > 0) reads ``uniforms``, >= k contiguous float32 numbers on
    the CPU; ``probs`` (or None) receives float32 rows [>= k, >= width], each row contiguous (a
    buffer of another dtype or size would be written past its end)."""
    if temperature > 0 and (uniforms is None or uniforms.dtype != torch.float32 or uniforms.device.type != "cpu"
                            or not uniforms.is_contiguous() or uniforms.numel() < k):
        raise ValueError(f"{caller} samples with uniforms: a contiguous float32 CPU tensor of >= {k} numbers")
    if probs is not None and (probs.dtype != torch.float32 or probs.device.type != "cpu" or probs.dim() != 2
                              or probs.shape[0] < k or probs.shape[1] < width or probs.stride(1) != 1):
        raise ValueError(f"{caller} writes the draws' distributions into probs: a float32 CPU tensor [>= {k}, >= {width}] "
                         "with contiguous rows")


#: layer class -> the function giving a layer of it as :func:`_parts` returns it (or None where that
#: layer does not qualify). A model module registers its own layer class (:func:`register_layout`),
#: so that this module, beneath the models that call it, never imports them.
LAYOUTS: dict[type, Callable[[nn.Module], tuple | None]] = {}


def register_layout(cls: type) -> Callable[[Callable[[nn.Module], tuple | None]], Callable[[nn.Module], tuple | None]]:
    """A decorator registering its function as the layout of the layers of class ``cls`` exactly
    (a subclass may lay out its parts otherwise: it registers its own).

    Raises:
        ValueError: ``cls`` has a layout already.
    """
    def register(parts: Callable[[nn.Module], tuple | None]) -> Callable[[nn.Module], tuple | None]:
        if cls in LAYOUTS:
            raise ValueError(f"a fused-layer layout for {cls.__qualname__} is already registered")
        LAYOUTS[cls] = parts
        return parts

    return register


def _llama_parts(layer: nn.Module):
    """transformers' ``LlamaDecoderLayer`` as :func:`_parts` gives it (None for an activation other than SiLU)."""
    attn, mlp, config = layer.self_attn, layer.mlp, layer.self_attn.config
    if not isinstance(mlp.act_fn, nn.SiLU) and type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, [attn.q_proj, attn.k_proj, attn.v_proj],
            attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, layer.input_layernorm.variance_epsilon,
            layer.post_attention_layernorm.variance_epsilon, heads, config.num_key_value_heads, head_dim, attn.scaling, 0)


def _parts(layer: nn.Module):
    """(norm1, norm2, [q, k, v] or [qkv], o, gate, up, down, eps1, eps2, heads, kv heads, head dim, scale, rope)
    of a supported layer layout (transformers' Llama layer, or a class in :data:`LAYOUTS`), or None."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if type(layer) is LlamaDecoderLayer:
        return _llama_parts(layer)
    parts = LAYOUTS.get(type(layer))
    return None if parts is None else parts(layer)


def _probe(layer: nn.Module):
    """What a cached plan was built for: the first projection's class, weight pointer and dtype
    (``mmspec.optimize`` replaces the module, ``model.to`` moves the weight)."""
    first = getattr(getattr(layer, "self_attn", None), "q_proj", None) or getattr(getattr(layer, "attention", None), "wqkv", None)
    weight = getattr(first, "weight", None)
    return None if weight is None else (type(first), weight.data_ptr(), weight.dtype, weight.device)


def layer_plan(layer: nn.Module, parts_of: Callable[[nn.Module], tuple | None] = _parts) -> LayerPlan | None:
    """The layer's plan (built at first use, rebuilt when its projections changed), or None where
    it does not qualify (module doc). ``parts_of``: how to read the layer's parts, as :func:`_parts`
    gives them (a layer that is not a stack's, such as EAGLE-3's: :func:`eagle3_chain`)."""
    probe = _probe(layer)
    cached = _PLANS.get(layer)
    if cached is not None and cached[0] == probe and (cached[1] is None or cached[1].fresh()):
        return cached[1]
    plan = _build(layer, parts_of)
    _PLANS[layer] = (probe, plan)
    return plan


def _build(layer: nn.Module, parts_of: Callable[[nn.Module], tuple | None]) -> LayerPlan | None:
    parts = parts_of(layer)
    if parts is None:
        return None
    norm1, norm2, qkv, o, gate, up, down, eps1, eps2, heads, kv_heads, head_dim, scale, rope = parts
    linears = [*qkv, o, gate, up, down]
    dtype = norm1.dtype
    if (dtype not in (torch.float32, torch.bfloat16) or norm2.dtype != dtype or norm1.device.type != "cpu"
            or any(type(m) is not FewRowLinear or m.kernel != "c" or m.weight.dtype != dtype or not m.weight.is_contiguous()
                   for m in linears)
            or any(m.bias is not None for m in (gate, up, down)) or head_dim % 2 or head_dim > MAX_HEAD_DIM):
        return None
    variants = bf16_variants() if dtype == torch.bfloat16 else fp32_variants()
    if not variants:
        return None
    kernel, weights = variants[0], [m.weight for m in linears]
    # the kernel reads packed copies where every linear has one; LlamaGen's q, k and v blocks of one
    # weight are found in its packed copy alike only where each starts at a packed group (AMX: a
    # block of 16 rows; the vector kernels: PACKED_GROUP_BLOCKS of them, interleaved), for an even
    # width. The vector kernels sum packed weights in an order of their own, so a layer whose
    # linears are packed only in part is not fused (each linear then runs as its module does)
    packed = [m.packed_weight() for m in linears]
    group = 16 if kernel == "amx" else 16 * PACKED_GROUP_BLOCKS
    blocks_found = len(qkv) > 1 or ((heads * head_dim) % group == 0 and (kv_heads * head_dim) % group == 0
                                    and norm1.shape[0] % 2 == 0)
    if None not in packed and blocks_found:
        kernel, weights = f"{kernel} packed", packed
    elif kernel != "amx" and any(p is not None for p in packed):
        return None
    if len(qkv) == 1:  # LlamaGen's fused projection: q, k and v are consecutive row blocks of one weight
        weight, size = weights[0], heads * head_dim * norm1.shape[0]
        element = weight.element_size()
        q_ptr, k_ptr = weight.data_ptr(), weight.data_ptr() + size * element
        v_ptr = k_ptr + kv_heads * head_dim * norm1.shape[0] * element
        biases = (None, None, None)
        if qkv[0].bias is not None:
            return None
    else:
        q_ptr, k_ptr, v_ptr = (w.data_ptr() for w in weights[:3])
        biases = tuple(_ptr(m.bias) for m in qkv)
    o_w, gate_w, up_w, down_w = weights[-4:]
    spec = LayerSpec(norm1=norm1.data_ptr(), norm2=norm2.data_ptr(), wq=q_ptr, wk=k_ptr, wv=v_ptr, wo=o_w.data_ptr(),
                     bq=biases[0], bk=biases[1], bv=biases[2], bo=_ptr(o.bias), wg=gate_w.data_ptr(),
                     wu=up_w.data_ptr(), wd=down_w.data_ptr(), D=norm1.shape[0], H=heads, Hkv=kv_heads,
                     hd=head_dim, I=gate.out_features, eps1=eps1, eps2=eps2, scale=scale, rope=rope,
                     bf16=int(dtype == torch.bfloat16), linear=LinearKernel.variant(kernel),
                     wide=int(WIDE_FLAGS <= cpu_flags()))
    keep = (norm1, norm2, *weights, *(m.bias for m in linears if m.bias is not None))
    rows = min(m.max_rows for m in linears)
    if variants[0] == "amx" and rows >= default_max_rows("c", torch.bfloat16):  # (a smaller limit was asked for)
        rows = max(rows, AMX_FUSED_ROWS)
    sources = tuple(m.weight for m in linears) if kernel.endswith(" packed") else ()
    return LayerPlan(spec, keep, rows, dtype, kv_heads, head_dim, sources, tuple(map(weight_version, sources)))


class PlanStack(list):
    """The :class:`LayerPlan` of each layer of a stack (a list), with their specs as one C array."""

    def __init__(self, plans: list[LayerPlan]) -> None:
        super().__init__(plans)
        self.specs = (LayerSpec * len(plans))(*(p.spec for p in plans)) if plans and None not in plans else None
        self.weights = tuple(w for p in plans if p is not None for w in p.weights)
        self.versions = tuple(v for p in plans if p is not None for v in p.versions)

    def fresh(self) -> bool:
        """False once a weight the plans read a packed copy of was updated in place."""
        return _unchanged(self.weights, self.versions)


def fused_plans(layers, cache, rows: int, dtype: torch.dtype, device: torch.device) -> PlanStack | None:
    """The plans of ``layers`` where a forward over ``rows`` rows (batch x tokens) can run them
    fused: gradients off, a CPU, a cache whose layers are :class:`PreallocatedLayer`, every layer
    qualifying in ``dtype`` and the rows within its plan's limit; else None."""
    if cache is None or device.type != "cpu" or torch.is_grad_enabled() or not fused_enabled():
        return None
    cached = getattr(cache, "layers", ())
    if len(cached) < len(layers) or any(type(c) is not PreallocatedLayer for c in cached[: len(layers)]):
        return None
    plans = _stack_plans(layers)
    if plans.specs is None or any(p.max_rows < rows or p.dtype != dtype for p in plans):
        return None
    return plans


_STACKS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # layers -> (probes, plans)


def _stack_plans(layers) -> PlanStack:
    """:func:`layer_plan` of every layer, kept per layer stack and checked against its first and
    last layers' projections (``mmspec.optimize`` and ``model.to`` change all of them): two probes a
    forward instead of one per layer."""
    probes = (len(layers), _probe(layers[0]), _probe(layers[-1])) if len(layers) else (0,)
    entry = _STACKS.get(layers)
    if entry is not None and entry[0] == probes and entry[1].fresh():
        return entry[1]
    plans = PlanStack([layer_plan(layer) for layer in layers])
    path = _INT8_STACKS.get(layers)
    if path is not None and plans.specs is not None:
        plans = PlanStack([_int8_plan(plan, layer, path) for plan, layer in zip(plans, layers)])
    _STACKS[layers] = (probes, plans)
    return plans


_INT8_STACKS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()  # layers -> int8 path


def read_as_int8(layers, path: str | None = None) -> None:
    """Have the fused calls read every projection of the decoder stack ``layers`` (a ModuleList of
    Llama decoder layers whose plans qualify) as int8 weights: W [N, K] -> q = round(W / s) per output
    row, s = max_k |W[n, k]| / 127 (:func:`pack_int8`), each input row quantised per row alike, the
    products summed exactly in int32 and scaled back (``few_rows_linear_i8``). Every row is computed
    alone, so a verification's rows still get what one-token steps get; the model's outputs are the
    int8 model's, not the float one's (a different model, for plain decoding as for every method).
    ``path``: how the kernel sums (:func:`int8_paths`; default the fastest here).

    Raises:
        ValueError: ``path`` does not run here, or a projection's shape does not fit the int8 kernel
            (N % 16, K % 4) or the stack is not fused here (:func:`layer_plan`).
    """
    path = int8_path(path)
    if not fused_enabled():
        raise ValueError("int8 weights need the fused C layers, which are off here (MMSPEC_FUSED=0 or "
                         "MMSPEC_ATTENTION other than c): unset those, or leave int8 off")
    for layer in layers:
        projections = _projections(_parts(layer))
        if layer_plan(layer) is None or projections is None:
            raise ValueError("int8 weights need the fused C layers (a Llama decoder stack of few-row linears on the CPU, "
                             "mmspec.optimize with kernel 'c')")
        if not all(int8_fits(m.weight) for m in projections):
            raise ValueError("int8 weights need every projection's outputs a multiple of 16 and inputs of 4")
    _INT8_STACKS[layers] = path
    _STACKS.pop(layers, None)


def int8_fits(weight: torch.Tensor) -> bool:
    """Whether the int8 kernel takes W [N, K] (:func:`pack_int8`): N % 16 == 0 and K % 4 == 0."""
    return not (weight.shape[0] % 16 or weight.shape[1] % 4)


def _projections(parts) -> tuple[nn.Module, ...] | None:
    """q, k, v, o, gate, up and down of a layer from its :func:`_parts`; None for a fused ``wqkv``
    layout (or no parts)."""
    return None if parts is None or len(parts[2]) != 3 else (*parts[2], *parts[3:7])


def reads_as_int8(layers) -> bool:
    """Whether :func:`read_as_int8` marked ``layers``."""
    return layers in _INT8_STACKS


def _int8_spec(spec: LayerSpec, linears, code: int) -> tuple[LayerSpec, tuple[torch.Tensor, ...]]:
    """A copy of ``spec`` whose q, k, v, o, gate, up and down (the first seven of ``linears``) are
    read from int8 blobs (:func:`pack_int8`) with kernel ``code``, and the blobs of every linear."""
    blobs = tuple(pack_int8(m.weight) for m in linears)
    copy = LayerSpec.from_buffer_copy(spec)
    copy.wq, copy.wk, copy.wv, copy.wo, copy.wg, copy.wu, copy.wd = (b.data_ptr() for b in blobs[:7])
    copy.linear = code
    return copy, blobs


def _int8_plan(plan: LayerPlan, layer: nn.Module, path: str) -> LayerPlan:
    """``plan`` (of ``layer``) reading its seven projections as int8 (:func:`read_as_int8`); stale
    once a projection's weight is updated in place."""
    linears = _projections(_parts(layer))
    spec, blobs = _int8_spec(plan.spec, linears, _int8_code(plan.dtype, path))
    weights = tuple(m.weight for m in linears)
    return LayerPlan(spec, (*plan.keep, *blobs), plan.max_rows, plan.dtype, plan.kv_heads, plan.head_dim, weights,
                     tuple(map(weight_version, weights)))


def fused_layers(plans: PlanStack, x: torch.Tensor, batch: int, n: int, cos: torch.Tensor, sin: torch.Tensor | None,
                 rope_stride: int, cache_layers, mask: torch.Tensor | None, norm: torch.Tensor | None = None,
                 eps: float = 0.0, start: int = 0, stop: int | None = None) -> None:
    """Run the layers ``start .. stop`` of ``plans`` (default all) over ``x`` [B n, D] (contiguous,
    the plans' dtype) in place, in one C call, and then, with ``norm`` [D] (the model's final
    RMSNorm weight, the plans' dtype), that norm. More rows than the plans take (B n > max_rows,
    n <= max_rows) run in one call per group of floor(max_rows / n) batch entries, bitwise the same.

    Args:
        cos, sin: transformers' rotary inputs [1 or B, n, hd] (model dtype), or LlamaGen's table
            [1 or B, n, hd / 2, 2] as ``cos`` (fp32) and None; ``rope_stride`` elements between
            batch entries (0: shared).
        cache_layers: the stack's :class:`~mmspec.core.cache.PreallocatedLayer` (n positions
            appended to each run).
        mask: None (a chain after the cache) or bool [1 or B, n, cached + n] contiguous.

    Raises:
        ValueError: a cache layer's buffers are not the layers' shape or dtype, or not all one shape.
        MemoryError: the kernel could not allocate its scratch.
    """
    stop = len(plans) if stop is None else stop
    first, count, layers = plans[start], stop - start, cache_layers[start:stop]
    slots = [layer.open_slots(batch, first.kv_heads, first.head_dim, first.dtype, n) for layer in layers]
    keys, _, cached = slots[0]
    if keys.shape[0] != batch or keys.shape[1] != first.kv_heads or keys.shape[3] != first.head_dim or keys.dtype != first.dtype:
        raise ValueError(f"the cache holds keys {tuple(keys.shape)} {keys.dtype}, not this layer's "
                         f"[{batch}, {first.kv_heads}, ., {first.head_dim}] {first.dtype}")  # (the kernel writes into it)
    if any(k.shape != keys.shape or k.dtype != keys.dtype or length != cached for k, _, length in slots[1:]):
        raise ValueError("the cache's layers hold buffers of different shapes or lengths")
    mask_b, mask_n = mask_strides(mask)
    pointers = ctypes.c_void_p * count
    specs = ctypes.addressof(plans.specs) + start * ctypes.sizeof(LayerSpec)
    # a batch of more rows than the plans take runs in groups of whole batch entries (each row is
    # computed alone by the kernel, so a group gives its rows bitwise what one call would): a
    # batch row then gets its batch-1 forward however wide the batch is
    group = max(1, min(p.max_rows for p in plans[start:stop]) // max(n, 1))
    width, item = x.shape[-1], x.element_size()
    for b0 in range(0, batch, group):
        rows = min(group, batch - b0)
        status = _function()(specs, count, x.data_ptr() + b0 * n * width * item, rows, n,
                             cos.data_ptr() + b0 * rope_stride * cos.element_size(),
                             None if sin is None else sin.data_ptr() + b0 * rope_stride * sin.element_size(), rope_stride,
                             pointers(*(k.data_ptr() + b0 * k.stride(0) * k.element_size() for k, _, _ in slots)),
                             pointers(*(v.data_ptr() + b0 * v.stride(0) * v.element_size() for _, v, _ in slots)),
                             keys.stride(0), keys.stride(1), keys.stride(2), cached,
                             None if mask is None else mask.data_ptr() + b0 * mask_b * mask.element_size(),
                             mask_b, mask_n, _ptr(norm), eps, torch.get_num_threads())
        if status:
            raise MemoryError("the fused layer kernel could not allocate its scratch")
    for layer in layers:
        layer.close_slots(n)


@functools.cache
def _chain_function():
    function = load_kernel().head_chain
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = ([pointer, pointer, ctypes.c_float, pointer, pointer, ctypes.c_int, pointer, pointer, ctypes.c_int, int64,
                          pointer, pointer, int64, pointer, pointer, int64, int64, pointer, pointer, pointer, pointer]
                         + [int64] * 5
                         + [ctypes.c_float, pointer, pointer, pointer, pointer, int64, ctypes.c_float, ctypes.c_int])
    function.restype = ctypes.c_int
    return function


def linear_operand(linear: nn.Module, dtype: torch.dtype) -> tuple[int, int] | None:
    """(the few-row kernel's code, the weight's address) through which a fused call reads
    ``linear`` in ``dtype`` (its packed copy where the bf16 kernel has one), or None where it cannot:
    not a :class:`FewRowLinear` on the C kernel with a contiguous CPU weight (and bias) of ``dtype``."""
    if (type(linear) is not FewRowLinear or linear.kernel != "c" or linear.weight.dtype != dtype or linear.weight.device.type != "cpu"
            or not linear.weight.is_contiguous()
            or (linear.bias is not None and (linear.bias.dtype != dtype or not linear.bias.is_contiguous()))):
        return None
    variants = bf16_variants() if dtype == torch.bfloat16 else fp32_variants() if dtype == torch.float32 else ()
    if not variants:
        return None
    packed = linear.packed_weight()
    return ((LinearKernel.variant(f"{variants[0]} packed"), packed.data_ptr()) if packed is not None
            else (LinearKernel.variant(variants[0]), linear.weight.data_ptr()))


def int8_fast() -> bool:
    """Whether the int8 kernel (``few_rows_linear_i8``) has its AVX512-VNNI path here."""
    return "avx512_vnni" in cpu_flags()


@functools.cache
def int8_amx() -> bool:
    """Whether the int8 kernel's fast path sums by AMX-INT8 tiles here (AVX512-VNNI and AMX-INT8,
    and Linux grants the tile state): the same integers as VNNI's, ~3x faster at 8-16 rows."""
    return int8_fast() and {"amx_int8", "amx_tile"} <= cpu_flags() and load_kernel().few_rows_amx_init() == 0


#: the int8 kernel's ways to sum by name -> its ``path`` argument (:class:`~mmspec.modeling.kernel_ids.Int8Path`,
#: the C ``enum i8_path``); the numbers are the same every way
INT8_PATHS = {path.label: path for path in Int8Path}


def int8_paths() -> tuple[str, ...]:
    """The int8 kernel's paths this CPU runs, the default first: "amx" (AMX-INT8 tiles, two rows or
    more; one row goes through VNNI), "vnni" (AVX512-VNNI), "avx2" (vpmaddwd over int16, for CPUs
    without VNNI), "scalar"."""
    paths = ("amx",) * int8_amx() + ("vnni",) * int8_fast() + ("avx2",) * ("avx2" in cpu_flags())
    return (*paths, "scalar")


def _int8_code(dtype: torch.dtype, path: str) -> int:
    """LayerSpec.linear's code of the int8 kernel for rows of ``dtype`` summed the way ``path``
    (:data:`INT8_PATHS`) names (:meth:`~mmspec.modeling.kernel_ids.LinearKernel.int8`)."""
    return LinearKernel.int8(INT8_PATHS[path], dtype == torch.bfloat16)


def int8_path(path: str | None) -> str:
    """``path`` checked against :func:`int8_paths` (None: its first)."""
    paths = int8_paths()
    if path is None:
        return paths[0]
    if path not in paths:
        raise ValueError(f"int8 path {path!r} does not run here; this CPU runs {paths}")
    return path


def int8_linear(x: torch.Tensor, blob: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, contiguous CPU) -> x W^T + b [M, N] in x's dtype through the int8
    kernel and a :func:`pack_int8` blob, summed the way ``path`` names (:func:`int8_paths`; default:
    the fastest here; the same numbers every way)."""
    m, k = x.shape
    path = int8_path(path)
    if (x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or not x.is_contiguous()
            or blob.dtype != torch.uint8 or blob.numel() != out_features * (k + 8) or out_features % 16 or k % 4
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != (out_features,) or not bias.is_contiguous()))):
        raise ValueError(f"int8_linear needs x [M, K] contiguous fp32 or bf16 on the CPU, a pack_int8 blob of an "
                         f"[{out_features}, {k}] weight (N % 16 == 0, K % 4 == 0) and a bias [{out_features}] of x's dtype")
    function = load_kernel().few_rows_linear_i8
    out = torch.empty(m, out_features, dtype=x.dtype)
    if function(x.data_ptr(), blob.data_ptr(), _ptr(bias), out.data_ptr(), m, out_features, k, int(x.dtype == torch.bfloat16),
                INT8_PATHS[path]):
        raise MemoryError("the int8 kernel could not allocate its scratch")
    return out


@dataclass
class Int8Head:
    """A one-layer head's specs with every projection (and ``fc``'s and the output's) read as int8
    (:func:`int8_head`): ``specs`` the C array :func:`head_chain` takes instead of the plans', ``fc``
    and ``output`` (kernel code, blob address; ``output`` None where the output linear is read as it
    is, by the caller's module: a copy cached per ``fc`` must not hold another drafter's output),
    ``keep`` the blobs, ``weights`` the weights they copy and ``versions`` theirs at packing."""

    specs: ctypes.Array
    fc: tuple[int, int]
    output: tuple[int, int] | None
    keep: tuple
    weights: tuple
    versions: tuple


_INT8: "weakref.WeakKeyDictionary[nn.Module, Int8Head]" = weakref.WeakKeyDictionary()  # fc -> its head's int8 copy


def int8_head(plans: PlanStack, layer: nn.Module, fc: nn.Module, output: nn.Module, path: str | None = None,
              parts_of: Callable[[nn.Module], tuple | None] = _parts) -> Int8Head | None:
    """``plans``' one layer (``layer``, whose parts ``parts_of`` gives: a Llama decoder layer's by
    default, an EAGLE-3 mid layer's with :func:`mmspec.modeling.eagle3.midlayer_parts`), ``fc`` and
    ``output`` with int8 weights for :func:`head_chain`, :func:`head_tree` and :func:`eagle3_tree`
    (built once per head and weights; ``path``: how the kernel sums, :func:`int8_paths`, default the
    fastest here), or None where a projection's shape does not fit the kernel (N % 16, K % 4;
    ``output`` stays as it is where it does not)."""
    projections = _projections(parts_of(layer))
    if len(plans) != 1 or projections is None:
        return None
    linears = (*projections, fc) + ((output,) if int8_fits(output.weight) else ())
    if not all(int8_fits(m.weight) for m in linears):
        return None
    code = _int8_code(plans[0].dtype, int8_path(path))
    weights = tuple(m.weight for m in linears)
    cached = _INT8.get(fc)
    if (cached is not None and len(cached.weights) == len(weights) and all(a is b for a, b in zip(cached.weights, weights))
            and _unchanged(weights, cached.versions) and cached.fc[0] == code):
        return cached
    spec, blobs = _int8_spec(plans[0].spec, linears, code)
    out = (spec.linear, blobs[8].data_ptr()) if len(blobs) > 8 else None  # (None: the caller reads ``output`` as it is)
    head = Int8Head((LayerSpec * 1)(spec), (spec.linear, blobs[7].data_ptr()), out, blobs, weights,
                    tuple(map(weight_version, weights)))
    _INT8[fc] = head
    return head


def chain_samples(sampling: SamplingConfig) -> bool:
    """Whether :func:`head_chain` draws as ``sampling`` asks: greedy, or a plain temperature (no
    top-k / top-p)."""
    return not sampling.do_sample or (not sampling.top_k and (sampling.top_p or 1.0) >= 1.0 and sampling.temperature > 0)


def chain_draws(sampling: SamplingConfig, generator: torch.Generator, k: int, width: int):
    """:func:`head_chain`'s draw arguments for ``k`` draws over ``width`` outputs under ``sampling``
    (:func:`chain_samples` holds): (temperature, uniforms [k] from ``generator``, zeros [k, width]
    for the distributions), or (0, None, None) for greedy picks."""
    if not sampling.do_sample:
        return 0.0, None, None
    return (sampling.temperature, torch.rand(k, dtype=torch.float32, generator=generator, device=generator.device).cpu(),
            torch.zeros(k, width, dtype=torch.float32))


def _head_operands(caller: str, plans: PlanStack, fc: nn.Module, output: nn.Module, codes: torch.Tensor, features: torch.Tensor,
                   table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int, ids: torch.Tensor | None,
                   int8: "Int8Head | None", align: torch.Tensor | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (kernel code, weight address) of ``fc`` and ``output`` for :func:`head_chain` /
    :func:`head_tree` (``int8``'s where given), after checking their operands.

    Raises:
        ValueError: a linear the fused call cannot read, or an operand of the wrong shape or dtype.
    """
    dtype, n0 = plans[0].dtype, codes.shape[0]
    width, hd = plans[0].spec.D, plans[0].head_dim
    align_rows = 0 if align is None else align.shape[0]
    operands = ((features, [n0, width]), (table, [table.shape[0], width]), (cos, [rows, hd]), (sin, [rows, hd]),
                (align, [align_rows, width]))
    fc_operand = int8.fc if int8 is not None else linear_operand(fc, dtype)
    out_operand = int8.output if int8 is not None and int8.output is not None else linear_operand(output, dtype)
    if (n0 < 1 or codes.dtype != torch.long or not codes.is_contiguous() or fc_operand is None or out_operand is None
            or (align is not None and not align_rows)
            or (table.shape[0] < output.out_features if ids is None
                else ids.dtype != torch.long or not ids.is_contiguous() or ids.shape != (output.out_features,))
            or any(t is not None and (list(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()) for t, shape in operands)):
        raise ValueError(f"{caller} needs fused fc and output linears, codes a LongTensor [n0 >= 1], ids None or a LongTensor "
                         f"[{output.out_features}] (else a table of as many rows) and features, table, align, cos, sin "
                         f"contiguous {dtype} tensors of shapes {[shape for _, shape in operands]}")
    return fc_operand, out_operand


def head_chain(plans: PlanStack, cache_layer: PreallocatedLayer, norm: torch.Tensor, eps: float, fc: nn.Module, output: nn.Module,
               codes: torch.Tensor, features: torch.Tensor, table: torch.Tensor, align: torch.Tensor | None, align_start: int,
               cos: torch.Tensor, sin: torch.Tensor, k: int, temperature: float, uniforms: torch.Tensor | None,
               probs: torch.Tensor | None, keep: int | None = None, ids: torch.Tensor | None = None,
               int8: Int8Head | None = None, stop_below: float = 0.0) -> torch.Tensor:
    """A one-layer feature head's chain of ``k`` draft codes in one C call (``head_chain`` in
    ``kernels/layer.c``): feed the pairs, then per code the output projection, the draw, and the
    next pair through ``fc``, the layer and its final norm (EAGLE: f^ = N(Layer(W_fc [e(x); f]))):

        f^ = last row of N(Layer(fc([e(codes); features])));  for i < k: x_i ~ softmax(output(f^) / T);
        f^ = N(Layer(fc([e(x_i); f^])))            with e(c) at the j-th position fed: table[c] + align[align_start + j]

    Args:
        plans: the head's one-layer :class:`PlanStack` (:func:`fused_plans`).
        cache_layer: its cache layer; the first ``keep`` pairs fed (default all) stay in it, the drafted
            codes' do not.
        norm, eps: the head's final RMSNorm. fc, output: [2D -> D] and [D -> C] linears
            (:func:`linear_operand` accepts them: the caller checks).
        codes: LongTensor [n0] (n0 >= 1; table rows) and features [n0, D]: the pairs to feed.
        table: [T, D] the inputs: row c for output c, or row ``ids[c]`` (``ids``: LongTensor [C] of
            table rows, a draft vocabulary's token ids); align: [R, D] rows added to the inputs of the positions fed
            (the pairs', then the drafted codes': row align_start + j, the last row past the end), or None.
        cos, sin: rotary rows [n0 + k - 1, hd] of those positions.
        temperature: the draws' T; 0: the first argmax (no ``probs``).
        uniforms: float32 [k], one number in [0, 1) per draw (sampling); probs: float32 [k, V >= C]
            zeros, whose first C columns receive the draws' distributions.
        int8: the head's layer, ``fc`` and ``output`` read as int8 (:func:`int8_head`): a drafter's
            own rounding, which the draws' distributions report.
        stop_below: end the chain after the first code i whose running confidence
            prod_{j <= i} q_j(x_j) (greedy: q = softmax(logits)) is below it (0: never); see
            :func:`mmspec.core.draft.chain_stops`.
    Returns:
        LongTensor [k'] (1 <= k' <= k): the codes drawn (``probs``' first k' rows filled).
    """
    n0, rows = codes.shape[0], codes.shape[0] + k - 1
    _check_draws("head_chain", k, temperature, uniforms, probs, output.out_features)
    fc_operand, out_operand = _head_operands("head_chain", plans, fc, output, codes, features, table, cos, sin, rows, ids, int8,
                                             align)
    dtype, hd, align_rows = plans[0].dtype, plans[0].head_dim, 0 if align is None else align.shape[0]
    keys, values, cached = cache_layer.open_slots(1, plans[0].kv_heads, hd, dtype, rows)
    tokens = torch.empty(k, dtype=torch.long)
    specs = plans.specs if int8 is None else int8.specs
    status = _chain_function()(
        ctypes.addressof(specs), norm.data_ptr(), eps, fc_operand[1], _ptr(fc.bias), fc_operand[0], out_operand[1],
        _ptr(output.bias), out_operand[0], output.out_features, codes.data_ptr(), features.data_ptr(), n0, table.data_ptr(),
        _ptr(align), align_start, align_rows, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
        keys.stride(0), keys.stride(1), keys.stride(2), cached, k, temperature, _ptr(uniforms), _ptr(ids), tokens.data_ptr(),
        _ptr(probs), 0 if probs is None else probs.stride(0), stop_below, torch.get_num_threads())
    if status < 0:
        raise MemoryError("the fused head chain could not allocate its scratch")
    cache_layer.close_slots(n0 if keep is None else keep)
    return tokens[:status]


def _eagle3_operands(caller: str, plan: LayerPlan, hidden_norm: torch.Tensor, norm: torch.Tensor, fc: nn.Module, output: nn.Module,
                     codes: torch.Tensor, features: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rotary_rows: int, int8: "Int8Head | None" = None
                     ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The fc and output operands (:func:`linear_operand`, or ``int8``'s where given) of an EAGLE-3
    head's C call (:func:`eagle3_chain`, :func:`eagle3_tree`), its other operands checked: ValueError
    naming ``caller`` where one is wrong."""
    dtype, hd, width = plan.dtype, plan.head_dim, plan.spec.D
    n0 = codes.shape[0]
    fc_operand = int8.fc if int8 is not None else linear_operand(fc, dtype)
    out_operand = int8.output if int8 is not None and int8.output is not None else linear_operand(output, dtype)
    shapes = ((features, [n0, fc.in_features]), (table, [table.shape[0], width]), (cos, [rotary_rows, hd]),
              (sin, [rotary_rows, hd]), (hidden_norm, [width]), (norm, [width]))
    if (n0 < 1 or codes.dtype != torch.long or not codes.is_contiguous() or fc_operand is None or out_operand is None
            or fc.bias is not None or output.bias is not None or fc.out_features != width or output.in_features != width
            or ids.dtype != torch.long or not ids.is_contiguous() or ids.shape != (output.out_features,) or plan.spec.rope
            or any(list(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() for t, shape in shapes)):
        raise ValueError(f"{caller} needs bias-free fused fc and output linears into / out of width {width}, codes a "
                         f"LongTensor [n0 >= 1], ids a LongTensor [{output.out_features}], and contiguous {dtype} tensors "
                         f"of shapes {[shape for _, shape in shapes]}")
    return fc_operand, out_operand


#: the leading arguments of layer.c's eagle3_chain and eagle3_tree (spec ... vbuf; the cache strides follow)
_EAGLE3_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] \
    + [ctypes.c_void_p] * 6


@functools.cache
def _eagle3_function():
    function = load_kernel().eagle3_chain
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = _EAGLE3_ARGS + [int64] * 5 + [ctypes.c_float, pointer, pointer, pointer, int64, ctypes.c_float, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def eagle3_chain(plan: LayerPlan, cache_layer: PreallocatedLayer, hidden_norm: torch.Tensor, norm_before_residual: bool,
                 norm: torch.Tensor, eps: float, fc: nn.Module, output: nn.Module, codes: torch.Tensor, features: torch.Tensor,
                 table: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: int, temperature: float,
                 uniforms: torch.Tensor | None, probs: torch.Tensor | None, stop_below: float = 0.0,
                 int8: Int8Head | None = None) -> torch.Tensor:
    """An EAGLE-3 head's chain of ``k`` draft indices in one C call (``eagle3_chain`` in
    ``kernels/layer.c``; the head: :class:`mmspec.modeling.eagle3.Eagle3Head`): the pairs fed with
    their target states fused by ``fc``, then per index the final norm and draft LM head, the draw,
    and the next step over [N1(e(x_i)); Nh(s^)] with the residual s^ (Nh(s^) where
    ``norm_before_residual``):

        s^ = last row of Layer3(e(codes), W_fc features);  for i < k: x_i ~ softmax(output(N(s^)) / T);
        s^ = Layer3(e(ids[x_i]), s^)

    Args:
        plan: the head layer's :class:`LayerPlan` (its q / k / v read 2 D inputs).
        cache_layer: its cache layer; the n0 pairs fed stay in it, the drafted indices' do not.
        hidden_norm: Nh's weight [D] (the layer's eps). norm, eps: the head's final norm.
        fc: [3 H_t -> D], output: [D -> C] bias-free linears (:func:`linear_operand` accepts them).
        codes: LongTensor [n0] (target ids) and features [n0, 3 H_t]: the pairs to feed.
        table: the target's embedding [V, D]; ids: LongTensor [C], each draft index's target id.
        cos, sin: rotary rows [n0 + k - 1, hd] of the positions fed.
        temperature, uniforms, probs, stop_below: as :func:`head_chain`'s.
        int8: as :func:`eagle3_tree`'s.

    Returns:
        LongTensor [k'] (1 <= k' <= k): the draft indices drawn.

    Raises:
        ValueError: an operand of the wrong shape or dtype, or a linear the call cannot read.
    """
    n0 = codes.shape[0]
    if k < 1:
        raise ValueError(f"eagle3_chain needs k >= 1, got {k}")
    fc_operand, out_operand = _eagle3_operands("eagle3_chain", plan, hidden_norm, norm, fc, output, codes, features, table,
                                               ids, cos, sin, n0 + k - 1, int8)
    dtype, hd = plan.dtype, plan.head_dim
    _check_draws("eagle3_chain", k, temperature, uniforms, probs, output.out_features)
    keys, values, cached = cache_layer.open_slots(1, plan.kv_heads, hd, dtype, n0 + k - 1)
    tokens = torch.empty(k, dtype=torch.long)
    status = _eagle3_function()(
        ctypes.addressof(plan.spec if int8 is None else int8.specs), hidden_norm.data_ptr(), int(norm_before_residual), norm.data_ptr(), eps, fc_operand[1],
        fc_operand[0], fc.in_features, out_operand[1], out_operand[0], output.out_features, codes.data_ptr(),
        features.data_ptr(), n0, table.data_ptr(), ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2), cached, k, temperature, _ptr(uniforms),
        tokens.data_ptr(), _ptr(probs), 0 if probs is None else probs.stride(0), stop_below, torch.get_num_threads())
    if status < 0:
        raise MemoryError("the fused EAGLE-3 chain could not allocate its scratch")
    cache_layer.close_slots(n0)
    return tokens[:status]


_EXPAND_RULE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_float)


@functools.cache
def _tree_function():
    function = load_kernel().head_tree
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = ([pointer, pointer, ctypes.c_float, pointer, pointer, ctypes.c_int, pointer, pointer, ctypes.c_int, int64,
                          pointer, pointer, int64, pointer, pointer, pointer, pointer, pointer, pointer]
                         + [int64] * 6 + [_EXPAND_RULE] + [pointer] * 5 + [ctypes.c_int])
    function.restype = ctypes.c_int
    return function


@dataclass
class GrownTree:
    """:func:`head_tree`'s candidates in creation order: ``tokens`` (output codes) and ``parents``
    (LongTensor [n], -1 for the root's children), ``scores`` (float32 [n], log V) and the number of
    tree ``layers`` grown."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    layers: int


def head_tree(plans: PlanStack, cache_layer: PreallocatedLayer, norm: torch.Tensor, eps: float, fc: nn.Module, output: nn.Module,
              codes: torch.Tensor, features: torch.Tensor, table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, depth: int,
              top_k: int, expand_while=None, ids: torch.Tensor | None = None, int8: Int8Head | None = None) -> GrownTree:
    """EAGLE-2's top-k dynamic tree (:func:`mmspec.core.tree.dynamic_tree`'s growth, before its
    rerank) from a one-layer feature head in one C call (``head_tree`` in ``kernels/layer.c``):
    feed the pairs as :func:`head_chain` does, then per layer expand the ``top_k`` best nodes of the
    last one by log V (V = product of the head's probabilities q = softmax(output(f^)) along the
    path), each node fed at depth d reading [e(x_u); f^(parent)] at the position after the pairs
    plus d - 1 and seeing the committed pairs, its fed ancestors and itself:

        V(child c of u) = V(u) q_u(c),  q_u = softmax(W_out N(Layer(W_fc [e(x_u); f^(parent u)])))

    The pairs fed stay in ``cache_layer``, the tree's nodes do not.

    Args:
        plans, cache_layer, norm, eps, fc, output, codes, features, table, ids, int8: as :func:`head_chain`'s.
        cos, sin: rotary rows [n0 + depth - 1, hd] of the positions after the cache's.
        depth: the deepest layer; top_k: nodes expanded per layer and children per node.
        expand_while: None or ``(best log V of the nodes about to be expanded) -> bool``, asked
            before every layer after the first (False stops the growth).
    Returns:
        :class:`GrownTree` (at most top_k + (depth - 1) top_k^2 candidates).
    """
    n0 = codes.shape[0]
    fc_operand, out_operand = _head_operands("head_tree", plans, fc, output, codes, features, table, cos, sin,
                                             n0 + depth - 1, ids, int8)
    if depth < 1 or top_k < 1:
        raise ValueError(f"head_tree needs depth >= 1 and top_k >= 1, got {depth} and {top_k}")
    dtype, hd, k = plans[0].dtype, plans[0].head_dim, min(top_k, output.out_features)
    keys, values, cached = cache_layer.open_slots(1, plans[0].kv_heads, hd, dtype, n0 + (depth - 1) * k)
    specs = plans.specs if int8 is None else int8.specs
    return _grown(lambda rule, tokens, parents, scores, counts: _tree_function()(
        ctypes.addressof(specs), norm.data_ptr(), eps, fc_operand[1], _ptr(fc.bias), fc_operand[0], out_operand[1],
        _ptr(output.bias), out_operand[0], output.out_features, codes.data_ptr(), features.data_ptr(), n0, table.data_ptr(),
        _ptr(ids), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        keys.stride(2), cached, depth, top_k, rule, tokens.data_ptr(), parents.data_ptr(), scores.data_ptr(), counts.data_ptr(),
        counts[1:].data_ptr(), torch.get_num_threads()), cache_layer, n0, k + (depth - 1) * k * k, expand_while, "head tree")


def _grown(call, cache_layer: PreallocatedLayer, n0: int, capacity: int, expand_while, name: str) -> GrownTree:
    """A tree's C call (:func:`head_tree`, :func:`eagle3_tree`): ``call(rule, tokens, parents, scores,
    counts)`` with the output buffers of ``capacity`` candidates and ``expand_while`` as the C
    callback; the head's cache closed after the n0 pairs fed, and an exception the rule raised raised
    again here (it cannot cross the C frames)."""
    tokens, parents = torch.empty(capacity, dtype=torch.long), torch.empty(capacity, dtype=torch.long)
    scores, counts = torch.empty(capacity), torch.zeros(2, dtype=torch.long)
    raised: list[BaseException] = []

    def rule(best: float) -> int:
        try:
            return int(bool(expand_while(best)))
        except BaseException as error:
            raised.append(error)
            return 0

    status = call(_EXPAND_RULE(rule) if expand_while is not None else _EXPAND_RULE(), tokens, parents, scores, counts)
    cache_layer.close_slots(n0)
    if raised:
        raise raised[0]
    if status:
        raise MemoryError(f"the fused {name} could not allocate its scratch")
    count = int(counts[0])
    return GrownTree(tokens[:count], parents[:count], scores[:count], int(counts[1]))


@functools.cache
def _eagle3_tree_function():
    function = load_kernel().eagle3_tree
    function.argtypes = _EAGLE3_ARGS + [ctypes.c_int64] * 6 + [_EXPAND_RULE] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def eagle3_tree(plan: LayerPlan, cache_layer: PreallocatedLayer, hidden_norm: torch.Tensor, norm_before_residual: bool,
                norm: torch.Tensor, eps: float, fc: nn.Module, output: nn.Module, codes: torch.Tensor, features: torch.Tensor,
                table: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, depth: int, top_k: int,
                expand_while=None, int8: Int8Head | None = None) -> GrownTree:
    """EAGLE-2's top-k dynamic tree from an EAGLE-3 head (:class:`mmspec.modeling.eagle3.Eagle3Head`)
    in one C call (``eagle3_tree`` in ``kernels/layer.c``): the pairs fed as :func:`eagle3_chain`
    feeds them, then :func:`head_tree`'s growth with EAGLE-3's step, node u at depth d reading
    [N1(e(ids[x_u])); Nh(s(parent u))] (the root's s^ for depth 1's nodes):

        V(child c of u) = V(u) q_u(c),  q_u = softmax(output(Nf(Layer3(e(ids[x_u]), s(parent u)))))

    The pairs fed stay in ``cache_layer``, the tree's nodes do not.

    Args:
        plan, cache_layer, hidden_norm, norm_before_residual, norm, eps, fc, output, codes, features,
            table, ids: as :func:`eagle3_chain`'s.
        cos, sin: rotary rows [n0 + depth - 1, hd] of the positions after the cache's.
        depth, top_k, expand_while: as :func:`head_tree`'s.
        int8: the head's int8 copy (:func:`int8_head` with the mid layer's parts), read instead of
            its layer, fc and output (where the copy holds one), or None.
    Returns:
        :class:`GrownTree` (draft indices; at most top_k + (depth - 1) top_k^2 candidates).
    """
    n0 = codes.shape[0]
    if depth < 1 or top_k < 1:
        raise ValueError(f"eagle3_tree needs depth >= 1 and top_k >= 1, got {depth} and {top_k}")
    fc_operand, out_operand = _eagle3_operands("eagle3_tree", plan, hidden_norm, norm, fc, output, codes, features, table, ids,
                                               cos, sin, n0 + depth - 1, int8)
    hd, k = plan.head_dim, min(top_k, output.out_features)
    keys, values, cached = cache_layer.open_slots(1, plan.kv_heads, hd, plan.dtype, n0 + (depth - 1) * k)
    spec = plan.spec if int8 is None else int8.specs
    return _grown(lambda rule, tokens, parents, scores, counts: _eagle3_tree_function()(
        ctypes.addressof(spec), hidden_norm.data_ptr(), int(norm_before_residual), norm.data_ptr(), eps, fc_operand[1],
        fc_operand[0], fc.in_features, out_operand[1], out_operand[0], output.out_features, codes.data_ptr(),
        features.data_ptr(), n0, table.data_ptr(), ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2), cached, depth, top_k, rule, tokens.data_ptr(),
        parents.data_ptr(), scores.data_ptr(), counts.data_ptr(), counts[1:].data_ptr(), torch.get_num_threads()),
        cache_layer, n0, k + (depth - 1) * k * k, expand_while, "EAGLE-3 tree")


@functools.cache
def _compact_function():
    function = load_kernel().compact_rows
    function.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64]
    function.restype = None
    return function


def compact_layers(layers, start: int, indices: torch.Tensor) -> bool:
    """:func:`mmspec.core.cache.compact_cache` in one C call (``kernels/layer.c``): for caches whose
    layers are all :class:`PreallocatedLayer` with contiguous CPU buffers of one shape and dtype,
    and strictly increasing ``indices`` inside the cached length. The same moves as the layers' own
    ``compact`` (30 layers of the captioner: ~0.7 ms of tensor operations -> ~20 us). False where it
    does not apply (the caller compacts layer by layer)."""
    if not layers or any(type(layer) is not PreallocatedLayer for layer in layers) or indices.device.type != "cpu" or not fused_enabled():
        return False
    first_keys, _, length = layers[0].buffers()
    if first_keys is None or first_keys.device.type != "cpu":
        return False
    offsets = indices.tolist()
    m = len(offsets)
    if any(b <= a for a, b in zip(offsets, offsets[1:])) or (m and (offsets[0] < 0 or start + offsets[-1] >= length)):
        return False
    buffers = []
    for layer in layers:
        keys, values, cached = layer.buffers()
        if (keys is None or cached != length or keys.shape != first_keys.shape or keys.dtype != first_keys.dtype
                or not keys.is_contiguous() or values.shape != keys.shape or values.dtype != keys.dtype or not values.is_contiguous()):
            return False
        buffers += [keys.data_ptr(), values.data_ptr()]
    batch, heads, capacity, head_dim = first_keys.shape
    row = head_dim * first_keys.element_size()
    moves = (ctypes.c_int64 * m)(*offsets)
    _compact_function()((ctypes.c_void_p * len(buffers))(*buffers), len(buffers), batch * heads, capacity * row, row, start,
                        moves, m)
    for layer in layers:
        layer.crop(start + m - length)
    return True


CACHE_COMPACTORS.append(compact_layers)
