"""Tiny random M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) with processor-like inputs.

Built from configs in code, never downloaded (as ``tiny_models.py`` does for the 1-D families, whose
token-id conventions they share: vocabulary 512, PAD 0, BOS 1, EOS 2 with a zeroed LM-head row).
Text decoders: 2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16 (8 rotary pairs split over
t, h, w by ``mrope_section``); vision towers: 2 layers, hidden 32, patch 4, 2 x 2 merge.

Prompt layout (as the Qwen processors lay it out): ``BOS + 5 text + <vision_start> + image
placeholders + <vision_end> + 4 text``; an image of 4 x 6 patches is 2 x 3 = 6 placeholder tokens,
whose M-RoPE positions span max(2, 3) = 3 text positions, so the decode offset is -3.
``video=True`` adds a video of 2 temporal patches of 4 x 4 after the image (8 video tokens), then
2 words; for Qwen3-VL as its processor lays it out, each temporal patch in its own vision block
after a one-token timestamp.
``mm_token_type_ids`` is included, as the processors return it (transformers' ``generate`` needs it).
"""

from __future__ import annotations

import torch
from tiny_models import BOS_ID, EOS_ID, PAD_ID, TEXT_HIGH, TEXT_LOW, VOCAB_SIZE, TinyCase, _finalize
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID = 500, 501, 502, 503
PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE_GRID = (1, 4, 6)  # (t, h, w) in patches
VIDEO_GRID = (2, 4, 4)  # two temporal patches (four frames)
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def _text(mrope_section, **extra) -> dict:
    return dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
                **extra)


_IDS = dict(image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
            vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)
_VISION = dict(depth=2, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3)


def _qwen2_vl():
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=_text([2, 3, 3]), vision_config=dict(_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2), **_IDS))


def _qwen2_5_vl():
    vision = dict(_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=16, fullatt_block_indexes=[1])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=_text([2, 3, 3]), vision_config=vision, **_IDS))


def _qwen3_vision() -> dict:
    return dict(_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=16,
                deepstack_visual_indexes=[0])


def _qwen3_vl():
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=_text([4, 2, 2], mrope_interleaved=True), vision_config=_qwen3_vision(), **_IDS))


def _qwen3_vl_moe():
    text = _text([4, 2, 2], mrope_interleaved=True, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 decoder_sparse_step=1)
    return Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=_qwen3_vision(), **_IDS))


BUILDERS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe}


def mrope_inputs(gen: torch.Generator, video: bool = False, before: int = 5, after: int = 4,
                 image_grid: tuple[int, int, int] | None = IMAGE_GRID, seconds_per_grid: float | None = None,
                 timestamped_frames: bool = False) -> dict[str, torch.Tensor]:
    """A prompt as a Qwen processor returns it: ``BOS + before words + image + [video + 2 words] +
    after words`` (``image_grid`` None: no image; ``seconds_per_grid``: Qwen2.5-VL's
    ``second_per_grid_ts`` for the video; ``timestamped_frames``: Qwen3-VL's video layout, each
    temporal patch its own vision block after a one-token timestamp)."""
    def words(n):
        return torch.randint(TEXT_LOW, TEXT_HIGH, (n,), generator=gen).tolist()

    def block(token, grid):
        return [VISION_START_ID] + [token] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [VISION_END_ID]

    ids = [BOS_ID] + words(before) + (block(IMAGE_ID, image_grid) if image_grid else [])
    if video and timestamped_frames:
        frame = (1, *VIDEO_GRID[1:])
        ids += [token for _ in range(VIDEO_GRID[0]) for token in words(1) + block(VIDEO_ID, frame)] + words(2)
    elif video:
        ids += block(VIDEO_ID, VIDEO_GRID) + words(2)
    ids += words(after)
    input_ids = torch.tensor([ids])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if image_grid:
        inputs["pixel_values"] = torch.randn(image_grid[0] * image_grid[1] * image_grid[2], PATCH_DIM, generator=gen)
        inputs["image_grid_thw"] = torch.tensor([image_grid])
    if video:
        inputs["pixel_values_videos"] = torch.randn(VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2], PATCH_DIM, generator=gen)
        inputs["video_grid_thw"] = torch.tensor([VIDEO_GRID])
        if seconds_per_grid is not None:
            inputs["second_per_grid_ts"] = torch.tensor([seconds_per_grid])
    if image_grid or video:
        inputs["mm_token_type_ids"] = ((input_ids == IMAGE_ID).int() + 2 * (input_ids == VIDEO_ID).int())
    return inputs


def sharpen_attention(model, scale: float = 6.0):
    """Scale the text decoder's query and key projections (attention logits x scale^2): at
    initialisation (std 0.02) attention is near uniform and greedy tokens barely depend on
    positions, so a wrong M-RoPE position would go unseen; sharpened, it changes the output."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "language_model" in name and (".q_proj." in name or ".k_proj." in name):
                parameter.mul_(scale)
    return model


def make_mrope(family: str, seed: int = 0, video: bool = False) -> TinyCase:
    """A tiny fp32 ``family`` model in eval mode (attention sharpened, :func:`sharpen_attention`)
    and batch-1 inputs (see the module docstring)."""
    torch.manual_seed(seed)
    model = sharpen_attention(_finalize(BUILDERS[family]()))
    inputs = mrope_inputs(torch.Generator().manual_seed(seed + 100), video=video,
                          seconds_per_grid=0.5 if video and family == "qwen2_5_vl" else None,
                          timestamped_frames=family.startswith("qwen3"))
    return TinyCase(family=family, model=model, inputs=inputs, image_token_id=IMAGE_ID, is_vlm=True)
