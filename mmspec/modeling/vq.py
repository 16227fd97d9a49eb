"""A LlamaGen-style VQ image tokenizer (VQGAN encoder/decoder + l2-normalised codebook).

Architecture and parameter names follow LlamaGen's ``VQModel`` (Sun et al. 2024, "Autoregressive
Model Beats Diffusion"; itself the taming-transformers VQGAN with a low-dimensional, l2-normalised
codebook), so the official ``vq_ds16_c2i.pt`` / ``vq_ds16_t2i.pt`` state dicts load into
:class:`VQTokenizer` with :meth:`VQTokenizer.load_official` when a user has them:

    encoder.conv_in, encoder.conv_blocks.{i}.res.{j}.{norm1,conv1,norm2,conv2,nin_shortcut},
    encoder.conv_blocks.{i}.attn.{j}.{norm,q,k,v,proj_out}, encoder.conv_blocks.{i}.downsample.conv,
    encoder.mid.{0,1,2}, encoder.norm_out, encoder.conv_out, quant_conv, quantize.embedding,
    post_quant_conv, decoder.conv_in, decoder.mid.{0,1,2}, decoder.conv_blocks.{i}.res/attn/upsample,
    decoder.norm_out, decoder.conv_out.

Shapes: an image batch [B, 3, H, W] in [-1, 1] encodes to a token grid [B, H/f, W/f] with
f = 2 ** (len(ch_mult) - 1); codes are vectors of ``codebook_embed_dim`` on the unit sphere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .persistence import DataclassModel

CONFIG_FILE = "vq_config.json"
WEIGHTS_FILE = "vq.safetensors"


@dataclass
class VQConfig:
    """LlamaGen's ``ModelArgs`` of the tokenizer. Defaults are the official VQ-16 (16x downsampling,
    16384 codes of dimension 8)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    commit_loss_beta: float = 0.25
    ch: int = 128
    encoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 256
    image_size: int = 256

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.downsample


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.nin_shortcut is None else self.nin_shortcut(x))


class AttnBlock(nn.Module):
    """Single-head self-attention over the H*W positions (1x1 convolutions for q, k, v, out)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (conv(y).flatten(2).transpose(1, 2) for conv in (self.q, self.k, self.v))  # [B, HW, C]
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(channels: int) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(channels, channels), AttnBlock(channels), ResnetBlock(channels, channels)])


def _run_level(block: nn.Module, h: torch.Tensor, blocks: str = "res") -> torch.Tensor:
    """One resolution level of the encoder or decoder: its residual blocks (attribute ``blocks``:
    LlamaGen's "res", LDM's "block"), each followed by its attention block at the levels that have
    them, then its down- or upsampling, if any."""
    for i, res in enumerate(getattr(block, blocks)):
        h = res(h)
        if len(block.attn) > 0:
            h = block.attn[i](h)
    for resample in ("downsample", "upsample"):
        if hasattr(block, resample):
            h = getattr(block, resample)(h)
    return h


class Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level, mult in enumerate(ch_mult):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                block.res.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
                if level == len(ch_mult) - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != len(ch_mult) - 1:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)
        self.mid = _mid(block_in)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = _run_level(block, h)
        for layer in self.mid:
            h = layer(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int) -> None:
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in)
        self.conv_blocks = nn.ModuleList()
        for level, mult in enumerate(reversed(ch_mult)):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                block.res.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
                if level == 0:
                    block.attn.append(AttnBlock(block_in))
            if level != len(ch_mult) - 1:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for layer in self.mid:
            h = layer(h)
        for block in self.conv_blocks:
            h = _run_level(block, h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest-code quantisation; with ``l2_norm`` codes and inputs live on the unit sphere, so the
    nearest code is the one of largest cosine similarity."""

    def __init__(self, codebook_size: int, embed_dim: int, l2_norm: bool) -> None:
        super().__init__()
        self.l2_norm = l2_norm
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        self.embedding.weight.data.uniform_(-1.0 / codebook_size, 1.0 / codebook_size)

    def codebook(self) -> torch.Tensor:
        """[V, d] the code vectors as the decoder sees them."""
        weight = self.embedding.weight
        return F.normalize(weight, dim=-1) if self.l2_norm else weight

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z: [B, d, h, w] -> (indices [B, h, w], quantised codes [B, d, h, w], not straight-through)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        codes = self.codebook()
        if self.l2_norm:
            flat = F.normalize(flat, dim=-1)
        distance = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ codes.t() + codes.pow(2).sum(1)
        indices = distance.argmin(1)
        b, _, h, w = z.shape
        return indices.view(b, h, w), self.lookup(indices.view(b, h, w))

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """indices [B, h, w] -> codes [B, d, h, w]."""
        return self.codebook()[indices].permute(0, 3, 1, 2).contiguous()


class VQTokenizer(DataclassModel, nn.Module):
    """encode: images [B, 3, H, W] in [-1, 1] -> token grid [B, H/f, W/f]; decode: the reverse."""

    config_class, config_file, weights_file, kind = VQConfig, CONFIG_FILE, WEIGHTS_FILE, "VQ tokenizer"
    save_dtype, load_dtype = torch.float16, torch.float32

    def __init__(self, config: VQConfig) -> None:
        super().__init__(config)
        self.encoder = Encoder(config.ch, config.encoder_ch_mult, config.num_res_blocks, config.z_channels)
        self.decoder = Decoder(config.ch, config.decoder_ch_mult, config.num_res_blocks, config.z_channels)
        self.quantize = VectorQuantizer(config.codebook_size, config.codebook_embed_dim, config.codebook_l2_norm)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    @property
    def vocab_size(self) -> int:
        return self.config.codebook_size

    def encode_latents(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> pre-quantisation latents [B, d, h, w] (l2-normalised with the codebook)."""
        z = self.quant_conv(self.encoder(images))
        return F.normalize(z, dim=1) if self.config.codebook_l2_norm else z

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> LongTensor [B, h, w] of code indices."""
        return self.quantize(self.encode_latents(images))[0]

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, d, h, w] code vectors -> images [B, 3, H, W] (unclamped)."""
        return self.decoder(self.post_quant_conv(codes))

    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """LongTensor [B, h, w] (or [B, h*w] for a square grid) -> images [B, 3, H, W] in [-1, 1]."""
        if indices.dim() == 2:
            side = int(round(indices.shape[1] ** 0.5))
            indices = indices.view(indices.shape[0], side, side)
        return self.decode_codes(self.quantize.lookup(indices)).clamp(-1, 1)

    def codebook_embeddings(self) -> torch.Tensor:
        """[V, d] the code vectors (for neighbour tables, :func:`mmspec.core.relaxed.neighbour_table`)."""
        return self.quantize.codebook().detach()

    @classmethod
    def load_official(cls, checkpoint: str | Path, config: VQConfig | None = None) -> "VQTokenizer":
        """Load an official LlamaGen tokenizer checkpoint (``vq_ds16_c2i.pt``: a dict whose "model"
        / "ema" / "state_dict" entry is the state dict) with ``torch.load(weights_only=True)``."""
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model = cls(config or VQConfig())
        model.load_state_dict(official_state_dict(state))
        return model.eval()


def official_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The tokenizer weights of a LlamaGen checkpoint, without its training-only buffers
    (``quantize.codebook_used``) and its GAN discriminator / perceptual-loss entries."""
    for key in ("ema", "model", "state_dict"):
        if key in checkpoint and isinstance(checkpoint[key], dict):
            checkpoint = checkpoint[key]
            break
    keep = ("encoder.", "decoder.", "quantize.embedding.", "quant_conv.", "post_quant_conv.")
    return {k: v for k, v in checkpoint.items() if k.startswith(keep)}
