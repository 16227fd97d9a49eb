"""Tiny, randomly initialised models of every architecture mmspec supports.

Everything is built from configs in code -- nothing is ever downloaded -- so the
conformance suite runs offline and fast (each forward takes a few ms on CPU).

Public API
----------
``FAMILIES``
    Names of the supported families.
``make_tiny(family, seed=0) -> TinyCase``
    A tiny fp32 model in eval mode plus batch-size-1 model inputs laid out exactly
    as the family's real processor would produce them (image placeholder tokens
    already expanded, ``pixel_values`` / ``image_sizes`` / ``pixel_attention_mask``
    / ``token_type_ids`` as needed).
``make_text_only_draft(family_or_vocab_size, seed=1) -> LlamaForCausalLM``
    An independent tiny Llama sharing the target's text vocabulary, for use as a
    draft model.

Shared conventions (all families)
---------------------------------
* Text vocabulary of ``VOCAB_SIZE`` (512) ids; ``PAD_ID=0``, ``BOS_ID=1``,
  ``EOS_ID=2``.  Family-specific special tokens (image placeholder, begin/end of
  image, ...) live at the top of the vocabulary (>= 500); ordinary prompt text is
  drawn from ``[TEXT_LOW, TEXT_HIGH)``.
* ``generation_config`` has ``eos_token_id=EOS_ID`` and ``pad_token_id=PAD_ID``
  (so ``generate`` does not warn).  The EOS row of the LM head is zeroed, so its
  logit is exactly 0 while the other 511 logits are random: greedy decoding
  essentially never emits EOS and ``generate(max_new_tokens=n)`` returns exactly
  ``n`` new tokens.  Tests that need an early stop should pick an eos id that the
  model actually emits.
* Text decoders: 2-3 layers, hidden 64, 4 query / 2 KV heads (GQA), head_dim 16.
  Vision towers: 2 layers, hidden 32.
* Prompt layout: ``BOS + 7 text tokens + <image block> + 6 text tokens``.
* Gemma3 has sliding-window layers; ``sliding_window`` is 512, larger than any
  sequence the suite uses, so sliding layers behave like full attention.

Behaviour verified with transformers 5.23 for every family
----------------------------------------------------------
* After a prefill with images, text-only decode steps
  ``model(input_ids=..., cache=cache, position_ids=..., use_cache=True)``
  reproduce ``generate`` exactly (no pixel inputs, no ``token_type_ids``; there is
  no ``cache_position`` argument any more).
* ``DynamicCache.crop(-n)`` removes the last ``n`` tokens; a positive argument
  raises ``ValueError``.
* A custom 4-D ``attention_mask`` of shape ``[1, 1, q, kv]`` (float32 additive or
  bool) is passed through unchanged to the text decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import (
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    PreTrainedModel,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.image_processing_utils import select_best_resolution
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

FAMILIES: tuple[str, ...] = ("llama", "llava", "llava_next", "mistral3", "pixtral", "idefics3", "smolvlm", "gemma3")

# ---------------------------------------------------------------------------
# Shared token ids and sizes
# ---------------------------------------------------------------------------
VOCAB_SIZE = 512
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TEXT_LOW, TEXT_HIGH = 3, 480  # ordinary "word" tokens are drawn from this range
N_TEXT_BEFORE, N_TEXT_AFTER = 7, 6  # text tokens before (after BOS) / after the image block

# Family-specific special tokens (all inside the vocabulary).
IMAGE_ID = 500  # the image placeholder token, for every VLM family
IMG_BREAK_ID, IMG_END_ID = 501, 502  # pixtral (LLaVA and Mistral3 layouts)
FAKE_AROUND_IMAGE_ID, GLOBAL_IMG_ID = 503, 504  # idefics3 / smolvlm
BOI_ID, EOI_ID, NEWLINE2_ID = 505, 506, 507  # gemma3: <start_of_image>, <end_of_image>, "\n\n"

TEXT_HIDDEN = 64
VISION_HIDDEN = 32
SLIDING_WINDOW = 512


@dataclass
class TinyCase:
    """A tiny model plus inputs for one family.

    ``inputs`` always has batch size 1 and contains ``input_ids`` and
    ``attention_mask`` plus whatever multimodal inputs the family needs;
    ``model.generate(**inputs)`` and ``model(**inputs)`` both work as-is.
    """

    family: str
    model: PreTrainedModel
    inputs: dict[str, torch.Tensor]
    image_token_id: int | None
    is_vlm: bool

    @property
    def prompt_len(self) -> int:
        return self.inputs["input_ids"].shape[1]

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size


# ---------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------
def _text_kwargs(**overrides) -> dict:
    """Keyword arguments shared by every tiny text decoder config."""
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=TEXT_HIDDEN // 4,
        max_position_embeddings=1024,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return kwargs


def _vision_kwargs(**overrides) -> dict:
    """Keyword arguments shared by every tiny vision tower config."""
    kwargs = dict(
        hidden_size=VISION_HIDDEN,
        intermediate_size=2 * VISION_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_channels=3,
    )
    kwargs.update(overrides)
    return kwargs


def _text_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(TEXT_LOW, TEXT_HIGH, (n,), generator=gen).tolist()


def _prompt(gen: torch.Generator, image_block: list[int]) -> torch.Tensor:
    """``BOS + text + image_block + text`` as a ``[1, L]`` LongTensor."""
    ids = [BOS_ID] + _text_tokens(gen, N_TEXT_BEFORE) + image_block + _text_tokens(gen, N_TEXT_AFTER)
    return torch.tensor([ids], dtype=torch.long)


def _pixels(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _finalize(model: PreTrainedModel) -> PreTrainedModel:
    """fp32 + eval, generation config with valid eos/pad, EOS made un-emittable."""
    model = model.float().eval()
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    gc.do_sample = False
    with torch.no_grad():
        # EOS logit becomes exactly 0; greedy practically never picks it. (For tied
        # embeddings this also zeroes EOS's input embedding, which is harmless.)
        model.get_output_embeddings().weight[EOS_ID].zero_()
    return model


# ---------------------------------------------------------------------------
# Per-family builders: (gen) -> (model, inputs)
# The model is constructed under the caller's torch.manual_seed(seed).
# ---------------------------------------------------------------------------
Builder = Callable[[torch.Generator], tuple[PreTrainedModel, dict[str, torch.Tensor]]]


def _build_llama(gen: torch.Generator):
    model = LlamaForCausalLM(LlamaConfig(**_text_kwargs()))
    input_ids = _prompt(gen, [])
    return model, {"input_ids": input_ids}


def _clip_vision(image_size: int, patch_size: int) -> CLIPVisionConfig:
    return CLIPVisionConfig(
        **_vision_kwargs(image_size=image_size, patch_size=patch_size, projection_dim=VISION_HIDDEN)
    )


def _build_llava(gen: torch.Generator):
    """LLaVA-1.5 style: CLIP tower, CLS dropped ("default" strategy) -> (16/4)^2 = 16 tokens."""
    image_size, patch_size = 16, 4
    n_image_tokens = (image_size // patch_size) ** 2
    config = LlavaConfig(
        vision_config=_clip_vision(image_size, patch_size),
        text_config=LlamaConfig(**_text_kwargs()),
        image_token_index=IMAGE_ID,
        image_seq_length=n_image_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    model = LlavaForConditionalGeneration(config)
    inputs = {
        "input_ids": _prompt(gen, [IMAGE_ID] * n_image_tokens),
        "pixel_values": _pixels(gen, 1, 3, image_size, image_size),
    }
    return model, inputs


def _llava_next_num_image_tokens(orig_hw: tuple[int, int], tile: int, patch: int, pinpoints: list) -> int:
    """Number of image tokens, mirroring ``LlavaNextProcessor._get_number_of_features``
    with ``vision_feature_select_strategy="default"`` (CLS dropped)."""
    orig_h, orig_w = orig_hw
    best_h, best_w = select_best_resolution([orig_h, orig_w], pinpoints)
    per_side = tile // patch
    cur_h, cur_w = per_side * (best_h // tile), per_side * (best_w // tile)
    # unpadding of the high-res grid back to the original aspect ratio
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        cur_h -= ((cur_h - new_h) // 2) * 2
    else:
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        cur_w -= ((cur_w - new_w) // 2) * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    base = per_side * per_side  # base (low-res) tile, CLS already excluded
    return unpadded + newlines + base


def _build_llava_next(gen: torch.Generator):
    """LLaVA-NeXT anyres: 16px tiles, patch 4 (16 tokens per tile after dropping CLS).
    A 10x32 (HxW) image is matched to the 16x32 pinpoint -> 3 tiles (base + 1x2 grid); the 4x8
    grid features are unpadded to 2x8 rows, each row followed by ``image_newline``:
    16 (base) + 2*8 (grid) + 2 (newlines) = 34 image tokens."""
    tile, patch = 16, 4
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    orig_hw = (10, 32)
    best_h, best_w = select_best_resolution(list(orig_hw), pinpoints)
    n_tiles = 1 + (best_h // tile) * (best_w // tile)  # base image + grid tiles
    n_image_tokens = _llava_next_num_image_tokens(orig_hw, tile, patch, pinpoints)
    config = LlavaNextConfig(
        vision_config=_clip_vision(tile, patch),
        text_config=LlamaConfig(**_text_kwargs()),
        image_token_index=IMAGE_ID,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    model = LlavaNextForConditionalGeneration(config)
    inputs = {
        "input_ids": _prompt(gen, [IMAGE_ID] * n_image_tokens),
        "pixel_values": _pixels(gen, 1, n_tiles, 3, tile, tile),
        "image_sizes": torch.tensor([list(orig_hw)], dtype=torch.long),
    }
    return model, inputs


def _pixtral_parts(image_size: int, patch: int) -> dict:
    """The Pixtral vision tower and Mistral decoder configs of both Pixtral layouts."""
    return dict(vision_config=PixtralVisionConfig(**_vision_kwargs(image_size=image_size, patch_size=patch)),
                text_config=MistralConfig(**_text_kwargs(sliding_window=None)))


def _pixtral_inputs(gen: torch.Generator, height: int, width: int, pixels_per_token: int) -> dict[str, torch.Tensor]:
    """An image of height x width pixels as PixtralProcessor lays it out: a grid of [IMG] tokens
    (one per ``pixels_per_token``-pixel square), each row closed by [IMG_BREAK] and the last by [IMG_END]."""
    rows, cols = height // pixels_per_token, width // pixels_per_token
    image_block = ([IMAGE_ID] * cols + [IMG_BREAK_ID]) * rows
    image_block[-1] = IMG_END_ID
    return {
        "input_ids": _prompt(gen, image_block),
        "pixel_values": _pixels(gen, 1, 3, height, width),
        "image_sizes": torch.tensor([[height, width]], dtype=torch.long),
    }


def _build_mistral3(gen: torch.Generator):
    """Mistral3: Pixtral tower (patch 4) + 2x2 patch merger. A 32x24 image gives a 4x3 grid of
    [IMG] tokens, each row closed by [IMG_BREAK] and the last by [IMG_END] (as PixtralProcessor)."""
    patch, merge = 4, 2
    height, width = 32, 24
    config = Mistral3Config(
        **_pixtral_parts(max(height, width), patch),
        image_token_index=IMAGE_ID,
        spatial_merge_size=merge,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return Mistral3ForConditionalGeneration(config), _pixtral_inputs(gen, height, width, patch * merge)


def _build_pixtral(gen: torch.Generator):
    """Pixtral-12B's layout: transformers' LLaVA class with a Pixtral vision tower (patch 4, no
    patch merger), a Mistral decoder, all of the tower's features ("full" strategy, last layer).
    A 16x12 image gives a 4x3 grid of [IMG] tokens with the same breaks as Mistral3's."""
    patch = 4
    height, width = 16, 12
    config = LlavaConfig(
        **_pixtral_parts(max(height, width), patch),
        image_token_index=IMAGE_ID,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
    )
    return LlavaForConditionalGeneration(config), _pixtral_inputs(gen, height, width, patch)


def _idefics_like(config_cls, vision_config_cls, model_cls):
    """Builder for Idefics3 / SmolVLM (identical layout): SigLIP-like tower on a 32px image,
    patch 4 -> 64 patches, pixel-shuffle scale 2 -> 16 tokens, single un-split image:
    ``<fake_token_around_image><global-img><image>*16<fake_token_around_image>``."""

    def build(gen: torch.Generator):
        image_size, patch, scale = 32, 4, 2
        n_image_tokens = (image_size // patch) ** 2 // scale**2
        config = config_cls(
            vision_config=vision_config_cls(**_vision_kwargs(image_size=image_size, patch_size=patch)),
            text_config=LlamaConfig(**_text_kwargs()),
            image_token_id=IMAGE_ID,
            scale_factor=scale,
            pad_token_id=PAD_ID,
        )
        model = model_cls(config)
        image_block = [FAKE_AROUND_IMAGE_ID, GLOBAL_IMG_ID, *[IMAGE_ID] * n_image_tokens, FAKE_AROUND_IMAGE_ID]
        inputs = {
            "input_ids": _prompt(gen, image_block),
            "pixel_values": _pixels(gen, 1, 1, 3, image_size, image_size),  # [batch, n_images, C, H, W]
            "pixel_attention_mask": torch.ones(1, 1, image_size, image_size, dtype=torch.long),
        }
        return model, inputs

    return build


def _build_gemma3(gen: torch.Generator):
    """Gemma3: SigLIP tower on a 32px image, patch 4 -> 8x8 patches, avg-pooled to 16 tokens.
    Layout as Gemma3Processor: ``\\n\\n <start_of_image> <image>*16 <end_of_image> \\n\\n``;
    ``token_type_ids`` is 1 on the image tokens (bidirectional attention inside the image)."""
    image_size, patch, n_image_tokens = 32, 4, 16
    text_config = Gemma3TextConfig(
        **_text_kwargs(
            num_hidden_layers=3,
            tie_word_embeddings=True,
            query_pre_attn_scalar=TEXT_HIDDEN // 4,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    )
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(**_vision_kwargs(image_size=image_size, patch_size=patch)),
        text_config=text_config,
        mm_tokens_per_image=n_image_tokens,
        image_token_index=IMAGE_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
    )
    model = Gemma3ForConditionalGeneration(config)
    image_block = [NEWLINE2_ID, BOI_ID] + [IMAGE_ID] * n_image_tokens + [EOI_ID, NEWLINE2_ID]
    input_ids = _prompt(gen, image_block)
    inputs = {
        "input_ids": input_ids,
        "pixel_values": _pixels(gen, 1, 3, image_size, image_size),
        "token_type_ids": (input_ids == IMAGE_ID).long(),
    }
    return model, inputs


_BUILDERS: dict[str, Builder] = {
    "llama": _build_llama,
    "llava": _build_llava,
    "llava_next": _build_llava_next,
    "mistral3": _build_mistral3,
    "pixtral": _build_pixtral,
    "idefics3": _idefics_like(Idefics3Config, Idefics3VisionConfig, Idefics3ForConditionalGeneration),
    "smolvlm": _idefics_like(SmolVLMConfig, SmolVLMVisionConfig, SmolVLMForConditionalGeneration),
    "gemma3": _build_gemma3,
}
assert tuple(_BUILDERS) == FAMILIES


# ---------------------------------------------------------------------------
# Public factories
# ---------------------------------------------------------------------------
def make_tiny(family: str, seed: int = 0) -> TinyCase:
    """Build the tiny model and inputs for ``family``; deterministic in ``seed``."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, inputs = _BUILDERS[family](gen)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    is_vlm = family != "llama"
    return TinyCase(
        family=family,
        model=_finalize(model),
        inputs=inputs,
        image_token_id=IMAGE_ID if is_vlm else None,
        is_vlm=is_vlm,
    )


def make_text_only_draft(family_or_vocab_size: str | int = VOCAB_SIZE, seed: int = 1) -> LlamaForCausalLM:
    """A tiny 2-layer ``LlamaForCausalLM`` (hidden 32) with the same text vocab as the target.

    ``family_or_vocab_size`` is a family name from ``FAMILIES`` (all share ``VOCAB_SIZE``)
    or an explicit vocab size.  Use a ``seed`` different from the target's so the draft is
    an independent model.  Same eos/pad conventions as ``make_tiny``.
    """
    if isinstance(family_or_vocab_size, str):
        if family_or_vocab_size not in _BUILDERS:
            raise ValueError(f"unknown family {family_or_vocab_size!r}; expected one of {FAMILIES}")
        vocab_size = VOCAB_SIZE
    else:
        vocab_size = int(family_or_vocab_size)
    torch.manual_seed(seed)
    config = LlamaConfig(**_text_kwargs(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, head_dim=8))
    return _finalize(LlamaForCausalLM(config))


# ---------------------------------------------------------------------------
# Self-check: python tests/tiny_models.py
# ---------------------------------------------------------------------------
def _self_check(max_new_tokens: int = 12) -> None:
    from transformers import DynamicCache

    for family in FAMILIES:
        case = make_tiny(family)
        model, inputs = case.model, case.inputs
        prompt_len = case.prompt_len
        assert case.vocab_size == VOCAB_SIZE
        if case.is_vlm:
            assert int((inputs["input_ids"] == case.image_token_id).sum()) > 0

        with torch.no_grad():
            # 1. greedy generate
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
            assert out.shape == (1, prompt_len + max_new_tokens), (family, out.shape)

            # 2. manual greedy decode: prefill with images, then text-only steps with explicit positions
            cache = DynamicCache(config=model.config)
            logits = model(**inputs, cache=cache, use_cache=True, logits_to_keep=1).logits
            tokens = [int(logits[0, -1].argmax())]
            for pos in range(prompt_len, prompt_len + max_new_tokens - 1):
                step = model(
                    input_ids=torch.tensor([[tokens[-1]]]),
                    cache=cache,
                    position_ids=torch.tensor([[pos]]),
                    use_cache=True,
                )
                tokens.append(int(step.logits[0, -1].argmax()))
            assert tokens == out[0, prompt_len:].tolist(), (family, tokens, out[0, prompt_len:].tolist())

        draft = make_text_only_draft(family)
        assert draft.config.vocab_size == case.vocab_size
        print(f"{family:11s} ok  prompt_len={prompt_len:3d}  generated={tokens}")


if __name__ == "__main__":
    _self_check()


def tiny_llamagen(seed: int, dim: int = 32, vocab: int = 4, side: int = 2, prefix: int = 3, caption_dim: int = 8,
                  sharpen: float = 6.0):
    """A tiny random LlamaGen-style generator (2 layers, ``side`` x ``side`` codes of ``vocab``) as a
    guided image target; its output weights scaled by ``sharpen`` for sharper, more varied distributions."""
    from mmspec.adapters.image_gen import LlamaGenTarget
    from mmspec.modeling.llamagen import LlamaGenConfig, LlamaGenModel

    torch.manual_seed(seed)
    config = LlamaGenConfig(dim=dim, n_layer=2, n_head=2, vocab_size=vocab, cls_token_num=prefix, caption_dim=caption_dim,
                            block_size=side * side, multiple_of=16, rope_prefix="identity")
    model = LlamaGenModel(config).eval()
    with torch.no_grad():
        model.output.weight.mul_(sharpen)
    return LlamaGenTarget(model)
