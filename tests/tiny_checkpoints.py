"""Tiny *saved* VLM checkpoints (model + working processor) of every captioning family, offline.

``tests/tiny_models.py`` builds in-memory models with hand-made inputs; the captioning pipeline
instead loads a checkpoint directory with ``AutoProcessor`` + ``AutoModelForImageTextToText``,
exactly as it loads a user's real checkpoint. This module writes such directories: the real
SmolLM2 tokenizer (``mmspec.hub.smollm2_checkpoint()``, installed locally) plus each family's
image tokens, a ChatML chat template, the family's real image processor at a tiny resolution,
and a randomly initialised model whose config agrees with the processor (image token id,
vocabulary size = ``len(tokenizer)``, number of image tokens per image).

Sizes: text decoder 2 layers, hidden 32 (the ~49k-row embedding and LM head dominate: ~3M
parameters); vision towers 2 layers, hidden 32, on 16-32 px images. Building and saving one
checkpoint takes well under a second.

Public API
----------
``CHECKPOINT_FAMILIES``
    Families that can be written.
``save_tiny_checkpoint(family, directory, seed=0) -> Path``
    Write the checkpoint (model, processor, generation config) to ``directory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4TextConfig,
    Gemma4VideoProcessor,
    Gemma4VisionConfig,
    CLIPVisionConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaProcessor,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralProcessor,
    PixtralVisionConfig,
    PreTrainedModel,
    ProcessorMixin,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessor,
    SmolVLMProcessor,
    SiglipVisionConfig,
    SmolVLMVideoProcessor,
)
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

from mmspec.hub import smollm2_checkpoint

TEXT_HIDDEN = 32
VISION_HIDDEN = 32
EOS_TOKEN = "<|im_end|>"  # SmolLM2's end of turn


def chat_template(image_placeholder: str) -> str:
    """SmolLM2's ChatML (without its default system prompt); an image part becomes
    ``image_placeholder``, which the family's processor expands into the image token block."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image_placeholder
        + "{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def text_config(config_cls=LlamaConfig, **overrides):
    """A tiny text decoder over the whole tokenizer (vocab_size is set by the caller)."""
    kwargs = dict(
        hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=TEXT_HIDDEN // 4,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def vision_kwargs(**overrides) -> dict:
    kwargs = dict(hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, num_hidden_layers=2,
                  num_attention_heads=4, num_channels=3)
    kwargs.update(overrides)
    return kwargs


@dataclass(frozen=True)
class FamilySpec:
    """How to build one family's checkpoint.

    Attributes:
        image_tokens: special tokens added to SmolLM2's tokenizer; the first is the image token
            (the one repeated once per image feature).
        placeholder: what an image part of a chat message becomes before the processor expands it.
        processor: (tokenizer, chat_template) -> the family's processor at a tiny resolution.
        model: (vocab_size, token id of each ``image_tokens`` entry) -> a random model whose
            config agrees with ``processor``.
        named_tokens: tokens the processor reads as tokenizer attributes (``tokenizer.boi_token``);
            None when ``image_tokens`` are plain additional special tokens.
    """

    image_tokens: tuple[str, ...]
    placeholder: str
    processor: Callable[..., ProcessorMixin]
    model: Callable[[int, dict[str, int]], PreTrainedModel]
    named_tokens: dict[str, str] | None = None


# -- LLaVA-1.5: CLIP tower on 16 px, patch 4 -> 16 patch tokens (CLS dropped) ---------------------
def _llava_processor(tokenizer, template):
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=template)


def _llava_model(vocab_size, ids):
    return LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(**vision_kwargs(image_size=16, patch_size=4, projection_dim=VISION_HIDDEN)),
        text_config=text_config(vocab_size=vocab_size),
        image_token_index=ids["<image>"], image_seq_length=16,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
    ))


# -- LLaVA-NeXT: anyres over 16 px tiles (base tile + a grid chosen from the pinpoints) ------------
PINPOINTS = [[16, 32], [32, 16], [32, 32]]


def _llava_next_processor(tokenizer, template):
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                              image_grid_pinpoints=PINPOINTS)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=template)


def _llava_next_model(vocab_size, ids):
    return LlavaNextForConditionalGeneration(LlavaNextConfig(
        vision_config=CLIPVisionConfig(**vision_kwargs(image_size=16, patch_size=4, projection_dim=VISION_HIDDEN)),
        text_config=text_config(vocab_size=vocab_size),
        image_token_index=ids["<image>"], image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
    ))


# -- Pixtral towers: PixtralProcessor, patch 4; [IMG] rows closed by [IMG_BREAK], the last by [IMG_END] --
def _pixtral_processor(longest_edge: int, merge: int):
    """A processor factory: images scaled to ``longest_edge`` px, ``merge`` x ``merge`` patches per token."""

    def processor(tokenizer, template):
        image_processor = PixtralImageProcessor(size={"longest_edge": longest_edge}, patch_size=4)
        return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                                spatial_merge_size=merge, chat_template=template)

    return processor


def _pixtral_parts(image_size: int, vocab_size: int) -> dict:
    """The Pixtral vision tower and Mistral decoder configs both Pixtral layouts share."""
    return dict(vision_config=PixtralVisionConfig(**vision_kwargs(image_size=image_size, patch_size=4)),
                text_config=text_config(MistralConfig, vocab_size=vocab_size, sliding_window=None))


# Mistral3: longest edge 32 px, 2x2 merge -> up to 4x4 [IMG] + breaks
def _mistral3_model(vocab_size, ids):
    return Mistral3ForConditionalGeneration(Mistral3Config(
        **_pixtral_parts(32, vocab_size), image_token_index=ids["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1,
    ))


# Pixtral-12B: transformers' LLaVA class with the Pixtral tower, longest edge 16 px, no merge -> up to 4x4 [IMG]
def _pixtral_model(vocab_size, ids):
    return LlavaForConditionalGeneration(LlavaConfig(
        **_pixtral_parts(16, vocab_size), image_token_index=ids["[IMG]"], vision_feature_select_strategy="full",
        vision_feature_layer=-1, projector_hidden_act="gelu", multimodal_projector_bias=True,
    ))


# -- Idefics3 / SmolVLM: one un-split 32 px image, patch 4, pixel shuffle 2 -> 16 image tokens ------
def _idefics_like(processor_cls, image_processor_cls, config_cls, vision_config_cls, model_cls, **processor_extra):
    def processor(tokenizer, template):
        image_processor = image_processor_cls(do_image_splitting=False, size={"longest_edge": 32},
                                              max_image_size={"longest_edge": 32})
        extra = {name: make() for name, make in processor_extra.items()}
        return processor_cls(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=16,
                             chat_template=template, **extra)

    def model(vocab_size, ids):
        return model_cls(config_cls(
            vision_config=vision_config_cls(**vision_kwargs(image_size=32, patch_size=4)),
            text_config=text_config(vocab_size=vocab_size),
            image_token_id=ids["<image>"], scale_factor=2,
        ))

    return processor, model


_smolvlm = _idefics_like(SmolVLMProcessor, SmolVLMImageProcessor, SmolVLMConfig, SmolVLMVisionConfig,
                         SmolVLMForConditionalGeneration, video_processor=SmolVLMVideoProcessor)
_idefics3 = _idefics_like(Idefics3Processor, Idefics3ImageProcessor, Idefics3Config, Idefics3VisionConfig,
                          Idefics3ForConditionalGeneration)
IDEFICS_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


# -- Gemma3: SigLIP on 32 px, patch 4 -> 8x8 patches avg-pooled to 16 soft tokens -----------------
# Gemma3Processor reads its tokens from tokenizer attributes (boi_token, image_token, eoi_token).
GEMMA3_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}


def _gemma3_processor(tokenizer, template):
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=16,
                           chat_template=template)


def _gemma3_model(vocab_size, ids):
    return Gemma3ForConditionalGeneration(Gemma3Config(
        vision_config=SiglipVisionConfig(**vision_kwargs(image_size=32, patch_size=4)),
        text_config=text_config(Gemma3TextConfig, vocab_size=vocab_size, query_pre_attn_scalar=TEXT_HIDDEN // 4,
                                sliding_window=512, layer_types=["sliding_attention", "full_attention"]),
        mm_tokens_per_image=16, image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
    ))

# -- Gemma 4: patch 2, 2x2 pooling, at most 70 soft tokens (280 patches, an image of ~32 x 32 px) -----
# (transformers 5.24's pooler keeps the padding patches instead of the image's when it does not
# pool, so pooling 1 fails.) Gemma4Processor reads its image and audio tokens from tokenizer
# attributes; sliding window 8, so that every caption outgrows it.
GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def _gemma4_processor(tokenizer, template):
    image_processor = Gemma4ImageProcessor(patch_size=2, pooling_kernel_size=2, max_soft_tokens=70)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                           tokenizer=tokenizer, video_processor=Gemma4VideoProcessor(), image_seq_length=70,
                           chat_template=template)


def _gemma4_model(vocab_size, ids):
    text = text_config(Gemma4TextConfig, vocab_size=vocab_size, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                       hidden_size_per_layer_input=4, vocab_size_per_layer_input=vocab_size, num_kv_shared_layers=1,
                       final_logit_softcapping=30.0, use_bidirectional_attention="vision", tie_word_embeddings=True)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2,
                                position_embedding_size=64)
    return Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=ids["<|image|>"],
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], audio_token_id=ids["<|audio|>"],
        boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"], video_token_id=ids["<|image|>"],
    ))


# -- Qwen2-VL: 3-D M-RoPE; images resized to 16-32 px (multiples of patch 4 x merge 2), 2 x 2 patches per token --
QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen2_vl_processor(tokenizer, template):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    sizes = dict(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=4, merge_size=2, temporal_patch_size=2)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(**sizes), chat_template=template)


def _qwen2_vl_model(vocab_size, ids):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, embed_dim=VISION_HIDDEN, hidden_size=TEXT_HIDDEN, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False))


def _qwen2_5_vl_processor(tokenizer, template):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    sizes = dict(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=4, merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(**sizes), chat_template=template)


def _qwen_ids(ids) -> dict:
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _qwen_text(vocab_size, **extra) -> dict:
    """A 2-layer decoder, head_dim 8: 4 rotary pairs split t, h, w = 2, 1, 1."""
    return dict(vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}, **extra)


def _qwen2_5_vl_model(vocab_size, ids):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=2, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, out_hidden_size=TEXT_HIDDEN, num_heads=4,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=_qwen_text(vocab_size), vision_config=vision,
                                                               **_qwen_ids(ids)))


def _qwen3_vl_model(moe: bool):
    """Qwen3-VL (or -MoE): deepstack features from vision layer 0, interleaved M-RoPE."""
    def model(vocab_size, ids):
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        text = _qwen_text(vocab_size, mrope_interleaved=True)
        if moe:
            text.update(moe_intermediate_size=TEXT_HIDDEN, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        vision = dict(depth=1, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, out_hidden_size=TEXT_HIDDEN,
                      num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        config_class, model_class = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                                     else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
        return model_class(config_class(text_config=text, vision_config=vision, **_qwen_ids(ids)))
    return model


# -- LLaVA-OneVision: SigLIP on 16 px tiles, patch 4, anyres over 16 px pinpoints; Qwen2 decoder ---
def _onevision_processor(tokenizer, template):
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    image_processor = LlavaOnevisionImageProcessor(size={"height": 16, "width": 16}, image_grid_pinpoints=ONEVISION_PINPOINTS)
    video_processor = LlavaOnevisionVideoProcessor(size={"height": 16, "width": 16})
    return LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                                   num_image_tokens=16, vision_feature_select_strategy="full", chat_template=template)


ONEVISION_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]


def _onevision_model(vocab_size, ids):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config

    return LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**vision_kwargs(image_size=16, patch_size=4)),
        text_config=text_config(Qwen2Config, vocab_size=vocab_size),
        image_token_index=ids["<image>"], video_token_index=ids["<video>"], image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    ))


# -- InternVL: InternViT on 16 px tiles, patch 4, pixel shuffle 0.5 -> 4 tokens a tile; Qwen2 -------
# InternVLProcessor reads its tokens from tokenizer attributes.
INTERNVL_TOKENS = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
                   "video_token": "<video>"}


def _internvl_processor(tokenizer, template):
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    image_processor = GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1, max_patches=4)
    return InternVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                             video_processor=InternVLVideoProcessor(size={"height": 16, "width": 16}),
                             image_seq_length=4, chat_template=template)


def _internvl_model(vocab_size, ids):
    from transformers import InternVLConfig, InternVLForConditionalGeneration, Qwen2Config
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    return InternVLForConditionalGeneration(InternVLConfig(
        vision_config=InternVLVisionConfig(**vision_kwargs(image_size=16, patch_size=4)),
        text_config=text_config(Qwen2Config, vocab_size=vocab_size),
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False,
    ))


# -- Mllama: 16 px tiles (4 at most), patch 4; 3 text layers, layer 1 cross-attention (gates 1) ----
def _mllama_processor(tokenizer, template):
    from transformers import MllamaImageProcessor, MllamaProcessor

    image_processor = MllamaImageProcessor(size={"height": 16, "width": 16}, max_image_tiles=4)
    return MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _mllama_model(vocab_size, ids):
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig

    vision = MllamaVisionConfig(hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, num_hidden_layers=2,
                                num_global_layers=1, attention_heads=4, vision_output_dim=2 * VISION_HIDDEN, image_size=16,
                                patch_size=4, max_num_tiles=4, intermediate_layers_indices=[0])
    text = text_config(MllamaTextConfig, vocab_size=vocab_size, num_hidden_layers=3, cross_attention_layers=[1], pad_token_id=None,
                       bos_token_id=0, eos_token_id=0)  # (in range; generation stops at the checkpoint's EOS)
    del text.head_dim
    model = MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text, image_token_index=ids["<|image|>"]))
    with torch.no_grad():  # zero at initialisation: an untrained model would ignore the image
        model.model.language_model.layers[1].cross_attn_attn_gate.fill_(1.0)
        model.model.language_model.layers[1].cross_attn_mlp_gate.fill_(1.0)
    return model


# -- Qwen3.5: Qwen3-VL's processor (16-32 px, patch 4, 2 x 2 merge) over a hybrid decoder: Gated DeltaNet,
#    attention, Gated DeltaNet, attention; 3-D M-RoPE on half of each head --------------------------------------
def _qwen3_vl_processor(tokenizer, template):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=16 * 16, max_pixels=32 * 32, **sizes),
                            tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(**sizes), chat_template=template)


def _qwen3_5_model(vocab_size, ids, moe: bool = False):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=4,
                layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT_HIDDEN, num_position_embeddings=64)
    if moe:
        text.update(moe_intermediate_size=TEXT_HIDDEN, shared_expert_intermediate_size=TEXT_HIDDEN, num_experts=4,
                    num_experts_per_tok=2)
    config_class, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                                 else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    return model_class(config_class(text_config=text, vision_config=vision, **_qwen_ids(ids)))


# -- LFM2-VL: SigLIP2 (NaFlex) on 16-32 px images, patch 4, 2 x 2 pixel unshuffle, no tiling; LFM2 decoder ----------
LFM2_VL_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")


def _lfm2_vl_processor(tokenizer, template):
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    image_processor = Lfm2VlImageProcessor(encoder_patch_size=4, min_image_tokens=2, max_image_tokens=16, tile_size=16,
                                           do_image_splitting=False, downsample_factor=2)
    return Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _lfm2_vl_model(vocab_size, ids):
    """Short-convolution layers 0 and 2, attention layers 1 and 3 (the hybrid layout of LFM2)."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    text = dict(model_type="lfm2", vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
                max_position_embeddings=2048, tie_word_embeddings=False)
    vision = dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=4, num_patches=64, num_channels=3)
    return Lfm2VlForConditionalGeneration(Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=ids["<image>"],
                                                       projector_hidden_size=32, downsample_factor=2, tie_word_embeddings=False))


FAMILY_SPECS: dict[str, FamilySpec] = {
    "llava": FamilySpec(("<image>",), "<image>", _llava_processor, _llava_model),
    "llava_next": FamilySpec(("<image>",), "<image>", _llava_next_processor, _llava_next_model),
    "mistral3": FamilySpec(PIXTRAL_TOKENS, "[IMG]", _pixtral_processor(32, merge=2), _mistral3_model),
    "pixtral": FamilySpec(PIXTRAL_TOKENS, "[IMG]", _pixtral_processor(16, merge=1), _pixtral_model),
    "idefics3": FamilySpec(IDEFICS_TOKENS, "<image>", *_idefics3),
    "smolvlm": FamilySpec(IDEFICS_TOKENS, "<image>", *_smolvlm),
    "gemma3": FamilySpec(tuple(GEMMA3_TOKENS.values()), "<start_of_image>", _gemma3_processor, _gemma3_model,
                         named_tokens=GEMMA3_TOKENS),
    "gemma4": FamilySpec(tuple(GEMMA4_TOKENS.values()), "<|image|>", _gemma4_processor, _gemma4_model,
                         named_tokens=GEMMA4_TOKENS),
    "qwen2_vl": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen2_vl_processor, _qwen2_vl_model),
    "qwen2_5_vl": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen2_5_vl_processor, _qwen2_5_vl_model),
    "qwen3_vl": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen3_vl_processor, _qwen3_vl_model(moe=False)),
    "qwen3_vl_moe": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen3_vl_processor, _qwen3_vl_model(moe=True)),
    "llava_onevision": FamilySpec(("<image>", "<video>"), "<image>", _onevision_processor, _onevision_model),
    "internvl": FamilySpec(tuple(INTERNVL_TOKENS.values()), "<IMG_CONTEXT>", _internvl_processor, _internvl_model,
                           named_tokens=INTERNVL_TOKENS),
    "mllama": FamilySpec(("<|image|>", "<|python_tag|>"), "<|image|>", _mllama_processor, _mllama_model),
    "lfm2_vl": FamilySpec(LFM2_VL_TOKENS, "<image>", _lfm2_vl_processor, _lfm2_vl_model),
    "qwen3_5": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen3_vl_processor, _qwen3_5_model),
    "qwen3_5_moe": FamilySpec(QWEN_TOKENS, QWEN_PLACEHOLDER, _qwen3_vl_processor,
                              lambda vocab_size, ids: _qwen3_5_model(vocab_size, ids, moe=True)),
}
CHECKPOINT_FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)


def save_tiny_checkpoint(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``family`` checkpoint with a working processor to ``directory``.

    The generation config stops at SmolLM2's ``<|im_end|>``. The model is fp32 and deterministic
    in ``seed`` (the global RNG is left as it was).
    """
    spec = FAMILY_SPECS[family]
    directory = Path(directory)
    if spec.named_tokens:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint(), extra_special_tokens=spec.named_tokens)
    else:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
        tokenizer.add_special_tokens({"additional_special_tokens": list(spec.image_tokens)})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in spec.image_tokens}
    processor = spec.processor(tokenizer, chat_template(spec.placeholder))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = spec.model(len(tokenizer), ids).float().eval()
    generation = model.generation_config
    generation.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = None
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def save_tiny_draft(directory: str | Path, vocab_size: int, seed: int = 1) -> Path:
    """Write a tiny random text-only ``LlamaForCausalLM`` (a draft for the SPD setting: it shares
    the checkpoints' tokenizer, so pass ``len(tokenizer)`` as ``vocab_size``)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(text_config(vocab_size=vocab_size, num_hidden_layers=1)).eval()
    model.save_pretrained(directory)
    return Path(directory)


_SESSION_CACHE: dict[tuple[str, int], Path] = {}


def cached_tiny_checkpoint(family: str, tmp_path_factory, seed: int = 0) -> Path:
    """``save_tiny_checkpoint`` once per test session (``tmp_path_factory`` is pytest's fixture).
    Treat the directory as read-only: copy it before adding files."""
    key = (family, seed)
    if key not in _SESSION_CACHE:
        _SESSION_CACHE[key] = save_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=seed)
    return _SESSION_CACHE[key]


def write_eagle3_images(checkpoint: Path, folder: Path) -> None:
    """For a benchmark of an EAGLE-3 head on a VLM checkpoint: a random head for its decoder in
    ``folder/head`` and a ``folder/data.jsonl`` of two 32 px images (groups red and blue) with a
    prompt each."""
    import json

    from PIL import Image
    from transformers import AutoConfig

    from mmspec.modeling.eagle3 import Eagle3Config, Eagle3Head

    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(checkpoint).text_config)).eval()
    head.save(folder / "head", target="tiny")
    rows = []
    for group, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        Image.new("RGB", (32, 32), colour).save(folder / f"{group}.png")
        rows.append({"image": f"{group}.png", "prompt": "Describe this image.", "group": group})
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_eagle3_lm(folder: Path) -> list[dict]:
    """The same for a text LM: a tiny random causal LM with the SmolLM2 tokenizer in ``folder/lm``
    (its end of turn as end of sequence), a random EAGLE-3 head in ``folder/head`` and two prompts
    in ``folder/prompts.jsonl`` (returned)."""
    import json

    from transformers import LlamaForCausalLM

    from mmspec.hub import smollm2_checkpoint
    from mmspec.modeling.eagle3 import Eagle3Config, Eagle3Head

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    save_tiny_draft(folder / "lm", len(tokenizer), seed=3)
    model = LlamaForCausalLM.from_pretrained(folder / "lm")
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(folder / "lm")
    tokenizer.save_pretrained(folder / "lm")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Eagle3Head(Eagle3Config.for_target(model.config)).eval().save(folder / "head", target="tiny")
    rows = [{"prompt": "Name three colours.", "group": "a"}, {"prompt": "Count from one to five.", "group": "b"}]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows
