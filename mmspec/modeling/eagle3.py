"""The EAGLE-3 head (Li et al., 2025, arXiv 2503.01840) in the tensor layout vLLM and SGLang load.

At position t the target's states of three layers (low / middle / high: transformers'
``hidden_states`` entries ``aux_layers``, by default (2, L // 2, L - 3)) are fused into one
feature, and one decoder layer reads it beside the embedding of the next token:

    g_t = W_fc [a_t; b_t; c_t]                                      (fc: 3 H_t -> H, no bias)
    u   = [RMSNorm_in(e(x_{t+1})); RMSNorm_hidden(g_t)]             (2 H: q / k / v read 2 H)
    r   = g_t + W_o Attn(u)          (residual: g_t, or with ``norm_before_residual`` its norm)
    s   = r + MLP(RMSNorm_post(r))                                  (the next step's feature)
    logits_{t+2} = W_lm RMSNorm(s)          (draft vocabulary: N rows; target id = j + d2t[j])

Drafting continues on the layer's own un-normed output s in place of g (no fc then). Unlike
EAGLE-1/2 the head predicts tokens directly (no feature loss) over a reduced vocabulary of N
frequent target tokens: ``d2t`` [N] (int64) maps draft index j to target id ``j + d2t[j]``,
``t2d`` [V] (bool) marks the target ids inside the draft vocabulary. The token embedding is the
target's (not stored).

Parameter names are those of the EAGLE-3 checkpoints vLLM (``Eagle3LlamaForCausalLM``) and SGLang
(``LlamaForCausalLMEagle3``) load: ``fc.weight``, ``midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
:mod:`mmspec.drafters.eagle3` drafts with it; :mod:`mmspec.train.eagle3` trains it.

:class:`VisionEagle3Head` is the head with ViSpec's vision option (Kang et al., 2025; EAGLE's
version: :class:`~mmspec.modeling.heads.VisionEagleHead`): the fused target states at the prompt's
image tokens, V = fc(states) [m, H], go through a :class:`~mmspec.modeling.heads.VisionAdaptor`
to k compressed tokens C [k, H], fed as k prefix positions of the mid layer (in the feature slot of
u, the embedding slot zero: keys and values only), and a global feature g [H] added to the
feature at every position: u = [RMSNorm_in(e); RMSNorm_hidden(g_t + g)], r = g_t + g + W_o Attn(u).
The engines load no such adaptor, so a vision-aware head is not exported.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .attention import attend
from .heads import (DraftHeads, EagleHead, KangarooAdapter, VisionAdaptor, VisionContext, trained_for_another,
                    with_plain_weights)
from .persistence import save_module, save_tensors

#: mmspec's own files of an EAGLE-3 head
CONFIG_FILE, WEIGHTS_FILE = "eagle3_config.json", "eagle3_head.safetensors"
#: the serving engines' files and the architecture name each loads the head by
ENGINE_CONFIG_FILE, ENGINE_WEIGHTS_FILE = "config.json", "model.safetensors"
ENGINE_ARCHITECTURES = {"vllm-eagle3": "Eagle3LlamaForCausalLM", "sglang-eagle3": "LlamaForCausalLMEagle3"}


def check_export_directory(directory: str | Path) -> None:
    """Raise ValueError (one line) where ``directory`` is neither new, empty nor an earlier engine
    export (its ``config.json`` naming an EAGLE-3 architecture): writing there would replace or mix
    with what the export did not write (a model's files, an mmspec head's own directory)."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).is_file():
        raise ValueError(f"{directory} holds an mmspec EAGLE-3 head ({CONFIG_FILE}); export into a new directory")
    config, weights = directory / ENGINE_CONFIG_FILE, directory / ENGINE_WEIGHTS_FILE
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    try:
        architectures = set(json.loads(config.read_text()).get("architectures") or []) if config.is_file() else set()
    except (OSError, ValueError, AttributeError):
        architectures = set()
    if architectures & set(ENGINE_ARCHITECTURES.values()):
        return  # an earlier export: replaced
    held = (f"a model's {ENGINE_CONFIG_FILE if config.is_file() else ENGINE_WEIGHTS_FILE} that is no EAGLE-3 export"
            if config.is_file() or weights.is_file() else "other files")
    raise ValueError(f"{directory} holds {held}; exporting would mix them with the head's files (or overwrite them): "
                     "pass a new or empty directory as --out")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers as ``hidden_states`` indices: (2, L // 2, L - 3), the
    engines' default, clamped into 0 .. L for shallow (test) targets."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclass
class Eagle3Config:
    """The head's shapes. ``hidden_size`` H is the head's width (the target's embedding width),
    ``target_hidden_size`` H_t the width of the fused target states, ``vocab_size`` V the target's,
    ``draft_vocab_size`` N; ``aux_layers``: the target's ``hidden_states`` indices fused by fc."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False

    def check(self, path: str | Path) -> None:
        """One ValueError line naming ``path`` (the config file read) for a field of the wrong type
        or range (an edited config); ``aux_layers`` becomes a tuple."""
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}: {name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{path}: {name} must be a positive number, got {value!r}")
        layers = self.aux_layers
        if (not isinstance(layers, (list, tuple)) or not layers
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)):
            where = "aux_layers" if Path(path).name == CONFIG_FILE else "the target layer ids"
            raise ValueError(f"{path}: {where} must be a list of layer indices (integers >= 0), got {layers!r}")
        self.aux_layers = tuple(layers)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"{path}: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{path}: num_attention_heads {self.num_attention_heads} is no multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if not isinstance(self.hidden_act, str) or not callable(getattr(F, "silu" if self.hidden_act == "swish" else self.hidden_act, None)):
            raise ValueError(f"{path}: hidden_act {self.hidden_act!r} is no activation (silu, gelu, ...)")

    @classmethod
    def for_target(cls, text_config, draft_vocab_size: int | None = None, aux_layers: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Config":
        """A head for a transformers decoder config (its width, heads, rope base)."""
        heads = text_config.num_attention_heads
        rope = getattr(text_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(text_config, "rope_theta", None) or 10000.0
        vocab = text_config.vocab_size
        return cls(hidden_size=text_config.hidden_size, intermediate_size=intermediate_size or text_config.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads, vocab_size=vocab,
                   draft_vocab_size=draft_vocab_size or vocab, target_hidden_size=text_config.hidden_size,
                   aux_layers=tuple(aux_layers or default_aux_layers(text_config.num_hidden_layers)),
                   rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6), rope_theta=float(theta),
                   max_position_embeddings=getattr(text_config, "max_position_embeddings", 4096) or 4096,
                   hidden_act=getattr(text_config, "hidden_act", "silu"))

    # ------------------------------------------------------------------ the engines' config.json
    def engine_config(self, fmt: str, dtype: torch.dtype) -> dict:
        """The ``config.json`` of ``fmt`` (a key of :data:`ENGINE_ARCHITECTURES`): a one-layer Llama
        config plus EAGLE-3's fields. Layer ids: vLLM reads top-level
        ``eagle_aux_hidden_state_layer_ids`` as ``hidden_states`` indices (the state entering layer
        i); SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as layer *outputs* and adds 1."""
        if fmt not in ENGINE_ARCHITECTURES:
            raise ValueError(f"unknown export format {fmt!r}; use one of {sorted(ENGINE_ARCHITECTURES)}")
        config = {"architectures": [ENGINE_ARCHITECTURES[fmt]], "model_type": "llama", "num_hidden_layers": 1,
                  "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                  "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                  "head_dim": self.head_dim, "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
                  "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
                  "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                  "target_hidden_size": self.target_hidden_size, "norm_before_residual": self.norm_before_residual,
                  "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}
        if fmt == "vllm-eagle3":
            config["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
        else:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers],
                                      "use_aux_hidden_state": True}
        return config

    @classmethod
    def from_engine_config(cls, config: dict, target_layers: int | None) -> "Eagle3Config":
        """Read an engine's ``config.json`` (:meth:`engine_config`'s, or an EAGLE-3 checkpoint trained
        elsewhere: the official repo's, SpecForge's). Layer ids as :meth:`engine_config` writes
        them; none given: :func:`default_aux_layers` of the target's ``target_layers``."""
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"this EAGLE-3 head has {config['num_hidden_layers']} layers; mmspec runs one-layer heads")
        if config.get("eagle_aux_hidden_state_layer_ids"):
            aux = tuple(config["eagle_aux_hidden_state_layer_ids"])
        elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            aux = tuple(i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        elif target_layers:
            aux = default_aux_layers(target_layers)
        else:
            raise ValueError("this EAGLE-3 config names no target layers (eagle_aux_hidden_state_layer_ids); load it "
                             "with its target, whose depth gives the default (2, L // 2, L - 3)")
        heads = config["num_attention_heads"]
        rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"], num_attention_heads=heads,
                   num_key_value_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config["vocab_size"],
                   draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
                   target_hidden_size=config.get("target_hidden_size") or config["hidden_size"], aux_layers=aux,
                   rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                   rope_theta=float(rope) if isinstance(rope, (int, float)) else rope,  # (else: check() names it)
                   max_position_embeddings=config.get("max_position_embeddings", 4096),
                   hidden_act=config.get("hidden_act", "silu"), norm_before_residual=bool(config.get("norm_before_residual", False)))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, computed in fp32 (Llama's)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = getattr(F, c.hidden_act if c.hidden_act != "swish" else "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    """The one decoder layer (``midlayer.*``)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def midlayer_parts(layer: _MidLayer) -> tuple | None:
    """The mid layer's parts as :func:`mmspec.modeling.fused.layer_plan` reads a layer's (norm1: the
    token embeddings' input norm; q / k / v over [N1(e); Nh(g)], 2 D inputs), or None for an
    activation other than SiLU."""
    attn, mlp = layer.self_attn, layer.mlp
    if mlp.act is not F.silu:
        return None
    return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, [attn.q_proj, attn.k_proj, attn.v_proj],
            attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, layer.input_layernorm.eps,
            layer.post_attention_layernorm.eps, attn.heads, attn.kv_heads, attn.head_dim, attn.head_dim**-0.5, 0)


class Eagle3Head(nn.Module):
    """fc, the mid layer, norm and the draft LM head (see the module docstring for the formula).

    Args:
        config: the head's :class:`Eagle3Config`.
    """

    method = "eagle3"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        if 3 * config.target_hidden_size == config.hidden_size:
            raise ValueError("an EAGLE-3 head whose width is 3x the target's cannot tell fused target states from its own")
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocabulary(torch.arange(config.draft_vocab_size))
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # ------------------------------------------------------------------ vocabulary maps
    def set_draft_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Set d2t / t2d for the draft vocabulary ``token_ids`` [N] (target ids, distinct; draft
        index j is ``token_ids[j]``): d2t[j] = token_ids[j] - j, t2d[token_ids] = True."""
        token_ids = token_ids.to(self.d2t.device, torch.long)
        if token_ids.shape != self.d2t.shape or len(set(token_ids.tolist())) != len(token_ids):
            raise ValueError(f"the draft vocabulary must be {self.d2t.shape[0]} distinct token ids, got {tuple(token_ids.shape)}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0 .. {self.config.vocab_size - 1}")
        with torch.no_grad():
            self.d2t.copy_(token_ids - torch.arange(len(token_ids), device=token_ids.device))
            self.t2d.zero_()
            self.t2d[token_ids] = True

    @property
    def token_ids(self) -> torch.Tensor:
        """The target id of each draft index [N]: j + d2t[j]."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ forward
    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """Concatenated target states [..., 3 H_t] -> g [..., H] (fc)."""
        return self.fc(states)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, vision: VisionContext | None = None) -> torch.Tensor:
        """One head step.

        Args:
            features: [B, n, 3 H_t] concatenated target states (fused by fc first) or [B, n, H] the
                head's own earlier outputs s.
            token_embeds: [B or 1, n, H] embeddings of the next tokens.
            cache: a transformers-style cache (``update(k, v, 0)``, ``get_seq_length()``) or None.
            position_ids: [1, n] positions of the inputs.
            attention_mask: None (causal after the cache) or boolean / additive [1 or B, 1, n, cached + n].
            vision: a :class:`VisionEagle3Head`'s image context (its ``bias`` [B, 1, H] added to the
                feature), or None.

        Returns:
            s [B, n, H], the un-normed output (the next step's feature; logits: :meth:`logits`).
        """
        q, k, v, residual = self.project(features, token_embeds, position_ids, None if vision is None else vision.bias)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        return self.finish(q, k, v, attention_mask, residual)

    def project(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                bias: torch.Tensor | None = None):
        """The layer up to attention: (q [B, heads, n, hd], k, v [B, kv heads, n, hd] rotated at
        ``position_ids``, the residual [B, n, H]); features as :meth:`forward` takes them, plus
        ``bias`` [B, 1, H] (a vision-aware head's global image feature) when given."""
        if features.shape[-1] != self.config.hidden_size:
            features = self.fuse(features)
        if bias is not None:
            features = features + bias.to(features.dtype)
        batch, n, _ = features.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        embeds = layer.input_layernorm(token_embeds.expand(batch, -1, -1))
        normed = layer.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        u = torch.cat([embeds, normed], dim=-1)
        cos, sin = (t[:, None] for t in self.rotary(position_ids, u.dtype))  # [1 or B, 1, n, hd]
        q = _rotate(attn.q_proj(u).view(batch, n, attn.heads, attn.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(attn.k_proj(u).view(batch, n, attn.kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
        v = attn.v_proj(u).view(batch, n, attn.kv_heads, attn.head_dim).transpose(1, 2)
        return q, k, v, residual

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [..., n] -> cos, sin [..., n, hd] in ``dtype`` (rotate-half layout: angles
        p * inv_freq, repeated for both halves, computed in fp32)."""
        angles = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def finish(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        """Attention of q over keys / values k, v [B, kv heads, m, hd] under the mask [.., n, m]
        (boolean, or additive; None: a chain after the cache), then o_proj + residual and the MLP
        block -> s [B, n, H]. Drafting on a CPU takes mmspec's few-row attention
        (:func:`~mmspec.modeling.attention.attend`; PyTorch's spent ~0.28 ms on one query row of the
        embedded captioner's head, over half of its step), training PyTorch's."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        batch, n = residual.shape[:2]
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        out = attend(q, k, v, attention_mask)  # [B, n, heads, hd]
        r = residual + attn.o_proj(out.reshape(batch, n, -1))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """s [..., H] -> draft-vocabulary logits [..., N]."""
        return self.lm_head(self.norm(s))

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path, **card) -> None:
        """Write mmspec's layout (``eagle3_config.json`` + ``eagle3_head.safetensors``, the engines' tensor names)."""
        config = asdict(self.config)
        config["aux_layers"] = list(config["aux_layers"])
        save_module(self, directory, {**config, **card}, CONFIG_FILE, WEIGHTS_FILE)

    def export(self, directory: str | Path, fmt: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write ``fmt``'s layout (``config.json`` + ``model.safetensors``, weights in ``dtype``);
        refused where ``directory`` holds another model's files (:func:`check_export_directory`)."""
        config = self.config.engine_config(fmt, dtype)  # (checks fmt first)
        check_export_directory(directory)
        if isinstance(self, VisionEagle3Head):
            engine = {"vllm-eagle3": "vLLM", "sglang-eagle3": "SGLang"}[fmt]
            raise ValueError(f"this EAGLE-3 head has the vision option (vision_tokens={self.vision_tokens}), which "
                             f"{engine}'s EAGLE-3 loader does not run; export a head trained without --vision-tokens")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
                   for name, t in self.state_dict().items()}
        save_tensors(tensors, directory / ENGINE_WEIGHTS_FILE, metadata={"format": "pt"})
        (directory / ENGINE_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module | None = None) -> "Eagle3Head":
        """Load a head from mmspec's layout or an engine's (``config.json`` + ``model.safetensors``,
        as :meth:`export` writes it or EAGLE-3 training elsewhere does); with ``target_model``,
        checked against its widths and vocabulary and placed like it."""
        directory = Path(directory)
        text = None if target_model is None else target_model.config.get_text_config(decoder=True)
        if (directory / CONFIG_FILE).is_file():
            saved = _read_config(directory / CONFIG_FILE)
            names = set(Eagle3Config.__dataclass_fields__)
            missing = [name for name, field in Eagle3Config.__dataclass_fields__.items()
                       if name not in saved and field.default is dataclasses.MISSING]
            if missing:
                raise ValueError(f"{directory / CONFIG_FILE} has no {', '.join(missing)}; it is damaged (or edited): "
                                 "train the head again, or restore the file")
            config = Eagle3Config(**{k: v for k, v in saved.items() if k in names})
            weights = WEIGHTS_FILE
        elif (directory / ENGINE_CONFIG_FILE).is_file() and (directory / ENGINE_WEIGHTS_FILE).is_file():
            saved = _read_config(directory / ENGINE_CONFIG_FILE)
            if not set(saved.get("architectures") or []) & set(ENGINE_ARCHITECTURES.values()):
                raise ValueError(f"{directory}/config.json names {saved.get('architectures')}, not an EAGLE-3 head "
                                 f"({' or '.join(ENGINE_ARCHITECTURES.values())})")
            try:
                config = Eagle3Config.from_engine_config(saved, text.num_hidden_layers if text is not None else None)
            except KeyError as error:
                raise ValueError(f"{directory / ENGINE_CONFIG_FILE} has no {error}; an EAGLE-3 config.json gives the "
                                 "head's shapes (hidden_size, intermediate_size, num_attention_heads, vocab_size)") from None
            except TypeError as error:  # (a field of the wrong type used in arithmetic)
                raise ValueError(f"{directory / ENGINE_CONFIG_FILE}: a field has the wrong type ({error})") from None
            weights = ENGINE_WEIGHTS_FILE
        else:
            for head, what, spec in ((EagleHead, "an EAGLE head", "'eagle:DIR'"), (KangarooAdapter, "a Kangaroo adapter",
                                      "'kangaroo:DIR'"), (DraftHeads, "Medusa / Hydra heads", "'medusa:DIR' or 'hydra:DIR'")):
                if (directory / head.config_file).is_file():
                    raise FileNotFoundError(f"{directory} holds {what} ({head.config_file}), not an EAGLE-3 head ({CONFIG_FILE}): "
                                            f"use it as drafter {spec}; only an EAGLE-3 head loads as 'eagle3:DIR' and "
                                            "exports (train one with `mmspec train drafter --method eagle3`)")
            raise FileNotFoundError(f"no EAGLE-3 head in {directory} ({CONFIG_FILE}, or config.json + model.safetensors, missing); "
                                    "train one with `mmspec train drafter --method eagle3`")
        config.check(directory / (CONFIG_FILE if weights == WEIGHTS_FILE else ENGINE_CONFIG_FILE))
        if text is not None:
            if config.hidden_size != text.hidden_size or config.target_hidden_size != text.hidden_size:
                raise ValueError(f"the EAGLE-3 head in {directory} has width {config.hidden_size} over target states of width "
                                 f"{config.target_hidden_size}; the target's is {text.hidden_size}{trained_for_another('eagle3')}")
            if config.vocab_size != target_model.get_output_embeddings().weight.shape[0]:
                raise ValueError(f"the EAGLE-3 head in {directory} maps to a vocabulary of {config.vocab_size}; the target has "
                                 f"{target_model.get_output_embeddings().weight.shape[0]}{trained_for_another('eagle3')}")
            if max(config.aux_layers) > text.num_hidden_layers:
                raise ValueError(f"the EAGLE-3 head in {directory} reads target layers {config.aux_layers}; the target has "
                                 f"{text.num_hidden_layers}{trained_for_another('eagle3')}")
        head = VisionEagle3Head(config, saved["vision_tokens"]) if saved.get("vision_tokens") else cls(config)
        _load_state(head, directory / weights)
        if target_model is not None:
            param = next(target_model.parameters())
            head = head.to(device=param.device, dtype=param.dtype)
        return head.eval()


class VisionEagle3Head(Eagle3Head):
    """:class:`Eagle3Head` with the vision option (the module docstring's formula): k compressed
    image tokens as prefix positions 0..k-1 of the mid layer (the pairs following at k, k+1, ...)
    and the global image feature added to every position's feature. Trained with
    ``mmspec train drafter --method eagle3 --vision-tokens K``; the card records ``vision_tokens``.

    Args:
        config: the head's :class:`Eagle3Config`.
        vision_tokens: k.
    """

    def __init__(self, config: Eagle3Config, vision_tokens: int = 4) -> None:
        super().__init__(config)
        self.vision_tokens = vision_tokens
        self.vision = VisionAdaptor(config.hidden_size, vision_tokens, config.num_attention_heads, config.rms_norm_eps)

    @classmethod
    def extend(cls, head: Eagle3Head, vision_tokens: int) -> "VisionEagle3Head":
        """A vision-aware head starting from a trained plain ``head`` (its weights and draft
        vocabulary copied; the adaptor new, its global projection zero)."""
        return with_plain_weights(cls(head.config, vision_tokens), head)

    def vision_context(self, image_states: torch.Tensor, valid: torch.Tensor | None = None) -> VisionContext:
        """The target's fused-layer states at the image tokens [B, m, 3 H_t] -> fc -> the adaptor
        (:class:`~mmspec.modeling.heads.VisionAdaptor`): prefix [B, k, H], bias [B, 1, H]."""
        return self.vision(self.fuse(image_states.to(self.fc.weight.dtype)), valid)

    def prefix_keys(self, context: VisionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's keys and values [B, kv heads, k, hd] at positions 0..k-1 (C in the feature
        slot of u, a zero embedding: nothing is predicted there)."""
        prefix = context.prefix.to(self.fc.weight.dtype)
        positions = torch.arange(self.vision_tokens, device=prefix.device)[None]
        _, k, v, _ = self.project(prefix, torch.zeros_like(prefix), positions)
        return k, v

    def write_prefix(self, context: VisionContext, cache) -> None:
        """Put the prefix's keys and values in ``cache`` (empty) as its first k entries."""
        cache.update(*self.prefix_keys(context), 0)

    def save(self, directory: str | Path, **card) -> None:
        super().save(directory, vision_tokens=self.vision_tokens, **card)


def _load_state(head: Eagle3Head, path: Path) -> None:
    """Weights from ``path``: every parameter required; ``t2d`` rebuilt from ``d2t`` when absent,
    a stored ``embed_tokens`` (some checkpoints carry the target's) ignored."""
    from safetensors.torch import load_file

    from ..hub import damaged_weights, weights_unreadable

    try:
        state = load_file(str(path))
    except weights_unreadable() as error:
        raise damaged_weights(path, error) from None
    state.pop("embed_tokens.weight", None)
    if "d2t" not in state:
        state["d2t"] = torch.zeros(head.config.draft_vocab_size, dtype=torch.long)  # the identity map: N = V
    if "t2d" not in state:
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(state["d2t"])) + state["d2t"]] = True
        state["t2d"] = t2d
    expected = head.state_dict()
    for name, tensor in state.items():  # (torch's report of a mismatch is a many-line RuntimeError)
        if name in expected and tensor.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} is {list(tensor.shape)}, but the head its config describes has "
                             f"{list(expected[name].shape)}: the config does not match these weights (edited, or "
                             "another head's?)")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: " + "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                                                   f"unexpected {', '.join(unexpected)}" if unexpected else "") if part)
                         + " (no EAGLE-3 head of the config's kind)")
    state["t2d"] = state["t2d"].bool()
    head.load_state_dict(state)


def _read_config(path: Path) -> dict:
    """The JSON object in ``path`` (one ValueError line naming the file where it is not one)."""
    try:
        saved = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not the head's config (an object)")
    return saved
