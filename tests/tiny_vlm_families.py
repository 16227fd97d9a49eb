"""Tiny random LLaVA-OneVision, InternVL and Mllama (Llama-3.2-Vision) models with their inputs.

Built from configs in code (never downloaded), fp32, under the conventions of :mod:`tiny_models`
(vocabulary 512, EOS un-emittable, prompt ``BOS + 7 text + <image block> + 6 text``):

* ``llava_onevision``: SigLIP tower (16 px tiles, patch 4), Qwen2 decoder, anyres: a 10 x 32 image
  on the 16 x 32 pinpoint is a base tile and a 1 x 2 grid; its token count is what the model's own
  ``get_image_features`` packs (unpadded grid rows, each closed by ``image_newline``, after the base).
* ``llava_onevision_video``: the same model, a 2-frame video: each frame's 4 x 4 patches pooled
  bilinearly to 2 x 2, then one ``image_newline``: 2 * 4 + 1 = 9 video tokens.
* ``internvl``: InternVL vision tower (16 px tiles, patch 4 -> 16 patches, pixel shuffle 0.5 -> 4
  tokens a tile), Qwen2 decoder, 3 tiles (two crops and the thumbnail) -> 12 image tokens.
* ``mllama``: Mllama vision tower (16 px tiles, patch 4, 4 tiles at most, one global layer), a
  3-layer text model whose layer 1 is a cross-attention layer; one ``<|image|>`` token; a 1 x 2
  tile image (aspect ratio id 2, tiles 3-4 padding); ``cross_attention_mask`` 1 on both real tiles
  from the image token on. The cross-attention gates, zero at initialisation (so an untrained
  model ignores the image), are set to 1 so that the image reaches the logits.
"""

from __future__ import annotations

import torch
from tiny_models import IMAGE_ID, TinyCase, _finalize, _pixels, _prompt, _text_kwargs, _vision_kwargs
from transformers import (
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    MllamaConfig,
    MllamaForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig

VIDEO_ID = 508
FAMILIES = ("llava_onevision", "llava_onevision_video", "internvl", "mllama")


def _onevision(gen: torch.Generator, video: bool):
    tile, patch = 16, 4
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**_vision_kwargs(image_size=tile, patch_size=patch)),
        text_config=Qwen2Config(**_text_kwargs()),
        image_token_index=IMAGE_ID, video_token_index=VIDEO_ID,
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    )
    model = LlavaOnevisionForConditionalGeneration(config)
    if video:
        frames = 2
        pooled = (tile // patch + 1) // 2
        return model, {"input_ids": _prompt(gen, [VIDEO_ID] * (frames * pooled * pooled + 1)),
                       "pixel_values_videos": _pixels(gen, 1, frames, 3, tile, tile)}
    pixels, sizes = _pixels(gen, 1, 3, 3, tile, tile), torch.tensor([[10, 32]])
    with torch.no_grad():
        count = model.model.get_image_features(pixels, sizes, return_dict=True).pooler_output[0].shape[0]
    return model, {"input_ids": _prompt(gen, [IMAGE_ID] * count), "pixel_values": pixels, "image_sizes": sizes}


def _internvl(gen: torch.Generator):
    tile, patch, tiles, per_tile = 16, 4, 3, 4
    config = InternVLConfig(
        vision_config=InternVLVisionConfig(**_vision_kwargs(image_size=tile, patch_size=patch)),
        text_config=Qwen2Config(**_text_kwargs()),
        image_token_id=IMAGE_ID, image_seq_length=per_tile, downsample_ratio=0.5, tie_word_embeddings=False,
    )
    model = InternVLForConditionalGeneration(config)
    return model, {"input_ids": _prompt(gen, [IMAGE_ID] * (tiles * per_tile)), "pixel_values": _pixels(gen, tiles, 3, tile, tile)}


def _mllama(gen: torch.Generator):
    tile, max_tiles = 16, 4
    vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                attention_heads=4, vision_output_dim=64, image_size=tile, patch_size=4,
                                max_num_tiles=max_tiles, intermediate_layers_indices=[0])
    text = MllamaTextConfig(**_text_kwargs(num_hidden_layers=3), cross_attention_layers=[1])
    model = MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID))
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "cross_attn_attn_gate"):
                layer.cross_attn_attn_gate.fill_(1.0)
                layer.cross_attn_mlp_gate.fill_(1.0)
    input_ids = _prompt(gen, [IMAGE_ID])
    mask = torch.zeros(1, input_ids.shape[1], 1, max_tiles, dtype=torch.long)
    mask[0, int((input_ids[0] == IMAGE_ID).nonzero()[0]):, 0, :2] = 1
    return model, {"input_ids": input_ids, "pixel_values": _pixels(gen, 1, 1, max_tiles, 3, tile, tile),
                   "aspect_ratio_ids": torch.tensor([[2]]), "aspect_ratio_mask": torch.tensor([[[1, 1, 0, 0]]]),
                   "cross_attention_mask": mask}


_BUILDERS = {
    "llava_onevision": lambda gen: _onevision(gen, video=False),
    "llava_onevision_video": lambda gen: _onevision(gen, video=True),
    "internvl": _internvl,
    "mllama": _mllama,
}


def make_tiny_family(family: str, seed: int = 0) -> TinyCase:
    """The tiny model and batch-1 inputs of ``family`` (one of :data:`FAMILIES`); deterministic in ``seed``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, inputs = _BUILDERS[family](gen)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return TinyCase(family=family, model=_finalize(model), inputs=inputs, image_token_id=IMAGE_ID, is_vlm=True)
