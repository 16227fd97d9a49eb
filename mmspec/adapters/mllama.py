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

Batches: each row is prefilled alone (its own images and tiles), then the rows are stacked
(:class:`~mmspec.core.cache.RowStateLayer`). Row b's image keys and values [1, H_kv, I_b T_b P, D]
(I_b images of T_b tiles of P states each) are zero-padded to the row with the most tiles; its
mask row is flattened to [1, 1, 1, I_b T_b] (transformers flattens images and tiles in this same
order before it repeats each tile's entry over its P states) and padded with 0, so no row attends
to a padded tile (its additive mask is the dtype's minimum: softmax weight 0). A row without an
image is all padding, all masked: transformers then zeroes its cross-attention and MLP outputs
(``full_text_row_masked_out_mask``), which leaves its hidden states exactly as a skipped layer
does (its batch-1 forward). The keys and values are never rolled back; every step repeats each
row's own mask row for its new tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core.cache import PreallocatedLayer, RowStateLayer, compact_cache
from .hf import FamilyHooks, register_family


class ImageKVLayer(RowStateLayer, DynamicLayer):
    """A cross-attention cache layer: the image's keys and values [B, H_kv, N_image, D], written
    once by the prefill and never rolled back (``crop`` keeps them; they have no text position),
    and the mask row its tiles take in every later step.

    Args:
        mask_row: LongTensor [B, 1, images, tiles] (a batch's rows: [B, 1, 1, tiles], images and
            tiles flattened), or None (no mask given with the prompt: later tokens pass none either,
            as in transformers' generate).
        patches: P, the states per tile (the vision tower's patches and class token).

    Attributes:
        tiles: a batch's rows (:meth:`stack_rows`): LongTensor [B], the tiles of each row's own
            keys (0: no image); None for one sequence.
    """

    def __init__(self, mask_row: torch.Tensor | None = None, patches: int = 1) -> None:
        super().__init__()
        self.mask_row = mask_row
        self.patches = patches
        self.tiles: torch.Tensor | None = None

    def crop(self, tokens_to_remove: int) -> None:
        """Keep the image's keys and values: a rollback of text tokens does not reach them."""

    def keep_rows(self, kept: list[int]) -> None:
        """Nothing per text position: every row keeps its image whatever it accepts."""

    def _has_image(self) -> bool:
        return self.is_initialized and self.keys is not None and self.keys.numel() > 0

    def _row_tiles(self) -> torch.Tensor:
        """LongTensor [B]: each row's own tiles (one sequence: its keys' tiles, or 0 without an image)."""
        if self.tiles is not None:
            return self.tiles
        return torch.tensor([self.keys.shape[-2] // self.patches if self._has_image() else 0])

    def _row_masks(self) -> torch.Tensor:
        """LongTensor [B, tiles]: each row's mask over its tiles (the prompt's last row flattened; all
        1 where the prompt gave none; 0 on a batch's padding)."""
        tiles = self._row_tiles()
        width = self.keys.shape[-2] // self.patches if self._has_image() else 0
        if self.mask_row is not None and self._has_image():
            mask = self.mask_row.reshape(self.mask_row.shape[0], -1)
            if mask.shape[1] != width:
                raise ValueError(f"cross_attention_mask covers {mask.shape[1]} tiles for image keys of {width} tiles of "
                                 f"{self.patches} states; pass the processor's output unchanged")
            return mask
        return (torch.arange(width)[None, :] < tiles[:, None]).long()

    @classmethod
    def _stacked(cls, parts: list["ImageKVLayer"]) -> "ImageKVLayer":
        """The rows of ``parts`` in one layer: keys / values zero-padded to the most tiles, each row's
        tile mask [rows, 1, 1, tiles] 0 on its padding (a row with an image and no mask: 1 on its
        tiles; a row without an image: all padding)."""
        patches = parts[0].patches
        tiles = torch.cat([p._row_tiles() for p in parts])
        layer = cls(None, patches)
        layer.tiles = tiles
        with_image = [p for p in parts if p._has_image()]
        if not with_image:  # no row has an image: the layer stays empty and transformers skips it
            return layer
        like, width = with_image[0].keys, int(tiles.max())
        keys, values, masks = [], [], []
        for p, rows in zip(parts, (p._row_tiles().shape[0] for p in parts)):
            if p._has_image():
                keys.append(F.pad(p.keys, (0, 0, 0, width * patches - p.keys.shape[-2])))
                values.append(F.pad(p.values, (0, 0, 0, width * patches - p.values.shape[-2])))
                mask = p._row_masks().to(like.device)
                masks.append(F.pad(mask, (0, width - mask.shape[1])))
            else:
                keys.append(like.new_zeros(rows, *like.shape[1:-2], width * patches, like.shape[-1]))
                values.append(like.new_zeros(rows, *like.shape[1:-2], width * patches, like.shape[-1]))
                masks.append(torch.zeros(rows, width, dtype=torch.long, device=like.device))
        if any(p.mask_row is not None for p in parts) or not bool((tiles == width).all()):
            layer.mask_row = torch.cat(masks)[:, None, None, :]  # (else no prompt gave a mask, none is needed: none, as alone)
        layer.update(torch.cat(keys), torch.cat(values))
        return layer

    @classmethod
    def stack_rows(cls, layers: list["ImageKVLayer"], shared: dict) -> "ImageKVLayer":
        return cls._stacked(layers)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.tiles = self._row_tiles().index_select(0, rows.cpu())
        if self.mask_row is not None:
            self.mask_row = self.mask_row.index_select(0, rows.to(self.mask_row.device))
        if self._has_image():
            rows = rows.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def join_rows(self, other: "ImageKVLayer", shared: dict) -> None:
        joined = self._stacked([self, other])
        self.mask_row, self.tiles, self.keys, self.values = joined.mask_row, joined.tiles, joined.keys, joined.values
        self.is_initialized = joined.is_initialized

    def draft_mask(self) -> torch.Tensor | None:
        """A batch's rows with padded tiles: LongTensor [B, 1, 1, tiles], 1 on each row's own tiles;
        None where no row is padded. A shallow draft alone passes no cross-attention mask (it sees
        every tile of its image); over a batch this mask hides only the padding (and a row without
        an image sees none, which leaves its hidden states as a skipped layer does)."""
        if self.tiles is None or not self._has_image():
            return None
        width = self.keys.shape[-2] // self.patches
        if bool((self.tiles == width).all()):
            return None
        return (torch.arange(width)[None, :] < self.tiles[:, None]).long().to(self.keys.device)[:, None, None, :]


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
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2 + 1  # per tile: its patches and class token
        self.layers = [ImageKVLayer(mask_row, patches) if i in self.cross_layers else PreallocatedLayer() for i in range(count)]
        self.layer_class_to_replicate = None
        self.self_attention = [i for i in range(count) if i not in self.cross_layers]
        if not self.self_attention:
            raise ValueError("an Mllama text model without self-attention layers holds no sequence to speculate on")

    @property
    def mask_row(self) -> torch.Tensor | None:
        """The prompt's last cross-attention mask row [1, 1, images, tiles] (its cross layers')."""
        return self.layers[min(self.cross_layers)].mask_row if self.cross_layers else None

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
        """``cross_attention_mask`` [B, num_tokens, images, tiles]: each row's prompt's last row per
        token (the cross layers' mask row; a batch's rows padded, see the module docstring)."""
        row = next((layer.mask_row for layer in cache.layers if isinstance(layer, ImageKVLayer)), None)
        return {} if row is None else {"cross_attention_mask": row.expand(-1, num_tokens, -1, -1)}

    def draft_inputs(self, cache, num_tokens: int) -> dict[str, Any]:
        """A shallow draft (the text model's first layers) over a batch whose rows' tiles are padded:
        the text model's prepared cross-attention inputs hiding the padding
        (:meth:`ImageKVLayer.draft_mask`); none otherwise. As transformers prepares them from a mask
        m [B, n, 1, tiles] (each tile's entry repeated over its P states): the additive mask
        [B, 1, n, tiles P] (0 where m = 1, the dtype's minimum elsewhere) times the row mask
        r [B, 1, n, 1] (1 where a token sees any tile), and r, which zeroes a row that sees none."""
        layer = next((layer for layer in cache.layers if isinstance(layer, ImageKVLayer)), None)
        mask = None if layer is None else layer.draft_mask()
        if mask is None:
            return {}
        dtype = layer.keys.dtype
        seen = mask.expand(-1, num_tokens, -1, -1).repeat_interleave(layer.patches, dim=3).flatten(2)[:, None]  # [B, 1, n, N]
        additive = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(seen == 0, torch.finfo(dtype).min)
        sees = seen.bool().any(dim=-1, keepdim=True).to(dtype)  # [B, 1, n, 1]
        return {"cross_attention_mask": additive * sees, "full_text_row_masked_out_mask": sees}

    def extend_inputs(self, model_inputs: dict[str, Any], num_tokens: int) -> dict[str, Any]:
        """``cross_attention_mask`` [1, L + num_tokens, images, tiles]: the prompt's rows, then its
        last row once per appended token (what :meth:`step_inputs` gives the decoding steps)."""
        mask = model_inputs.get("cross_attention_mask")
        if mask is None:
            return {}
        return {"cross_attention_mask": torch.cat([mask, mask[:, -1:].expand(-1, num_tokens, -1, -1)], dim=1)}
