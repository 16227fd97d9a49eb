"""A lean forward of transformers' ``LlamaModel`` for the few-token steps of speculative decoding.

A transformers decoder forward over 1-8 tokens of a small model carries framework work around the
arithmetic: mask construction, output capturing, keyword plumbing and per-layer wrappers (one
EAGLE head layer of SmolLM2's shape, one CPU core, weights in cache: 0.68 ms a call through
transformers, 0.58 ms here; the embedded voice decodes 4-11 % faster, docs/benchmarks.md).
:func:`lean_forward` runs the same model's own submodules
(its norms, projections, MLP and rotary embedding, so ``mmspec.optimize``'s few-row linears and
the weights are the model's) through the Llama decoder's arithmetic with nothing around it:

    h = x + W_o Attn(RoPE(W_q RMSNorm(x)), RoPE(W_k RMSNorm(x)), W_v RMSNorm(x))
    x' = h + W_down (act(W_gate RMSNorm(h)) * W_up RMSNorm(h)),   output RMSNorm(x_L)

with the keys and values appended to the model's cache (``cache.update``), so rollback, cropping
and tree compaction (:mod:`mmspec.core.cache`) work on it unchanged, and Attn through
:func:`mmspec.modeling.attention.attend` (on a CPU every query row alone: a verification's rows get
bitwise the outputs of one-token steps). It takes the masks mmspec's
drafters and targets pass: none (causal after the cache) or a 4-D additive or boolean mask
[B or 1, 1, n, cached + n]. :func:`lean_supported` says which models and masks it covers; the
callers (the codec LM, the EAGLE-family heads, and ``TransformersTarget``'s steps of a Llama
decoder, through :func:`lean_states`, which also keeps the hidden states of any layer) fall back to
the transformers forward elsewhere (2-D padding masks, other families, sliding windows; a caller
that wants a batch's rows computed alone turns its 2-D mask into the 4-D one with
:func:`padding_mask_4d`, as the codec LM does). Tests:
tests/test_lean.py (equal to the transformers forward).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .attention import attend, kernel_mask
from .fused import fused_layers, fused_plans, reads_as_int8

#: a prompt longer than the fused layers take at once runs through them in chunks of as many tokens
#: as they take, where that is at least this many (the packed vector kernels' 64 rows, the AMX
#: kernel's 128; the in-place kernels' 24-48 rows leave it to the modules and oneDNN). Each chunk
#: attends to the cache, which holds the chunks before it: the same causal forward.
PROMPT_CHUNK_ROWS = 64

#: the attention implementations whose arithmetic the lean forward reproduces
_ATTENTION = ("sdpa", "eager", None)


def lean_supported(model: nn.Module, attention_mask: torch.Tensor | None = None) -> bool:
    """True when :func:`lean_forward` computes ``model``'s forward: a transformers ``LlamaModel``
    (full attention, no dropout, the default rotary embedding) and a mask that is None or 4-D."""
    from transformers import LlamaModel

    if type(model) is not LlamaModel or attention_mask is not None and attention_mask.dim() != 4:
        return False
    config = model.config
    return (getattr(config, "_attn_implementation", None) in _ATTENTION and not getattr(config, "attention_dropout", 0.0)
            and getattr(model.rotary_emb, "rope_type", "default") == "default"
            and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"])))


def padding_mask_4d(attention_mask: torch.Tensor, n: int) -> torch.Tensor:
    """A transformers 2-D padding mask [B, L] (1: a slot the row holds; the last n columns are the
    new inputs) -> the boolean 4-D mask [B, 1, n, L] it stands for, which :func:`lean_states`
    takes: query i of row b attends to slot j iff ``attention_mask[b, j]`` and j <= L - n + i
    (causal among the new inputs).

    Why: batched decoding (:mod:`mmspec.core.batch`) passes the 2-D form, and a forward given it
    goes through transformers' attention, whose sums over a row's keys run in an order that depends
    on the other rows' padding; through this mask each row is attended alone by
    :func:`mmspec.modeling.attention.attend`, so a batch row gets bitwise its batch-1 output (bf16
    included: the issue-44 text-to-speech rows).
    """
    if attention_mask.dim() != 2 or not 0 < n <= attention_mask.shape[1]:
        raise ValueError(f"a 2-D padding mask [B, L] with L >= n = {n} is needed, got {tuple(attention_mask.shape)}")
    length = attention_mask.shape[1]
    causal = torch.ones(n, length, dtype=torch.bool, device=attention_mask.device).tril(length - n)
    return (attention_mask.bool()[:, None, :] & causal[None])[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x [B, heads, n, d] turned by cos, sin [B, 1, n, d]: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Llama decoder layer's attention inputs over x [B, n, H] (its input norm, then the
    projections): q [B, heads, n, d] and k [B, kv_heads, n, d] turned by cos, sin [B or 1, 1, n, d],
    and v [B, kv_heads, n, d]."""
    attn, (batch, n, _) = layer.self_attn, x.shape
    h = layer.input_layernorm(x)
    q = rotate(attn.q_proj(h).view(batch, n, heads, head_dim).transpose(1, 2), cos, sin)
    k = rotate(attn.k_proj(h).view(batch, n, kv_heads, head_dim).transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(h).view(batch, n, kv_heads, head_dim).transpose(1, 2)


def layer_output(layer: nn.Module, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a Llama decoder layer after its attention: x [B, n, H] plus the output
    projection of ``attended`` [B, n, heads * d], then plus the MLP (SwiGLU) of its norm."""
    attn, mlp = layer.self_attn, layer.mlp
    x = x + attn.o_proj(attended)
    h = layer.post_attention_layernorm(x)
    return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))


_ROTARY: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # rotary module -> (key, cos, sin)


def rotary(model: nn.Module, embeds: torch.Tensor, cached: int, position_ids: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.rotary_emb(embeds, position_ids)`` -> cos, sin [B or 1, n, head_dim] (contiguous),
    looked up in a table of every position up to the largest asked for so far (built by one call
    of the rotary module, grown by doubling). The same values: each position's angles are one
    product inv_freq * position, and cos / sin are element-wise (``position_ids`` None: the n
    positions after ``cached``). Off the CPU the module itself, as before: the table's size would
    need the positions on the host (a sync per step); with gradients on too."""
    module = model.rotary_emb
    n = embeds.shape[1]
    if embeds.device.type != "cpu" or torch.is_grad_enabled():  # (a table made under inference_mode is no autograd input)
        if position_ids is None:
            position_ids = torch.arange(cached, cached + n, device=embeds.device)[None]
        return module(embeds, position_ids)
    last = cached + n if position_ids is None else int(position_ids.max()) + 1
    key = (module.inv_freq.data_ptr(), embeds.dtype, embeds.device)
    entry = _ROTARY.get(module)
    if entry is None or entry[0] != key or entry[1].shape[1] < last:
        size = max(last, 2 * entry[1].shape[1] if entry is not None and entry[0] == key else 0, 256)
        cos, sin = module(embeds[:1, :1].expand(1, size, -1), torch.arange(size, device=embeds.device)[None])
        entry = _ROTARY[module] = (key, cos.contiguous(), sin.contiguous())
    if position_ids is None:
        return entry[1][:, cached : cached + n], entry[2][:, cached : cached + n]
    return entry[1][0][position_ids], entry[2][0][position_ids]


def lean_forward(model: nn.Module, embeds: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``model(inputs_embeds=embeds, ...).last_hidden_state`` for a model :func:`lean_supported`
    accepts (:func:`lean_states` without a kept layer)."""
    return lean_states(model, embeds, cache, position_ids, attention_mask)[0]


def lean_states(model: nn.Module, embeds: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, hidden_layer: int | tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The normed last hidden states and, with ``hidden_layer``, transformers'
    ``output_hidden_states=True`` entry of that index (0: the inputs, i: after i layers, -1 or the
    layer count: the normed output).

    Args:
        model: a transformers ``LlamaModel``.
        embeds: [B, n, H] inputs.
        cache: a transformers ``Cache`` (``mmspec.core.cache.make_cache``) the new keys and values
            are appended to, or None.
        position_ids: [B or 1, n] (default: cached length + 0 .. n - 1).
        attention_mask: None (causal after the cache) or 4-D [B or 1, 1, n, cached + n], additive
            (0 / -inf) or boolean (True: attend).
        hidden_layer: the hidden states to keep as well, or None; a tuple of indices keeps each of
            those entries, concatenated in the tuple's order (EAGLE-3's low / middle / high layers).

    Returns:
        (the normed last hidden states [B, n, H], the kept hidden states [B, n, H] (a tuple of k
        indices: [B, n, k H]) or None).
    """
    batch, n, _ = embeds.shape
    cached = cache.get_seq_length() if cache is not None else 0
    cos, sin = rotary(model, embeds, cached, position_ids)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    wanted = None if hidden_layer is None else hidden_layer if isinstance(hidden_layer, tuple) else (hidden_layer,)
    keep = None if wanted is None else [range(layers + 1)[i] for i in wanted]  # IndexError for a layer out of range
    inner = sorted({i for i in keep or () if i < layers})  # the kept states before the final norm
    stack = model.layers if layers == len(model.layers) else model.layers[:layers]
    # a batch asks for plans that take one entry's n rows: fused_layers runs wider batches in groups
    plans, chunk = fused_plans(stack, cache, n if batch > 1 else batch * n, embeds.dtype, embeds.device), n or 1
    if plans is None and attention_mask is None and position_ids is None:
        plans = fused_plans(stack, cache, 1, embeds.dtype, embeds.device)  # a long causal prompt, in chunks
        chunk = min(p.max_rows for p in plans) if plans is not None else 0
        plans = plans if chunk >= PROMPT_CHUNK_ROWS else None
    mask = None if plans is None or attention_mask is None else kernel_mask(attention_mask, batch, n, cached + n)
    if plans is not None and (attention_mask is None or mask is not None) and cos.dtype == embeds.dtype:
        x, kept = embeds.clone(memory_format=torch.contiguous_format), None  # [B, n, H]
        rope_stride = n * head_dim if cos.shape[0] > 1 else 0
        norm = model.norm.weight if model.norm.weight.dtype == x.dtype else None
        saved = {i: torch.empty_like(x) for i in inner}  # the layers up to each kept state, then the rest
        for first in range(0, n, chunk):  # (one chunk but for a long causal prompt: its tokens in turn)
            last = min(first + chunk, n)
            c, s = cos[:, first:last], None if sin is None else sin[:, first:last]
            rows = x[:, first:last].contiguous().view(batch * (last - first), -1)  # (x's memory: one chunk or entry)
            start = 0
            for split in inner:
                if split > start:
                    fused_layers(plans, rows, batch, last - first, c, s, rope_stride, cache.layers, mask, start=start, stop=split)
                saved[split][:, first:last] = rows.view(batch, last - first, -1)
                start = split
            fused_layers(plans, rows, batch, last - first, c, s, rope_stride, cache.layers, mask, norm,
                         model.norm.variance_epsilon, start=start)
            if rows.data_ptr() != x.data_ptr() + first * x.stride(1) * x.element_size():  # a batch's chunk, copied
                x[:, first:last] = rows.view(batch, last - first, -1)
        x = x if norm is not None else model.norm(x)
        return x, _kept(x, saved, keep, layers, isinstance(hidden_layer, tuple))
    if reads_as_int8(model.layers):  # (its PyTorch modules hold the float weights: another model)
        return _int8_chunks(model, stack, embeds, cache, position_ids, attention_mask, hidden_layer)
    cos, sin = cos[:, None], sin[:, None]
    x, saved = embeds, {}
    for index, layer in enumerate(model.layers[:layers]):
        if index in inner:
            saved[index] = x
        q, k, v = attention_inputs(layer, x, cos, sin, heads, kv_heads, head_dim)
        if cache is not None:
            k, v = cache.update(k, v, index)
        o = attend(q, k, v, attention_mask, layer.self_attn.scaling)  # [B, n, heads, head_dim]
        x = layer_output(layer, x, o.reshape(batch, n, heads * head_dim))
    x = model.norm(x)
    return x, _kept(x, saved, keep, layers, isinstance(hidden_layer, tuple))


def _int8_chunks(model: nn.Module, stack, embeds: torch.Tensor, cache, position_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, hidden_layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lean_states` of a stack read as int8 (:func:`~mmspec.modeling.fused.read_as_int8`,
    whose PyTorch modules hold the float weights) over more rows than its fused layers take at once
    (a long or batched prompt): its n tokens in chunks of as many as they take, each appended to the
    cache before the next attends to it. With a mask [B or 1, 1, n, cached + n], chunk rows
    a:b read columns :cached + b; a mask that lets a row attend to a later token is refused.

    Raises:
        ValueError: the fused layers cannot take even one chunk, or the mask is not causal.
    """
    batch, n, _ = embeds.shape
    plans = fused_plans(stack, cache, 1, embeds.dtype, embeds.device)
    chunk = min(p.max_rows for p in plans) if plans is not None else n
    cached = cache.get_seq_length() if cache is not None else 0
    if chunk >= n:
        raise ValueError(f"this int8 model runs only through the fused C layers, which cannot take this forward "
                         f"({batch} x {n} rows, {embeds.dtype}, {embeds.device}, mask {attention_mask is not None}): "
                         "load it without int8")
    allowed = None if attention_mask is None else kernel_mask(attention_mask, batch, n, cached + n)  # [B or 1, n, L]
    if attention_mask is not None and allowed is None:
        raise ValueError(f"this int8 model takes a mask of shape [B or 1, 1, n, cached + n] (here [{batch} or 1, 1, {n}, "
                         f"{cached + n}]), got {tuple(attention_mask.shape)}")
    parts = []
    for first in range(0, n, chunk):
        last = min(first + chunk, n)
        mask = None
        if allowed is not None:
            if allowed[:, first:last, cached + last :].any():
                raise ValueError("this int8 model takes a forward longer than its fused layers' rows only in causal "
                                 "chunks, and this mask lets a token attend to a later one: load it without int8")
            mask = allowed[:, None, first:last, : cached + last]
        positions = None if position_ids is None else position_ids[:, first:last]
        parts.append(lean_states(model, embeds[:, first:last], cache, positions, mask, hidden_layer))
    kept = None if parts[0][1] is None else torch.cat([k for _, k in parts], dim=1)
    return torch.cat([x for x, _ in parts], dim=1), kept


def _kept(last: torch.Tensor, saved: dict[int, torch.Tensor], keep: list[int] | None, layers: int, several: bool
          ) -> torch.Tensor | None:
    """:func:`lean_states`' kept states: entry i of ``keep`` is ``saved[i]`` (the input of layer i)
    or ``last`` (the normed output, i = ``layers``); one tensor, or with ``several`` their
    concatenation [B, n, k H]."""
    if keep is None:
        return None
    states = [last if i == layers else saved[i] for i in keep]
    return torch.cat(states, dim=-1) if several else states[0]
