"""Chameleon / Anole (``ChameleonForConditionalGeneration``).

Conditional prompt: ``input_ids`` + ``<racm3:break>``, the begin-image token (as Chameleon's
``ImageDecoder`` appends); unconditional: [BOS, begin-image], as Chameleon's official in-batch CFG.
Image tokens are text-vocabulary ``IMGIMG*`` tokens (``vocabulary_mapping``).

Limitations: transformers' ``ChameleonVQVAE`` has no decoder (its checkpoint conversion drops the
VQGAN decoder weights, "we dont do image generation yet"), so :class:`ChameleonImageTokenizer`
decodes only with a :class:`ChameleonVQDecoder` (the original VQGAN decoder; load it from
Chameleon's ``tokenizer/vqgan.ckpt`` with :meth:`ChameleonVQDecoder.from_vqgan_state_dict`). The
target covers text-only prompts: Chameleon's official CFG for prompts that contain input images
uses a third, image-conditioned row (InstructPix2Pix-style), which the two-row interface cannot
express; such prompts raise ValueError. Without input images the image-conditioned row equals the
unconditional one and the official three-row rule reduces exactly to u + g_text (c - u).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import ImageFamily, ImageTokensEncoder, single_prompt, VocabularyImageTarget


class ChameleonImageTarget(VocabularyImageTarget):
    """Chameleon / Anole (``ChameleonForConditionalGeneration``) image generation, Anole-style:
    1024 codes (32 x 32) per 512 px image in the released checkpoints.

    model_inputs: ``input_ids`` [1, L] (BOS + text; the begin-image token ``<racm3:break>`` is
    appended when missing, as Chameleon's ``ImageDecoder`` does), ``guidance_scale`` (Chameleon's
    ``guidance_scale_text``, official default 3.0). The prompt may not contain input images (see the
    module doc).

    Args:
        model: the model.
        boi_token_id, bos_token_id: override the vocabulary's ``<racm3:break>`` / ``<s>``.
    """

    input_names = VocabularyImageTarget.input_names + ("pixel_values",)  # refused with the reason in _prompt_rows

    def __init__(self, model, boi_token_id: int | None = None, bos_token_id: int | None = None) -> None:
        self.model = model
        self.config = model.config
        mapping = model.model.vocabulary_mapping
        vocab = mapping.vocab_map
        self.boi_token_id = boi_token_id if boi_token_id is not None else vocab.get("<racm3:break>")
        self.bos_token_id = bos_token_id if bos_token_id is not None else vocab.get("<s>", model.config.bos_token_id)
        if self.boi_token_id is None or self.bos_token_id is None:
            raise ValueError("Chameleon's vocabulary_map lacks <racm3:break> (begin image) or <s>; pass "
                             "boi_token_id=... / bos_token_id=...")
        vq = model.config.vq_config
        self._setup_codes(mapping, vq.num_embeddings, model.lm_head)
        side = vq.resolution // 2 ** (len(vq.channel_multiplier) - 1)
        self.grid = (side, side)
        self.max_length = model.config.max_position_embeddings
        self.cache_config = model.config
        self.backbone = model.model
        image_ids = [i for i in (mapping.image_token_id,) if i is not None]
        self._input_image_ids = torch.tensor(sorted(set(mapping.image_tokens) | set(image_ids)), dtype=torch.long)

    def _embed_ids(self, ids):
        return self.model.get_input_embeddings()(ids)

    def _prompt_rows(self, model_inputs, rows):
        cond = single_prompt(model_inputs)
        if model_inputs.get("pixel_values") is not None or bool(torch.isin(cond, self._input_image_ids).any()):
            raise ValueError("Chameleon prompts with input images need the official three-row (image-conditioned) "
                             "guidance, which this two-row target does not implement; use a text-only prompt")
        if int(cond[-1]) != self.boi_token_id:
            cond = torch.cat([cond, cond.new_tensor([self.boi_token_id])])
        if rows == 1:
            return [cond]
        return [cond, cond.new_tensor([self.bos_token_id, self.boi_token_id])]


class ChameleonVQDecoder(nn.Module):
    """The decoder of Chameleon's VQGAN (taming-transformers' ``Decoder``), which transformers'
    ``ChameleonVQVAE`` omits. Module names match the original checkpoint's ``decoder.*`` keys.

    Args:
        config: the model's ``ChameleonVQVAEConfig`` (``vq_config``).
    """

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.chameleon.modeling_chameleon import (
            ChameleonVQVAEEncoderAttnBlock as AttnBlock,
            ChameleonVQVAEEncoderResnetBlock as ResnetBlock,
        )

        multipliers = tuple(config.channel_multiplier)
        levels = len(multipliers)
        attn_resolutions = config.attn_resolutions or []
        block_in = config.base_channels * multipliers[-1]
        resolution = config.resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(config.latent_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(config=config, in_channels=block_in, out_channels=block_in)
        self.mid.attn_1 = AttnBlock(block_in) if config.attn_type == "vanilla" else nn.Identity()
        self.mid.block_2 = ResnetBlock(config=config, in_channels=block_in, out_channels=block_in)
        self.up = nn.ModuleList()
        for level in reversed(range(levels)):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = config.base_channels * multipliers[level]
            for _ in range(config.num_res_blocks + 1):
                up.block.append(ResnetBlock(config=config, in_channels=block_in, out_channels=block_out))
                block_in = block_out
                if resolution in attn_resolutions:
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = nn.Module()
                up.upsample.conv = nn.Conv2d(block_in, block_in, kernel_size=3, stride=1, padding=1)
                resolution *= 2
            self.up.insert(0, up)
        self.norm_out = nn.GroupNorm(num_groups=32, num_channels=block_in, eps=1e-6, affine=True)
        self.conv_out = nn.Conv2d(block_in, config.in_channels, kernel_size=3, stride=1, padding=1)

    @classmethod
    def from_vqgan_state_dict(cls, config, state_dict: dict[str, torch.Tensor]) -> "ChameleonVQDecoder":
        """Build from the ``state_dict`` of Chameleon's ``tokenizer/vqgan.ckpt`` (its ``decoder.*`` keys)."""
        decoder = cls(config)
        decoder.load_state_dict({k[len("decoder."):]: v for k, v in state_dict.items() if k.startswith("decoder.")})
        return decoder.eval()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        hidden = self.conv_in(latents)
        hidden = self.mid.block_2(self.mid.attn_1(self.mid.block_1(hidden)))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i, block in enumerate(up.block):
                hidden = block(hidden)
                if len(up.attn):
                    hidden = up.attn[i](hidden)
            if level != 0:
                hidden = up.upsample.conv(F.interpolate(hidden, scale_factor=2.0, mode="nearest"))
        hidden = self.norm_out(hidden)
        return self.conv_out(hidden * torch.sigmoid(hidden))


class ChameleonImageTokenizer(ImageTokensEncoder):
    """:class:`~mmspec.adapters.image_gen.ImageTokenizer` over ``ChameleonVQVAE`` plus a
    :class:`ChameleonVQDecoder` (needed by ``decode`` only; transformers ships no VQGAN decoder)."""

    def __init__(self, vq, decoder: ChameleonVQDecoder | None = None) -> None:
        self.vq = vq
        self.decoder = decoder
        self.vocab_size = vq.config.num_embeddings
        side = vq.config.resolution // 2 ** (len(vq.config.channel_multiplier) - 1)
        self.grid = (side, side)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise ValueError("transformers' ChameleonVQVAE has no decoder (its checkpoints drop the VQGAN decoder "
                             "weights); pass decoder=ChameleonVQDecoder.from_vqgan_state_dict(vq_config, "
                             "torch.load('tokenizer/vqgan.ckpt')['state_dict'])")
        quant = self.vq.quantize.embedding(tokens.long()).view(tokens.shape[0], *self.grid, -1).permute(0, 3, 1, 2)
        return self.decoder(self.vq.post_quant_conv(quant.contiguous())).float()

    def codebook_embeddings(self) -> torch.Tensor:
        return self.vq.quantize.embedding.weight.detach()


FAMILY = ImageFamily("Chameleon / Anole (ChameleonForConditionalGeneration)", ("ChameleonForConditionalGeneration", "ChameleonVQVAE"),
                     ChameleonImageTarget, ChameleonImageTokenizer)
