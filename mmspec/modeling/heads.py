"""The trained parts of mmspec's feature-level drafters (the drafting logic is in
:mod:`mmspec.drafters`):

- :class:`EagleHead` (EAGLE, Li et al., 2024): at position t, from the target's last hidden state
  f_t [H] and the embedding of the next token e(x_{t+1}),
  ``f^_{t+1} = Norm(Layer(W_fc [e(x_{t+1}); f_t]))`` with one decoder layer of the target's family.
- :class:`VisionEagleHead` (ViSpec-style vision-aware drafting, Kang et al., 2025): an EAGLE head
  that also reads the target's features at the prompt's image tokens, compressed by a
  :class:`VisionAdaptor` into k prefix positions of its layer and a global feature added to its
  input at every position.
- :class:`KangarooAdapter` (Kangaroo, Liu et al., 2024): one decoder layer + norm turning the
  target's shallow states s_t into states its LM head reads.
- :class:`DraftHeads` (Medusa, Cai et al., 2024; Hydra, Ankner et al., 2024): head i predicts
  x_{t+2+i} from ``h_i = f_t + SiLU(W_i f_t + b_i)`` (Medusa) or from
  ``g_i = U_i [f_t; e(x_{t+1}); ...; e(x_{t+1+i})]``, ``h_i = g_i + SiLU(W_i g_i + b_i)`` (Hydra).
- :class:`ImageEagleHead`: EAGLE's head for image-token generators, one LlamaGen block whose rotary
  embedding turns with the code's (row, column) on the grid.

Every head reuses the target's token embedding and LM head (never stored) and is saved as a JSON
config + safetensors weights through :mod:`mmspec.modeling.persistence`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .attention import kernel_mask
from .fused import fused_layers, fused_plans
from .hf_compat import cache_kwargs
from .lean import lean_forward, lean_supported
from .llamagen import LlamaGenConfig, RMSNorm, TransformerBlock, chain_mask_after_cache, rope_table_2d
from .persistence import load_weights, read_config, save_module


def _place_like(module: nn.Module, target_model: nn.Module) -> nn.Module:
    """``module`` on the device and in the dtype of ``target_model``'s parameters."""
    param = next(target_model.parameters())
    return module.to(device=param.device, dtype=param.dtype)


# ============================================================================ one decoder layer
def _llama_layer_config(config):
    """A LlamaConfig of ``config``'s widths, rotary and norm: the self-attention layer of a text model
    that transformers' AutoModel cannot build on its own (Mllama's, whose self-attention layers are
    Llama layers between its cross-attention ones)."""
    from transformers import LlamaConfig

    names = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
             "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "head_dim")
    fields = {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}
    return LlamaConfig(**fields, num_hidden_layers=1, tie_word_embeddings=False)


def _gemma4_layer_config(config):
    """Gemma 4's decoder config for one layer of its own: full attention (a one-layer Gemma 4 model
    must end with a full-attention layer), no KV sharing (nothing to share with) and no per-layer
    input embeddings (they are looked up by token id, which a head's inputs are not)."""
    config = copy.deepcopy(config)
    config.layer_types = ["full_attention"]
    config.num_kv_shared_layers = 0
    config.hidden_size_per_layer_input = 0
    config.vocab_size_per_layer_input = 0
    return config


#: text model_type -> the config of the one decoder layer an EAGLE / Kangaroo head builds for it,
#: for text models AutoModel cannot build alone
HEAD_LAYER_CONFIGS = {"mllama_text_model": _llama_layer_config, "gemma4_text": _gemma4_layer_config}


def trained_for_another(method: str, were: str = "it was") -> str:
    """The end of the line refusing a saved head that does not fit the target (another model's)."""
    return (f": {were} trained for another model; train one for this model with `mmspec train drafter --method {method} "
            "--target PATH --data DATA`")


class OneLayerHead(nn.Module):
    """One decoder layer of the target's family (+ its final norm) reading embeddings: the trained
    part of feature-level drafters. Subclasses define what goes in.

    Args:
        text_config: the target decoder's config (its family, width, heads, rope); the head uses
            one layer of it and no vocabulary of its own.
        intermediate_size: the layer's MLP width (default: the target's); a narrower MLP reads
            fewer weight bytes per drafted token.
    """

    method = "eagle"
    config_file = "eagle_config.json"
    weights_file = "eagle_head.safetensors"
    #: run the layer through :func:`~mmspec.modeling.lean.lean_forward` where it applies (a Llama
    #: layer: 10-16 % less per call at these widths, equal outputs); False: transformers' forward
    lean = True

    def __init__(self, text_config, intermediate_size: int | None = None) -> None:
        super().__init__()
        from transformers import AutoModel

        config = copy.deepcopy(text_config)
        if getattr(config, "model_type", None) in HEAD_LAYER_CONFIGS:
            config = HEAD_LAYER_CONFIGS[config.model_type](config)
        config.num_hidden_layers = 1
        if intermediate_size is not None:
            config.intermediate_size = intermediate_size
        config.vocab_size = 1  # inputs arrive as embeddings; the target's embedding table is shared
        config.pad_token_id = None
        if hasattr(config, "layer_types") and config.layer_types:
            # the family's first attention layer: a hybrid decoder's first layers are recurrent
            # (Qwen3.5's Gated DeltaNet, LFM2's short convolutions), which a head cannot use
            attention = [t for t in config.layer_types if t.endswith("attention") and t != "linear_attention"]
            config.layer_types = (attention or config.layer_types)[:1]
        self.config = config
        self.decoder = AutoModel.from_config(config)

    def run_decoder(self, inputs: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """inputs [B, n, H] -> the layer's normed outputs [B, n, H]."""
        if self.lean and lean_supported(self.decoder, attention_mask):
            return lean_forward(self.decoder, inputs, cache, position_ids, attention_mask)
        return self.decoder(inputs_embeds=inputs, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=cache is not None, **cache_kwargs(self.decoder, cache)).last_hidden_state

    def save(self, directory: str | Path, **card) -> None:
        """Write the head (its weights in their current dtype) and ``card`` (extra JSON fields)."""
        save_module(self, directory, {"text_config": self.config.to_dict(), **card}, self.config_file, self.weights_file)

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module):
        """Load a head saved by :meth:`save` for ``target_model`` (checks the widths match); the
        class built is the one the saved card names (:meth:`from_card`)."""
        card = read_config(directory, cls.config_file,
                           f"no {cls.method} head in {directory} ({cls.config_file} missing); "
                           f"train one with `mmspec train drafter --method {cls.method}`")
        saved = card["text_config"]
        target_config = target_model.config.get_text_config(decoder=True)
        if saved["hidden_size"] != target_config.hidden_size:
            raise ValueError(f"the {cls.method} head in {directory} has width {saved['hidden_size']}, the target {target_config.hidden_size}"
                             f"{trained_for_another(cls.method)}")
        # (None: the target's own MLP sizes; a MoE text config such as Qwen3.5-MoE's has no intermediate_size)
        head = cls.from_card(card, target_config, saved.get("intermediate_size"))
        return _place_like(load_weights(head, directory, cls.weights_file), target_model)

    @classmethod
    def from_card(cls, card: dict, text_config, intermediate_size: int | None) -> "OneLayerHead":
        """An untrained head of the saved ``card``'s kind and shape (for :meth:`load`)."""
        return cls(text_config, intermediate_size)


class EagleHead(OneLayerHead):
    """fc [2H -> H] over [token embedding; target feature], then the decoder layer and norm."""

    def __init__(self, text_config, intermediate_size: int | None = None) -> None:
        super().__init__(text_config, intermediate_size)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [B, n, H]; token_embeds: [B or 1, n, H]; position_ids: [1, n]; attention_mask:
        None (causal) or a 4-D additive mask [1, 1, n, cached + n] -> predicted next features [B, n, H]."""
        token_embeds = token_embeds.expand(features.shape[0], -1, -1)
        return self.run_decoder(self.fc(torch.cat([token_embeds, features], dim=-1)), cache, position_ids, attention_mask)

    @classmethod
    def from_card(cls, card: dict, text_config, intermediate_size: int | None) -> "EagleHead":
        """A head saved with the vision option (``vision_tokens`` in its card) is a :class:`VisionEagleHead`."""
        if card.get("vision_tokens"):
            return VisionEagleHead(text_config, intermediate_size, card["vision_tokens"])
        return cls(text_config, intermediate_size)


@dataclass
class VisionContext:
    """What a :class:`VisionEagleHead` reads of one generation's images (B rows, one per sequence).

    prefix: [B, k, H] the compressed image tokens, the head layer's first k positions (keys and
        values only: nothing is predicted there);
    bias: [B, 1, H] the projected global image feature, added to the head's input at every position.
    """

    prefix: torch.Tensor
    bias: torch.Tensor


class VisionAdaptor(nn.Module):
    """ViSpec's vision adaptor (Kang et al., 2025), over the target's features at the image tokens.

    With V [B, m, H] those features, V' = RMSNorm(V), Q [k, H] learned queries:

        C = Q + Attn(Q, V', V')          [B, k, H]  (one multi-head cross-attention, W_q W_k W_v W_o)
        g = W_g mean_m(V') + b_g         [B, 1, H]  (W_g, b_g start at zero)

    C becomes k prefix positions of the head's layer, g is added to its input at every position.
    A single decoder layer over m image tokens spreads its attention over redundant patches;
    k learned queries pick out what the text that follows needs, and g keeps the image in view
    however long the answer gets (the paper's two mechanisms).
    """

    def __init__(self, hidden_size: int, tokens: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        if tokens < 1:
            raise ValueError(f"vision tokens must be at least 1, got {tokens}")
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.queries = nn.Parameter(torch.randn(tokens, hidden_size) * 0.02)
        self.attention = nn.MultiheadAttention(hidden_size, heads, batch_first=True)
        self.global_proj = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.global_proj.weight)  # the head starts as the plain EAGLE head plus k prefix positions
        nn.init.zeros_(self.global_proj.bias)

    def forward(self, image_features: torch.Tensor, valid: torch.Tensor | None = None) -> VisionContext:
        """image_features [B, m, H] (m >= 1); valid: BoolTensor [B, m] (False: padding) or None
        -> :class:`VisionContext` (prefix [B, k, H], bias [B, 1, H])."""
        v = self.norm(image_features.to(self.queries.dtype))
        queries = self.queries[None].expand(v.shape[0], -1, -1)
        attended, _ = self.attention(queries, v, v, key_padding_mask=None if valid is None else ~valid, need_weights=False)
        if valid is None:
            pooled = v.mean(dim=1, keepdim=True)
        else:
            weights = valid.to(v.dtype)[..., None]
            pooled = (v * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp_min(1)
        return VisionContext(prefix=queries + attended, bias=self.global_proj(pooled))


def with_plain_weights(extended: nn.Module, head: nn.Module) -> nn.Module:
    """A new vision-aware head ``extended`` with every weight of the plain ``head`` copied in (in
    its dtype); only the adaptor (``vision.*``) stays new. Raises ValueError where the two differ
    otherwise."""
    extended = extended.to(next(head.parameters()).dtype)
    missing, unexpected = extended.load_state_dict(head.state_dict(), strict=False)
    if unexpected or any(not name.startswith("vision.") for name in missing):
        raise ValueError(f"cannot extend this head with the vision option (unexpected {unexpected}, missing {missing})")
    return extended


class VisionEagleHead(EagleHead):
    """:class:`EagleHead` with the vision option: ``f^_{t+1} = Norm(Layer(W_fc [e(x_{t+1}); f_t] + g))``
    where the layer also attends to k prefix positions C (:class:`VisionAdaptor`) at positions
    0..k-1, the pairs following at positions k, k+1, .... Off (plain EAGLE) unless trained with
    ``mmspec train drafter --vision-tokens K``; the card records ``vision_tokens``.

    Args:
        text_config, intermediate_size: as :class:`EagleHead`'s.
        vision_tokens: k, the compressed image tokens.
    """

    def __init__(self, text_config, intermediate_size: int | None = None, vision_tokens: int = 4) -> None:
        super().__init__(text_config, intermediate_size)
        config = self.config
        self.vision_tokens = vision_tokens
        self.vision = VisionAdaptor(config.hidden_size, vision_tokens, config.num_attention_heads, getattr(config, "rms_norm_eps", 1e-6))

    @classmethod
    def extend(cls, head: EagleHead, vision_tokens: int) -> "VisionEagleHead":
        """A vision-aware head starting from a trained plain ``head`` (its fc, layer and norm
        copied; the adaptor new, its global projection zero)."""
        return with_plain_weights(cls(head.config, head.config.intermediate_size, vision_tokens), head)

    def vision_context(self, image_features: torch.Tensor, valid: torch.Tensor | None = None) -> VisionContext:
        """The adaptor over the target's features at the image tokens [B, m, H] (see :class:`VisionAdaptor`)."""
        return self.vision(image_features, valid)

    def write_prefix(self, context: VisionContext, cache) -> None:
        """Feed the prefix C to the layer at positions 0..k-1 (their keys and values enter ``cache``,
        which must be empty)."""
        positions = torch.arange(self.vision_tokens, device=context.prefix.device)[None]
        self.run_decoder(context.prefix.to(self.fc.weight.dtype), cache, positions, None)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, vision: VisionContext | None = None) -> torch.Tensor:
        """As :meth:`EagleHead.forward`, with ``vision.bias`` [B, 1, H] added to the layer's input
        (None: no image in this prompt, the plain head). The prefix is in ``cache`` already
        (:meth:`write_prefix`); position_ids count it (pair t at position k + t)."""
        x = self.fc(torch.cat([token_embeds.expand(features.shape[0], -1, -1), features], dim=-1))
        if vision is not None:
            x = x + vision.bias.to(x.dtype)
        return self.run_decoder(x, cache, position_ids, attention_mask)

    def teacher_forced(self, features: torch.Tensor, token_embeds: torch.Tensor, vision: VisionContext | None) -> torch.Tensor:
        """Training's forward without a cache: pairs features [B, n, H], token_embeds [B, n, H]
        at positions k..k+n-1 after the prefix (causal) -> predicted features [B, n, H]."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        if vision is None:
            positions = torch.arange(self.vision_tokens, self.vision_tokens + x.shape[1], device=x.device)[None]
            return self.run_decoder(x, None, positions.expand(x.shape[0], -1), None)
        x = torch.cat([vision.prefix.to(x.dtype), x + vision.bias.to(x.dtype)], dim=1)
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return self.run_decoder(x, None, positions, None)[:, self.vision_tokens :]

    def save(self, directory: str | Path, **card) -> None:
        super().save(directory, vision_tokens=self.vision_tokens, **card)


class KangarooAdapter(OneLayerHead):
    """The adapter: shallow states [B, n, H] -> states the LM head reads [B, n, H]."""

    method = "kangaroo"
    config_file = "kangaroo_config.json"
    weights_file = "kangaroo_adapter.safetensors"

    def forward(self, shallow: torch.Tensor, cache, position_ids: torch.Tensor) -> torch.Tensor:
        return self.run_decoder(shallow, cache, position_ids, None)


# ============================================================================== Medusa / Hydra
class ResidualBlock(nn.Module):
    """x [..., H] -> x + SiLU(W x + b); W starts at zero (the identity)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # a head starts as the identity: LMHead(f) = the target's next token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class DraftHeads(nn.Module):
    """M Medusa (``kind="medusa"``) or Hydra (``kind="hydra"``) heads of width H."""

    config_file = "heads_config.json"
    weights_file = "heads.safetensors"

    def __init__(self, hidden_size: int, num_heads: int = 4, kind: str = "medusa") -> None:
        super().__init__()
        if kind not in ("medusa", "hydra"):
            raise ValueError(f"kind must be 'medusa' or 'hydra', got {kind!r}")
        self.hidden_size, self.num_heads, self.kind = hidden_size, num_heads, kind
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        if kind == "hydra":
            # input: [f; e(x_{t+1}); ...; e(x_{t+i})]; starts as "look at f only"
            self.inputs = nn.ModuleList(nn.Linear((i + 2) * hidden_size, hidden_size, bias=False) for i in range(num_heads))
            for projection in self.inputs:
                with torch.no_grad():
                    projection.weight.zero_()
                    projection.weight[:, :hidden_size] = torch.eye(hidden_size)

    def head_state(self, i: int, features: torch.Tensor, prefix_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Head i (0-based, predicts x_{t+2+i}) on features [..., H] and, for Hydra, the embeddings of
        x_{t+1} .. x_{t+1+i} as prefix_embeds [..., i+1, H] -> [..., H] (apply the LM head next)."""
        if self.kind == "hydra":
            features = self.inputs[i](torch.cat([features, prefix_embeds.flatten(-2)], dim=-1))
        return self.blocks[i](features)

    def save(self, directory: str | Path, **card) -> None:
        """Write the heads (weights in their current dtype) and ``card`` (extra JSON fields)."""
        config = {"kind": self.kind, "hidden_size": self.hidden_size, "num_heads": self.num_heads}
        save_module(self, directory, {**config, **card}, self.config_file, self.weights_file)

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module, kind: str) -> "DraftHeads":
        """Load ``kind`` heads saved by :meth:`save` for ``target_model`` (checks kind and width)."""
        config = read_config(directory, cls.config_file, f"no {kind} heads in {directory} ({cls.config_file} missing); "
                                                         f"train them with `mmspec train drafter --method {kind}`")
        if config["kind"] != kind:
            raise ValueError(f"{directory} holds {config['kind']} heads, not {kind}")
        width = target_model.get_output_embeddings().weight.shape[1]
        if config["hidden_size"] != width:
            raise ValueError(f"the heads in {directory} have width {config['hidden_size']}, the target {width}"
                             f"{trained_for_another(kind, 'they were')}")
        heads = cls(config["hidden_size"], config["num_heads"], kind)
        return _place_like(load_weights(heads, directory, cls.weights_file), target_model)


# =================================================================================== image EAGLE
@dataclass
class ImageEagleConfig:
    """dim: the target's hidden size; grid: its (rows, columns) of codes."""

    dim: int
    n_head: int
    grid: tuple[int, int]
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def block_config(self) -> LlamaGenConfig:
        side = max(self.grid)
        return LlamaGenConfig(dim=self.dim, n_layer=1, n_head=self.n_head, vocab_size=1, cls_token_num=0, caption_dim=1,
                              block_size=side * side, rope_base=self.rope_base, norm_eps=self.norm_eps, rope_prefix="identity")


def target_width(target) -> int:
    """The hidden size of a guided image target (the width of its code embeddings)."""
    probe = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    return int(target.embed_codes(probe).shape[-1])


class ImageEagleHead(nn.Module):
    """fc [2D -> D] over [code embedding; target feature], one LlamaGen block, a norm:

        f^_i = Norm(Block(W_fc [e(x_i); f_{i-1}]))

    with the block's rotary embedding at code i's (row, column)."""

    config_file = "image_eagle_config.json"
    weights_file = "image_eagle_head.safetensors"

    def __init__(self, config: ImageEagleConfig) -> None:
        super().__init__()
        self.config = config
        block_config = config.block_config()
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.block = TransformerBlock(block_config, 0)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        rows, columns = config.grid
        side = max(rows, columns)
        cells = torch.arange(rows * columns)
        self.register_buffer("rope", rope_table_2d(block_config)[(cells // columns) * side + cells % columns], persistent=False)
        # the block as a one-layer stack for the fused layers (not registered: the block's parameters are its own)
        object.__setattr__(self, "_stack", nn.ModuleList([self.block]))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [R, n, D]; token_embeds: [R or 1, n, D]; position_ids: [1, n] or [n] grid
        indices of the codes; attention_mask: None (causal after the cache) or additive
        [1, 1, n, cached + n] -> predicted features [R, n, D]."""
        x = self.fc(torch.cat([token_embeds.expand(features.shape[0], -1, -1), features], dim=-1))
        rope = self.rope[position_ids.reshape(-1)]
        batch, n, _ = x.shape
        cached = cache.get_seq_length() if cache is not None else 0
        plans = fused_plans(self._stack, cache, batch * n, x.dtype, x.device)
        mask = None if plans is None or attention_mask is None else kernel_mask(attention_mask, batch, n, cached + n)
        if plans is not None and (attention_mask is None or mask is not None):  # the block in C (None: a chain)
            flat = x.reshape(batch * n, -1).contiguous()
            fused_layers(plans, flat, batch, n, rope.float().contiguous(), None, 0, cache.layers, mask)
            return self.norm(flat.view(batch, n, -1))
        if attention_mask is None:
            attention_mask = chain_mask_after_cache(n, cached, x.device)
        return self.norm(self.block(x, rope, cache, attention_mask))

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16, **card) -> None:
        """Write the head in ``dtype`` and ``card`` (extra JSON fields)."""
        save_module(self, directory, {**asdict(self.config), **card}, self.config_file, self.weights_file, dtype)

    @classmethod
    def load(cls, directory: str | Path, target) -> "ImageEagleHead":
        """Load a head for ``target`` (a GuidedImageTarget); checks width and grid."""
        saved = read_config(directory, cls.config_file, f"no image EAGLE head in {directory} ({cls.config_file} missing); "
                                                        "train one with `mmspec train image-drafter`")
        config = ImageEagleConfig(dim=saved["dim"], n_head=saved["n_head"], grid=tuple(saved["grid"]),
                                  rope_base=saved.get("rope_base", 10000.0), norm_eps=saved.get("norm_eps", 1e-5))
        width = target_width(target)
        if config.dim != width or config.grid != tuple(target.grid):
            raise ValueError(f"the image EAGLE head in {directory} is for width {config.dim} and grid {config.grid}; "
                             f"the target has width {width} and grid {tuple(target.grid)}")
        return load_weights(cls(config), directory, cls.weights_file, device=target.device, dtype=target.dtype)
