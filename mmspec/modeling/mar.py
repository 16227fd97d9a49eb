"""A MAR-style continuous-token generator (Li et al. 2024, "Autoregressive Image Generation without
Vector Quantization"), in MAR's own parameter names and shapes, so the official checkpoints' state
dicts load (``checkpoint-last.pth``'s "model_ema").

Layout (official names): tokens [N, D] (KL latents, patchified) -> ``z_proj`` + ``buffer_size``
condition slots (``class_emb`` rows, or ``fake_latent`` for the unconditional half of CFG; with
``text_dim`` set, ``text_proj`` of caption features instead) + ``encoder_pos_embed_learned`` ->
``z_proj_ln`` -> ``encoder_blocks`` (timm ViT blocks) over the buffer and the *known* tokens ->
``encoder_norm`` -> ``decoder_embed``, unknown positions filled with ``mask_token`` ->
``decoder_pos_embed_learned`` -> ``decoder_blocks`` -> ``decoder_norm`` -> drop the buffer ->
``diffusion_pos_embed_learned``: the condition z [N, W] of each position's diffusion head
``diffloss.net`` (SimpleMLPAdaLN: eps and learned-variance outputs, 2D channels).

Attention is bidirectional: a position's conditional depends on the *set* of known tokens. Unknown
tokens are excluded as attention keys in the encoder instead of being dropped from the sequence
(identical outputs for the known tokens, static shapes for any number of contexts at once).

``attention="causal"`` (our variant, same parameters): the tokens sit in the sequence in generation
order, token r attends the buffer and tokens <= r, and each position to predict is a query slot
(``mask_token`` + its position embedding) attending the buffer, the first ``prefix`` tokens and
itself. One forward then gives the conditions of any set of (position, prefix) pairs: the K + 1
verification contexts of a speculative step, MAR's k-tokens-per-step parallel decoding (k queries
on one prefix), and, in training, every token of an image at once (as a causal LM trains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .diffusion import DiffusionSchedule
from .persistence import DataclassModel


#: "bidirectional": MAR's (a position's condition depends on the set of known tokens);
#: "causal": the same layers and names, with attention causal in generation order (see MARModel)
ATTENTION = ("bidirectional", "causal")


@dataclass
class MARConfig:
    """Hyper-parameters, MAR's names. ``seq_len`` = (img_size / vae_stride / patch_size)^2 tokens of
    ``token_embed_dim`` = vae_embed_dim * patch_size^2 channels. ``text_dim`` > 0 replaces the class
    embedding by projected caption features (``buffer_size`` of them, right-aligned)."""

    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    vae_embed_dim: int = 16
    encoder_embed_dim: int = 768
    encoder_depth: int = 12
    encoder_num_heads: int = 12
    decoder_embed_dim: int = 768
    decoder_depth: int = 12
    decoder_num_heads: int = 12
    mlp_ratio: float = 4.0
    buffer_size: int = 64
    class_num: int = 1000
    text_dim: int = 0
    diffloss_d: int = 6
    diffloss_w: int = 1024
    num_train_steps: int = 1000
    num_sampling_steps: int = 100
    noise_schedule: str = "cosine"
    sampling_spacing: str = "even"
    clip_denoised: float | None = None
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def seq_h(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_h ** 2

    @property
    def token_embed_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size ** 2


#: the official sizes (MAR's mar_base / mar_large / mar_huge)
PRESETS = {
    "mar_base": dict(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768,
                     decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "mar_large": dict(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024,
                      decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "mar_huge": dict(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280,
                     decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
}


class Attention(nn.Module):
    """timm's ViT attention (``qkv``, ``proj``) with an optional boolean key mask."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """timm's pre-norm ViT block (``norm1``, ``attn``, ``norm2``, ``mlp``), LayerNorm eps 1e-6."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TimestepEmbedder(nn.Module):
    """256 sinusoidal frequencies (cos, then sin; max period 10000) -> ``mlp`` (Linear, SiLU, Linear)."""

    def __init__(self, width: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1).to(self.mlp[0].weight.dtype))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class ResBlock(nn.Module):
    """h + gate * MLP(LN(h) (1 + scale) + shift), (shift, scale, gate) = adaLN(SiLU(y))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """MAR's diffusion head: f(x_t [M, D], t [M], z [M, C]) -> [eps_hat, v] [M, 2D]."""

    def __init__(self, in_channels: int, width: int, z_channels: int, depth: int) -> None:
        super().__init__()
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_channels, width)
        self.input_proj = nn.Linear(in_channels, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * in_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x.to(self.input_proj.weight.dtype))
        y = self.time_embed(t) + self.cond_embed(z.to(self.cond_embed.weight.dtype))
        for block in self.res_blocks:
            h = block(h, y)
        return self.final_layer(h, y).float()

    def chain(self, z: torch.Tensor, timesteps: torch.Tensor):
        """A reverse chain's step function, same outputs as :meth:`forward`: every adaLN
        modulation depends on (t, z) only, so all of them, for all S steps, come from one batched
        product per layer up front; a step then runs the input projection, the blocks' MLPs and the
        output layer only.

        Args:
            z: [M, C] conditions; timesteps: LongTensor [S] training timesteps (respaced index -> t).
        Returns:
            step(x_t [M, D], index) -> [M, 2D], index the respaced step.
        """
        y = F.silu(self.time_embed(timesteps)[:, None] + self.cond_embed(z.to(self.cond_embed.weight.dtype))[None])
        blocks = [(block, block.adaLN_modulation[1](y).chunk(3, dim=-1)) for block in self.res_blocks]  # [S, M, W] each
        final_shift, final_scale = self.final_layer.adaLN_modulation[1](y).chunk(2, dim=-1)

        def step(x: torch.Tensor, index: int) -> torch.Tensor:
            h = self.input_proj(x.to(self.input_proj.weight.dtype))
            for block, (shift, scale, gate) in blocks:
                h = h + gate[index] * block.mlp(_modulate(block.in_ln(h), shift[index], scale[index]))
            out = _modulate(self.final_layer.norm_final(h), final_shift[index], final_scale[index])
            return self.final_layer.linear(out).float()

        return step


class DiffLoss(nn.Module):
    """Holds ``net`` (the official ``diffloss.net.*`` names); the schedule lives in :mod:`.diffusion`."""

    def __init__(self, config: MARConfig) -> None:
        super().__init__()
        self.net = SimpleMLPAdaLN(config.token_embed_dim, config.diffloss_w, config.decoder_embed_dim, config.diffloss_d)


class MARModel(DataclassModel, nn.Module):
    """The MAR transformer and its diffusion head (see the module docstring for the layout)."""

    config_class, config_file, weights_file, kind = MARConfig, "mar_config.json", "mar.safetensors", "MAR"
    save_dtype, load_dtype = torch.float32, torch.float32

    def __init__(self, config: MARConfig) -> None:
        super().__init__(config)
        c = config
        enc, dec = c.encoder_embed_dim, c.decoder_embed_dim
        if c.text_dim:
            self.text_proj = nn.Linear(c.text_dim, enc)
        else:
            self.class_emb = nn.Embedding(c.class_num, enc)
        self.fake_latent = nn.Parameter(torch.zeros(1, enc))
        self.z_proj = nn.Linear(c.token_embed_dim, enc)
        self.z_proj_ln = nn.LayerNorm(enc, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len + c.buffer_size, enc))
        self.encoder_blocks = nn.ModuleList(Block(enc, c.encoder_num_heads, c.mlp_ratio) for _ in range(c.encoder_depth))
        self.encoder_norm = nn.LayerNorm(enc, eps=1e-6)
        self.decoder_embed = nn.Linear(enc, dec)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len + c.buffer_size, dec))
        self.decoder_blocks = nn.ModuleList(Block(dec, c.decoder_num_heads, c.mlp_ratio) for _ in range(c.decoder_depth))
        self.decoder_norm = nn.LayerNorm(dec, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len, dec))
        self.diffloss = DiffLoss(c)
        self.schedule = DiffusionSchedule(c.num_train_steps, c.noise_schedule, c.num_sampling_steps, c.sampling_spacing,
                                          c.clip_denoised)
        for p in (self.fake_latent, self.mask_token, self.encoder_pos_embed_learned, self.decoder_pos_embed_learned,
                  self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        # as MAR initialises its head: adaLN modulations and the output layer at zero (eps_hat = 0)
        net = self.diffloss.net
        for module in [block.adaLN_modulation[-1] for block in net.res_blocks] + [net.final_layer.adaLN_modulation[-1],
                                                                                   net.final_layer.linear]:
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)

    # conditioning -----------------------------------------------------------------------------
    def buffer(self, labels: torch.Tensor | None = None, text: torch.Tensor | None = None,
               text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's condition slots [R, buffer_size, E]: class rows (labels LongTensor [R]) or,
        for a text model, projected caption features text [R, L <= buffer_size, text_dim] right-
        aligned after ``fake_latent`` slots (positions where ``text_mask`` [R, L] is False hold
        ``fake_latent`` too). ``labels``/``text`` None: the unconditional buffer (one row)."""
        c = self.config
        if text is None and labels is None:
            return self.fake_latent.expand(1, c.buffer_size, -1)
        if c.text_dim:
            if text is None:
                raise ValueError("this MAR is text-conditioned: pass caption features, not class labels")
            rows, length = text.shape[:2]
            if length > c.buffer_size:
                raise ValueError(f"{length} caption positions exceed the {c.buffer_size} buffer slots")
            feats = self.text_proj(text.to(self.text_proj.weight.dtype))
            if text_mask is not None:
                feats = torch.where(text_mask.unsqueeze(-1), feats, self.fake_latent.expand_as(feats))
            pad = self.fake_latent.expand(rows, c.buffer_size - length, -1)
            return torch.cat([pad, feats], dim=1)
        if labels is None:
            raise ValueError("this MAR is class-conditioned: pass class labels")
        return self.class_emb(labels).unsqueeze(1).expand(-1, c.buffer_size, -1)

    # the transformer --------------------------------------------------------------------------
    def contexts(self, tokens: torch.Tensor, known: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """Each row's diffusion conditions.

        Args:
            tokens: [R, N, D] the grid (values at unknown positions are ignored).
            known: [R, N] bool, the tokens each row conditions on.
            buffer: [R, buffer_size, E] condition slots (:meth:`buffer`).
        Returns:
            z: [R, N, W] the condition of every position's head (meaningful where unknown).
        """
        c = self.config
        rows = tokens.shape[0]
        x = self.z_proj(tokens.to(self.z_proj.weight.dtype))
        x = torch.cat([buffer.to(x.dtype), x], dim=1) + self.encoder_pos_embed_learned
        x = self.z_proj_ln(x)
        keys = torch.cat([known.new_ones(rows, c.buffer_size), known], dim=1)  # [R, B + N]
        mask = keys[:, None, None, :]  # every query attends the buffer and the known tokens only
        for block in self.encoder_blocks:
            x = block(x, mask)
        x = self.decoder_embed(self.encoder_norm(x))
        slot_known = keys.unsqueeze(-1)
        x = torch.where(slot_known, x, self.mask_token.to(x.dtype).expand_as(x)) + self.decoder_pos_embed_learned
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_norm(x)[:, c.buffer_size:]
        return x + self.diffusion_pos_embed_learned

    def causal_contexts(self, tokens: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor,
                        query_prefix: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """Conditions under ``attention="causal"``.

        Args:
            tokens: [R, M, D] known tokens in generation order; positions: LongTensor [R, M] their grid
                positions.
            query_positions: LongTensor [R, Q] positions to predict; query_prefix: LongTensor [Q]
                (or [R, Q]: per row) how many of the M tokens each query sees.
            buffer: [R, buffer_size, E].
        Returns:
            z: [R, Q, W].
        """
        c = self.config
        rows, m = tokens.shape[:2]
        q, b = query_positions.shape[1], c.buffer_size
        device = tokens.device
        # attention masks [1 or R, T, T]: buffer -> buffer; token r -> buffer + tokens <= r;
        # query j -> buffer + tokens < prefix_j + itself
        prefix = query_prefix.to(device).view(-1, q)
        total = b + m + q
        allowed = torch.zeros(prefix.shape[0], total, total, dtype=torch.bool, device=device)
        allowed[:, :, :b] = True
        rank = torch.arange(m, device=device)
        allowed[:, b : b + m, b : b + m] = rank[None, :] <= rank[:, None]
        allowed[:, b + m :, b : b + m] = rank[None, None, :] < prefix[:, :, None]
        allowed[:, b + m :, b + m :] = torch.eye(q, dtype=torch.bool, device=device)
        allowed = allowed[:, None]  # [1 or R, 1, T, T]: one mask per row, shared by the heads
        enc_pos = self.encoder_pos_embed_learned[0]
        x = self.z_proj(tokens.to(self.z_proj.weight.dtype)) + enc_pos[b + positions]
        x = self.z_proj_ln(torch.cat([buffer.to(x.dtype) + enc_pos[:b], x], dim=1))
        enc_mask = allowed[..., : b + m, : b + m]
        for block in self.encoder_blocks:
            x = block(x, enc_mask)
        dec_pos = self.decoder_pos_embed_learned[0]
        x = self.decoder_embed(self.encoder_norm(x))
        x = x + torch.cat([dec_pos[:b].expand(rows, -1, -1), dec_pos[b + positions]], dim=1)
        queries = self.mask_token.to(x.dtype) + dec_pos[b + query_positions]
        x = torch.cat([x, queries], dim=1)
        for block in self.decoder_blocks:
            x = block(x, allowed)
        return self.decoder_norm(x)[:, b + m :] + self.diffusion_pos_embed_learned[0, query_positions]

    def load_official(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an official checkpoint's state dict ("model" or "model_ema" of checkpoint-last.pth,
        read with ``torch.load(path, weights_only=True)``): every key and shape must match."""
        missing, unexpected = self.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"not a MAR state dict of this config: missing {missing[:4]}, unexpected {unexpected[:4]}")
