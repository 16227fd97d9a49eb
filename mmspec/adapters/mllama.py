"""Llama-3.2-Vision (transformers' ``MllamaForConditionalGeneration``) as a speculative target.

Mllama does not put image features into the token sequence: the prompt holds one ``<|image|>``
token per image, and a few decoder layers (``text_config.cross_attention_layers``) attend from
every text token to the image tiles' states. In the prefill each such layer projects the image
states once into keys and values of shape [1, H_kv, images x tiles x patches, D] and caches them;
every later forward reads them from the cache (transformers skips a cross-attention layer whose
cache is empty: a prompt without an image).

Speculation moves only the self-attention caches. The cross-attention keys and values belong to
the image, not to any text position, so a rollback (crop), a tree compaction or a layer-skip
draft's crop must leave them as the prefill wrote them: :class:`ImageKVLayer` holds them and
ignores every crop, and :class:`CrossAttentionCache` compacts only its self-attention layers.

Decoding steps also take the cross-attention mask row of each new token: transformers' generate
repeats the prompt's last row of ``cross_attention_mask`` [1, L, images, tiles] for every token
it appends (``_update_model_kwargs_for_generation``); :meth:`MllamaHooks.step_inputs` gives a
forward of n tokens (a chain or a tree's nodes) that row n times, so a step computes what
generate's step computes.

Batches are refused: each row's image keys/values (of its own number of images and tiles) and its
mask row would need stacking that the batch cache (:mod:`mmspec.core.batch`) does not do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core.cache import PreallocatedLayer, compact_cache
from .hf import FamilyHooks, register_family


class ImageKVLayer(DynamicLayer):
    """A cross-attention cache layer: the image's keys and values [1, H_kv, N_image, D], written
    once by the prefill and never rolled back (``crop`` keeps them; they have no text position)."""

    def crop(self, tokens_to_remove: int) -> None:
        """Keep the image's keys and values: a rollback of text tokens does not reach them."""


class CrossAttentionCache(DynamicCache):
    """Mllama's cache: :class:`~mmspec.core.cache.PreallocatedLayer` self-attention layers (rollback
    by bookkeeping) and :class:`ImageKVLayer` cross-attention layers, and the prompt's last
    cross-attention mask row, which every later token repeats.

    Args:
        config: the model's config (its text config names the cross-attention layers).
        mask_row: LongTensor [1, 1, images, tiles] or None (no mask given with the prompt: later
            tokens pass none either, as in transformers' generate).
    """

    def __init__(self, config, mask_row: torch.Tensor | None) -> None:
        super().__init__(config=config)
        text = config.get_text_config(decoder=True)
        self.cross_layers = frozenset(text.cross_attention_layers or ())
        count = text.num_hidden_layers
        self.layers = [ImageKVLayer() if i in self.cross_layers else PreallocatedLayer() for i in range(count)]
        self.layer_class_to_replicate = None
        self.self_attention = [i for i in range(count) if i not in self.cross_layers]
        if not self.self_attention:
            raise ValueError("an Mllama text model without self-attention layers holds no sequence to speculate on")
        self.mask_row = mask_row

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cached text positions (a cross-attention layer's index answers for the first self-attention layer)."""
        if layer_idx in self.cross_layers:
            layer_idx = self.self_attention[0]
        return super().get_seq_length(layer_idx)

    def compact_tree(self, start: int, path: torch.Tensor) -> None:
        """Tree verification: keep positions [0, start) and ``start + path`` of the self-attention
        layers (:func:`~mmspec.core.cache.compact_cache`); the image's keys and values stay."""
        view = DynamicCache()
        view.layer_class_to_replicate = None
        view.layers = [self.layers[i] for i in self.self_attention]
        compact_cache(view, start, path)


@register_family("mllama")
class MllamaHooks(FamilyHooks):
    """The cross-attention cache and the decoding steps' ``cross_attention_mask`` of Mllama."""

    batch_size_one_reason = ("keeps each row's image keys/values in cross-attention cache layers that mmspec's "
                             "batch cache does not stack")

    def check_inputs(self, model_inputs: dict[str, Any], input_ids: torch.Tensor) -> None:
        mask = model_inputs.get("cross_attention_mask")
        if mask is not None and (mask.dim() != 4 or tuple(mask.shape[:2]) != tuple(input_ids.shape)):
            raise ValueError(f"cross_attention_mask has shape {list(mask.shape)}; it must be [1, {input_ids.shape[1]}, "
                             "images, tiles], one row per prompt token: pass the processor's output unchanged")
        if model_inputs.get("pixel_values") is not None and model_inputs.get("aspect_ratio_ids") is None:
            raise ValueError("pixel_values need aspect_ratio_ids (and aspect_ratio_mask); pass the processor's full output")

    def make_cache(self, config, model_inputs: dict[str, Any], windows: bool = True) -> CrossAttentionCache:
        # (windows: Mllama's self-attention layers are all full attention, nothing to change)
        mask = model_inputs.get("cross_attention_mask")
        return CrossAttentionCache(config, None if mask is None else mask[:, -1:].clone())

    def step_inputs(self, cache, num_tokens: int) -> dict[str, Any]:
        """``cross_attention_mask`` [1, num_tokens, images, tiles]: the prompt's last row per token."""
        row = getattr(cache, "mask_row", None)
        return {} if row is None else {"cross_attention_mask": row.expand(-1, num_tokens, -1, -1)}

    def extend_inputs(self, model_inputs: dict[str, Any], num_tokens: int) -> dict[str, Any]:
        """``cross_attention_mask`` [1, L + num_tokens, images, tiles]: the prompt's rows, then its
        last row once per appended token (what :meth:`step_inputs` gives the decoding steps)."""
        mask = model_inputs.get("cross_attention_mask")
        if mask is None:
            return {}
        return {"cross_attention_mask": torch.cat([mask, mask[:, -1:].expand(-1, num_tokens, -1, -1)], dim=1)}
