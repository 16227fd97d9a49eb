"""The KL autoencoder MAR tokenises images with (LDM's ``AutoencoderKL``, "KL-16"), in its
parameter names and shapes: ``encoder.conv_in``, ``encoder.down.{i}.block.{j}``,
``encoder.down.{i}.attn.{j}``, ``encoder.down.{i}.downsample.conv``, ``encoder.mid.block_1 /
attn_1 / block_2``, ``encoder.norm_out``, ``encoder.conv_out``, ``quant_conv``,
``post_quant_conv``, and the decoder's mirror (``decoder.up.{i}.block.{j}`` with
``num_res_blocks + 1`` blocks per level, ``decoder.up.{i}.upsample.conv``). The residual,
attention and resampling blocks are the VQ tokenizer's (same inner names).

Encoding gives a diagonal Gaussian posterior over [embed_dim, H/f, W/f] latents (mean and
log-variance from ``quant_conv``); MAR multiplies a latent sample by ``scale`` (0.2325 for the
official KL-16) so that its std is about 1, and divides by it before decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from .persistence import DataclassModel
from .vq import AttnBlock, Downsample, ResnetBlock, Upsample, _norm, _run_level


@dataclass
class KLConfig:
    """LDM's ddconfig (KL-16 of MAR: ch 128, ch_mult (1, 1, 2, 2, 4), 2 residual blocks, attention
    at resolution 16 in the encoder only, embed_dim 16); ``scale``: MAR's latent factor."""

    resolution: int = 256
    in_channels: int = 3
    ch: int = 128
    ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    attn_resolutions: list[int] = field(default_factory=lambda: [16])
    decoder_attn_resolutions: list[int] = field(default_factory=list)
    embed_dim: int = 16
    scale: float = 0.2325

    @property
    def stride(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


def _mid(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(channels, channels), AttnBlock(channels), ResnetBlock(channels, channels)
    return mid


def _run_mid(mid: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


def _level(blocks: list[nn.Module], attns: list[nn.Module]) -> nn.Module:
    level = nn.Module()
    level.block, level.attn = nn.ModuleList(blocks), nn.ModuleList(attns)
    return level


class KLEncoder(nn.Module):
    def __init__(self, c: KLConfig) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(c.in_channels, c.ch, 3, padding=1)
        self.down = nn.ModuleList()
        res, cin = c.resolution, c.ch
        for i, mult in enumerate(c.ch_mult):
            cout = c.ch * mult
            blocks = [ResnetBlock(cin if j == 0 else cout, cout) for j in range(c.num_res_blocks)]
            level = _level(blocks, [AttnBlock(cout) for _ in blocks] if res in c.attn_resolutions else [])
            if i < len(c.ch_mult) - 1:
                level.downsample = Downsample(cout)
                res //= 2
            self.down.append(level)
            cin = cout
        self.mid = _mid(cin)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, 2 * c.embed_dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = _run_level(level, h, "block")
        return self.conv_out(F.silu(self.norm_out(_run_mid(self.mid, h))))


class KLDecoder(nn.Module):
    def __init__(self, c: KLConfig) -> None:
        super().__init__()
        cin = c.ch * c.ch_mult[-1]
        res = c.resolution // c.stride
        self.conv_in = nn.Conv2d(c.embed_dim, cin, 3, padding=1)
        self.mid = _mid(cin)
        levels = []
        for i in reversed(range(len(c.ch_mult))):
            cout = c.ch * c.ch_mult[i]
            blocks = [ResnetBlock(cin if j == 0 else cout, cout) for j in range(c.num_res_blocks + 1)]
            level = _level(blocks, [AttnBlock(cout) for _ in blocks] if res in c.decoder_attn_resolutions else [])
            if i > 0:
                level.upsample = Upsample(cout)
                res *= 2
            levels.insert(0, level)  # up.{i} is level i, run from the deepest
            cin = cout
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, c.in_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = _run_mid(self.mid, self.conv_in(z))
        for level in reversed(self.up):
            h = _run_level(level, h, "block")
        return self.conv_out(F.silu(self.norm_out(h)))


class KLAutoencoder(DataclassModel, nn.Module):
    """image [B, 3, H, W] in [-1, 1] <-> latents [B, embed_dim, H / stride, W / stride]."""

    config_class, config_file, weights_file, kind = KLConfig, "kl_config.json", "kl.safetensors", "KL autoencoder"
    save_dtype, load_dtype = torch.float32, torch.float32

    def __init__(self, config: KLConfig) -> None:
        super().__init__(config)
        self.encoder, self.decoder = KLEncoder(config), KLDecoder(config)
        self.quant_conv = nn.Conv2d(2 * config.embed_dim, 2 * config.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.embed_dim, 1)

    def posterior(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-variance (clamped to [-30, 20], as LDM does) of the latent posterior."""
        mean, logvar = self.quant_conv(self.encoder(images)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Scaled latents: a posterior sample (its mean without ``generator``) times ``scale``."""
        mean, logvar = self.posterior(images)
        if generator is not None:
            mean = mean + (0.5 * logvar).exp() * torch.randn(mean.shape, generator=generator, device=generator.device).to(mean)
        return mean * self.config.scale

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latents / self.config.scale))

    def load_official(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the official KL-16 state dict (``torch.load(path, weights_only=True)["model"]``);
        LDM's training-only keys (the discriminator and LPIPS ``loss.*``) are skipped."""
        kept = {k: v for k, v in state_dict.items() if not k.startswith("loss.")}
        missing, unexpected = self.load_state_dict(kept, strict=False)
        if missing or unexpected:
            raise ValueError(f"not a KL autoencoder state dict of this config: missing {missing[:4]}, unexpected {unexpected[:4]}")
