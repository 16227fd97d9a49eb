"""Batch-invariant attention for decoding steps and verifications on a CPU.

A verification forward over n draft tokens must give each of them the logits a one-token step
would, or greedy speculative decoding is no longer plain decoding. The few-row linears
(:mod:`mmspec.modeling.fast_linear`) sum in one fixed order; PyTorch's CPU attention does not: it
blocks its work by the number of queries, and in bf16 a chain of 16 tokens on the embedded
captioner got logits up to 0.75 away from 16 one-token steps, which changed its greedy captions
(docs/benchmarks.md). :func:`attend` computes every query row alone, in one order that depends only
on the keys the row may see (``kernels/attention.c``):

    out_i = sum_{c < m_i} softmax_c(scale q_i . k_{j_c}) v_{j_c},

with j_0 < ... < j_{m_i - 1} the keys query i attends (a tree node: the cached prefix, then its
ancestors), so a node gets bitwise what the same tokens get as a chain or as one-token steps.
``MMSPEC_ATTENTION=sdpa`` takes PyTorch's attention instead (one choice per process: a generation
must use one attention for its plain decoding and its verifications alike); CUDA tensors, fp16,
head dimensions over 256 and training (gradients) always take it.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..cpu import cpu_flags
from .fast_linear import KernelUnavailable, load_kernel

#: the values of MMSPEC_ATTENTION
BACKENDS = ("c", "sdpa")
#: the largest head dimension the kernel takes (kernels/attention.c)
MAX_HEAD_DIM = 256


@functools.cache
def attention_backend() -> str:
    """"c" (the batch-invariant kernel, where it builds) or "sdpa"; ``MMSPEC_ATTENTION`` picks.

    Raises:
        ValueError: ``MMSPEC_ATTENTION`` names no backend, or "c" where the kernel cannot be built.
    """
    wanted = os.environ.get("MMSPEC_ATTENTION", "")
    if wanted and wanted not in BACKENDS:
        raise ValueError(f"MMSPEC_ATTENTION={wanted!r}: name one of {', '.join(BACKENDS)}, or unset it")
    if wanted == "sdpa":
        return "sdpa"
    try:
        load_kernel()
    except KernelUnavailable as error:
        if wanted == "c":
            raise ValueError(f"MMSPEC_ATTENTION=c: {error}") from None
        return "sdpa"
    return "c"


def kernel_mask(mask: torch.Tensor, batch: int, n: int, length: int) -> torch.Tensor | None:
    """A 2-D [n, L] or 4-D [B or 1, 1, n, L] mask, boolean (True: attend) or additive (0 / -inf)
    -> contiguous bool [B or 1, n, L]; None where its shape does not fit."""
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (n, length) or mask.shape[0] not in (1, batch):
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0].contiguous()


def mask_strides(mask: torch.Tensor | None) -> tuple[int, int]:
    """The kernels' (batch, query) element strides of a :func:`kernel_mask` mask (0: shared by
    the batch; (0, 0) for none)."""
    if mask is None:
        return 0, 0
    return (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(1)


def _uses_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype == v.dtype
            and q.shape[-1] <= MAX_HEAD_DIM and q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.stride() == v.stride()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and attention_backend() == "c")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Attention of queries after a cache.

    Args:
        q: [B, H, n, d] queries (any strides, the last dimension contiguous).
        k, v: [B, Hkv, L, d] keys and values, the cache included (H a multiple of Hkv: grouped).
        mask: None (a chain after the cache: query i sees keys j <= L - n + i), or [n, L] /
            [B or 1, 1, n, L], boolean (True: attend) or additive (0 / -inf).
        scale: the score scale (default d^-1/2).

    Returns:
        [B, n, H, d] (the layout the output projection reads).
    """
    batch, heads, n, dim = q.shape
    length = k.shape[2]
    scale = dim**-0.5 if scale is None else float(scale)
    if _uses_kernel(q, k, v):
        allowed = None if mask is None else kernel_mask(mask, batch, n, length)
        if mask is None or allowed is not None:
            return few_rows_attention(q, k, v, allowed, scale)
    causal = False
    if mask is None and n > 1:
        if length > n:
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        else:
            causal = True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != heads)
    return out.transpose(1, 2)


def few_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, variant: str | None = None) -> torch.Tensor:
    """The C kernel (module doc): q [B, H, n, d], k / v [B, Hkv, L, d] (fp32 or bf16, CPU, the last
    dimension contiguous), mask None (a chain after the cache) or bool [B or 1, n, L] contiguous
    -> [B, n, H, d]. ``variant``: "avx512" or "avx2" (default: AVX-512 where the CPU has it; both
    compute the same values)."""
    library = load_kernel()
    batch, heads, n, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    if variant is None:
        variant = "avx512" if "avx512f" in cpu_flags() else "avx2"
    function = library.few_rows_attention_avx512 if variant == "avx512" else library.few_rows_attention
    out = torch.empty(batch, n, heads, dim, dtype=q.dtype)
    mask_b, mask_n = mask_strides(mask)
    status = function(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
                      batch, heads, kv_heads, n, length, dim, q.stride(0), q.stride(1), q.stride(2),
                      k.stride(0), k.stride(1), k.stride(2), mask_b, mask_n, scale, int(q.dtype == torch.bfloat16))
    if status:
        raise MemoryError(f"the attention kernel could not allocate its scratch for {length} keys")
    return out
