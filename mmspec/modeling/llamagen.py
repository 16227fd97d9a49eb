"""A LlamaGen-style text-conditioned AR image-token transformer (Sun et al. 2024).

Architecture and parameter names follow LlamaGen's ``Transformer`` (``model_type="t2i"``), so an
official LlamaGen state dict loads with :meth:`LlamaGenModel.load_official`:

    tok_embeddings [V, D]; cls_embedding.cap_proj.{fc1,fc2} (caption MLP) and
    cls_embedding.uncond_embedding [P, C] (the null caption for classifier-free guidance);
    layers.{i}.attention.{wqkv,wo}, layers.{i}.feed_forward.{w1,w2,w3},
    layers.{i}.{attention_norm,ffn_norm}.weight (RMSNorm); norm.weight; output [V, D].

The sequence is [P caption positions, image tokens 0 .. N-1] (N = grid^2): the caption features
[B, P, C] (from a frozen text encoder) pass through the caption MLP, the image tokens through
``tok_embeddings``; 2-D rotary embeddings give image token i the (row, column) = divmod(i, grid)
rotation. LlamaGen gives the caption positions all-zero rotary factors (cos = sin = 0, which zeroes
their queries and keys); ``rope_prefix="identity"`` (cos = 1, sin = 0) keeps their keys, which the
embedded model uses so image tokens can attend to caption tokens by content.

Attention goes through a transformers ``Cache`` (``past_key_values``), so the core's
:class:`~mmspec.core.cache.SequenceState` rolls it back like any transformers model's cache;
an optional additive attention mask [B, 1, n, cache + n] carries token trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend, kernel_mask
from .fused import fused_layers, fused_plans, register_layout
from .persistence import DataclassModel

CONFIG_FILE = "llamagen_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class LlamaGenConfig:
    """LlamaGen's ``ModelArgs`` (t2i). Defaults: LlamaGen-XL t2i (775M) with a 16x16 grid."""

    dim: int = 1536
    n_layer: int = 36
    n_head: int = 24
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    cls_token_num: int = 120
    caption_dim: int = 2048
    block_size: int = 256
    rope_prefix: str = "zero"  # "zero" (official LlamaGen) or "identity"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        return int(round(self.block_size**0.5))

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table_2d(config: LlamaGenConfig) -> torch.Tensor:
    """Rotary factors [P + N, head_dim // 2, 2] (cos, sin) for every position of the sequence.

    Each head's first half of rotary pairs turns with the row, the second half with the column,
    with frequencies base^(-2j / (head_dim / 2)).
    """
    half = config.head_dim // 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    grid = config.grid_size
    angles = torch.outer(torch.arange(grid).float(), freqs)  # [grid, half/2]
    per_cell = torch.cat([angles[:, None, :].expand(grid, grid, -1), angles[None, :, :].expand(grid, grid, -1)], dim=-1)
    image = torch.stack([per_cell.cos(), per_cell.sin()], dim=-1).reshape(grid * grid, half, 2)
    prefix = torch.zeros(config.cls_token_num, half, 2)
    if config.rope_prefix == "identity":
        prefix[..., 0] = 1.0
    elif config.rope_prefix != "zero":
        raise ValueError(f"rope_prefix must be 'zero' or 'identity', got {config.rope_prefix!r}")
    return torch.cat([prefix, image])


def chain_mask_after_cache(num_inputs: int, cached: int, device) -> torch.Tensor | None:
    """Boolean attention mask [n, cached + n] (True = attend) of a chain of n inputs appended to
    ``cached`` positions: input i sees the cache and inputs <= i. None where SDPA's own causal flag
    is right (no cache) or no mask is needed (one input)."""
    if cached == 0 or num_inputs <= 1:
        return None
    return torch.ones(num_inputs, cached + num_inputs, dtype=torch.bool, device=device).tril(cached)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, n, H, hd], table [n, hd/2, 2] (or [B, n, hd/2, 2]: each row at its own positions) ->
    x with consecutive dimension pairs rotated."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = table if table.dim() == 4 else table[None]
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    rotated = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], -1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaGenConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        total = (config.n_head + 2 * config.kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, rope, cache=None, mask=None):
        c = self.config
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).split([c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = apply_rope(q.view(b, n, c.n_head, c.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(b, n, c.kv_heads, c.head_dim), rope).transpose(1, 2)
        v = v.view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = attend(q, k, v, mask)  # [b, n, heads, head_dim]
        return self.wo(out.reshape(b, n, c.dim))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaGenConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention = Attention(config, layer_idx)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, cache=None, mask=None):
        x = x + self.attention(self.attention_norm(x), rope, cache, mask)
        return x + self.feed_forward(self.ffn_norm(x))


@register_layout(TransformerBlock)
def _block_parts(layer: TransformerBlock) -> tuple:
    """The block as the fused layer reads it (:func:`mmspec.modeling.fused.register_layout`): one
    fused qkv projection, consecutive-pair rotary embedding (rope 1)."""
    c = layer.attention.config
    return (layer.attention_norm.weight, layer.ffn_norm.weight, [layer.attention.wqkv], layer.attention.wo,
            layer.feed_forward.w1, layer.feed_forward.w3, layer.feed_forward.w2, layer.attention_norm.eps,
            layer.ffn_norm.eps, c.n_head, c.kv_heads, c.head_dim, c.head_dim**-0.5, 1)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Caption features [B, P, C] -> [B, P, D]; ``uncond_embedding`` [P, C] is the null caption."""

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(config.caption_dim, config.dim)
        self.uncond_embedding = nn.Parameter(torch.randn(config.cls_token_num, config.caption_dim) / config.caption_dim**0.5)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(caption)


@dataclass
class LlamaGenOutput:
    logits: torch.Tensor  # [B, n, V]
    hidden_states: torch.Tensor | None = None  # [B, n, D], after the final norm


class LlamaGenModel(DataclassModel, nn.Module):
    """forward(image_tokens [B, n], caption [B, P, C] | None, past_key_values, attention_mask)."""

    config_class, config_file, weights_file, kind = LlamaGenConfig, CONFIG_FILE, WEIGHTS_FILE, "LlamaGen"
    save_dtype, load_dtype = torch.bfloat16, torch.bfloat16

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.cls_embedding = CaptionEmbedder(config)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rope", rope_table_2d(config), persistent=False)

    @property
    def max_length(self) -> int:
        return self.config.cls_token_num + self.config.block_size

    def null_caption(self, batch: int) -> torch.Tensor:
        """[batch, P, C] the unconditional caption."""
        return self.cls_embedding.uncond_embedding.unsqueeze(0).expand(batch, -1, -1)

    def forward(
        self,
        image_tokens: torch.Tensor | None = None,
        caption: torch.Tensor | None = None,
        past_key_values=None,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> LlamaGenOutput:
        """Run [caption (if given), image tokens] after the cached positions.

        Args:
            image_tokens: LongTensor [B, n] (or None / empty with a caption: prefill only).
            caption: [B, P, C] caption features (prefill; P = cls_token_num).
            past_key_values: a transformers Cache or None (training: full causal attention).
            attention_mask: bool [B or 1, 1, q, cache + q] (True = attend) for token trees and batches; None =
                causal (built once here for all layers when inputs follow a cache).
            positions: LongTensor [q] (or [B, q]) sequence positions of the q inputs (rotary table rows); default
                the next q positions after the cache.
        """
        parts = []
        if caption is not None:
            parts.append(self.cls_embedding(caption.to(self.output.weight.dtype)))
        if image_tokens is not None and image_tokens.numel():
            parts.append(self.tok_embeddings(image_tokens))
        x = torch.cat(parts, dim=1)
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        if positions is None:
            positions = torch.arange(start, start + x.shape[1], device=x.device)
        # (no host sync while a CUDA graph is captured: a captured caller checks positions itself)
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and int(positions.max()) >= self.max_length:
            raise ValueError(f"position {int(positions.max())} beyond the model's {self.max_length} positions")
        rope = self.rope[positions]
        batch, n, _ = x.shape
        plans = fused_plans(self.layers, past_key_values, batch * n, x.dtype, x.device)
        mask = None if plans is None or attention_mask is None else kernel_mask(attention_mask, batch, n, start + n)
        if plans is not None and (attention_mask is None or mask is not None):  # whole layers in C (None: a chain)
            flat, table = x.reshape(batch * n, -1).clone(), rope.float().contiguous()
            stride = n * self.config.head_dim if table.dim() == 4 else 0
            fused_layers(plans, flat, batch, n, table, None, stride, past_key_values.layers, mask)
            x = flat.view(batch, n, -1)
        else:
            if attention_mask is None:  # built once here for every layer
                attention_mask = chain_mask_after_cache(x.shape[1], start, x.device)
            for layer in self.layers:
                x = layer(x, rope, past_key_values, attention_mask)
        x = self.norm(x)
        return LlamaGenOutput(self.output(x).float(), x if output_hidden_states else None)

    @classmethod
    def load_official(cls, checkpoint: str | Path, config: LlamaGenConfig) -> "LlamaGenModel":
        """Load an official LlamaGen t2i checkpoint (``t2i_XL_stage1_256.pt``: its "model" entry)
        with ``torch.load(weights_only=True)``; ``config`` must match it (e.g. LlamaGenConfig()
        for LlamaGen-XL)."""
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        for key in ("model", "module", "state_dict"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
        state = {k: v for k, v in state.items() if k != "freqs_cis"}
        model = cls(config)
        model.load_state_dict(state)
        return model.eval()
