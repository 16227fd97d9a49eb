"""Position schemes: the position ids a transformers target's prompt takes, and those after it.

A :class:`~mmspec.adapters.hf.TransformersTarget` asks its family's scheme once, at the prefill,
for two things: the prompt's position ids (None: the model's default, token index i at position i)
and the *offset* of every later position, ``SequenceState.position_offset``: the token at cache
index j >= L (L = prompt length) takes position j + offset. Everything after the prefill then
follows from the cache length alone, as for any 1-D family: a drafted chain's tokens take
``cache_length + offset + (0, 1, ...)``, a tree node at depth d takes ``cache_length + offset + d - 1``
(:func:`~mmspec.core.tree.tree_position_ids`: one after its parent), a rollback moves the cache
length and so the next position, and a batch row keeps its own offset.

Schemes are classes registered by name (:data:`POSITION_SCHEMES`) and picked by the config's
``model_type`` (:data:`FAMILY_SCHEMES`); a family not listed takes ``"index"``.

M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; Wang et al. 2024, "Qwen2-VL", section 2.1):
the rotary angle of each head dimension pair is driven by one of three position components,
temporal t, height h and width w (``rope_parameters["mrope_section"]`` splits the pairs). A text
token has t = h = w = its text position; the tokens of an image of merged grid (T, H', W') starting
at text position s take (s + t, s + h, s + w) for t < T, h < H', w < W' (a video's t is scaled by
its frame interval in Qwen2.5-VL), and the text after it resumes at s + max(H', W') (transformers
5.24). The prompt's positions P [3, 1, L] are the model's own ``get_rope_index``; every later
token is text, at
    p_j = j + delta in all three sections,   delta = max(P) + 1 - L   (<= 0 after an image),
which is a 1-D position id [B, n] (the Qwen text decoders expand 2-D position ids to three equal
rows), so drafting, verification, trees, rollback and batches need nothing beyond the offset.
The model's own ``rope_deltas`` attribute (which transformers' ``generate`` keeps on the model
between calls) is never read or written: every mmspec forward passes its position ids.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn

from ..core.registry import class_registrar

#: name -> position scheme class (:func:`register_position_scheme`)
POSITION_SCHEMES: dict[str, type["PositionScheme"]] = {}
register_position_scheme = class_registrar(POSITION_SCHEMES, "position scheme")

#: model_type -> human name of the M-RoPE families mmspec supports
MROPE_FAMILIES = {
    "qwen2_vl": "Qwen2-VL (Qwen2VLForConditionalGeneration)",
    "qwen2_5_vl": "Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration)",
    "qwen3_vl": "Qwen3-VL (Qwen3VLForConditionalGeneration)",
    "qwen3_vl_moe": "Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration)",
}

#: model_type -> name of its scheme in :data:`POSITION_SCHEMES` (every other family: "index")
FAMILY_SCHEMES = {model_type: "mrope" for model_type in MROPE_FAMILIES}


class PositionScheme:
    """How a family's positions follow from its prompt (see the module docstring).

    Attributes:
        name: the registry name.
        placeholders: config attribute of a placeholder token id -> the pixel input that fills its
            slots (the prompt must carry one exactly when it has the other).
    """

    name: ClassVar[str]
    placeholders: ClassVar[dict[str, str]] = {"image_token_id": "pixel_values", "image_token_index": "pixel_values",
                                              "video_token_id": "pixel_values_videos",
                                              "video_token_index": "pixel_values_videos"}

    def placeholder_ids(self, config) -> dict[int, str]:
        """Placeholder token id -> its pixel input, for the ids ``config`` sets."""
        found = {}
        for attribute, pixels in self.placeholders.items():
            value = getattr(config, attribute, None)
            if value is not None:
                found.setdefault(int(value), pixels)
        return found

    def check(self, model: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> None:
        """Refuse a prompt the scheme cannot place, in one line saying what to do (before any forward)."""

    def prompt_positions(self, model: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]
                         ) -> tuple[torch.Tensor | None, int]:
        """-> (the prompt's position ids for the model's forward, or None for the model's default;
        the offset of every later position, ``position = cache index + offset``)."""
        raise NotImplementedError

    def split_items(self, model: nn.Module, rows: list[torch.Tensor], inputs: dict[str, Any]) -> dict[str, list[Any]]:
        """For a batch of prompts (``rows``: each row's unpadded input_ids [1, L_b]), the inputs that
        are indexed by image or video rather than by prompt, split per row: name -> one value per
        row (None: the row has none). Default: none (every pixel input has one entry per prompt)."""
        return {}


@register_position_scheme
class IndexPositions(PositionScheme):
    """1-D positions equal to the token index (LLaMA, LLaVA, SmolVLM, Gemma3, ...): the model's
    default for the prompt, offset 0."""

    name = "index"

    def prompt_positions(self, model, input_ids, inputs):
        return None, 0


@register_position_scheme
class MRopePositions(PositionScheme):
    """Qwen-VL's 3-D multimodal rotary positions (module docstring): the prompt's [3, 1, L] from
    the model's ``get_rope_index``, then ``delta`` as the offset.

    ``mm_token_type_ids`` (0 text, 1 image, 2 video; the Qwen processors return it) is derived from
    the placeholder tokens when the prompt has none, as the processors derive it.
    """

    name = "mrope"
    placeholders = {"image_token_id": "pixel_values", "video_token_id": "pixel_values_videos"}
    #: pixel input -> the grid input ``get_rope_index`` needs with it
    grids = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}

    def token_types(self, model: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """``mm_token_type_ids`` [1, L]: the prompt's, or 1 on image and 2 on video placeholders."""
        given = inputs.get("mm_token_type_ids")
        if given is not None:
            return given.to(input_ids.device)
        types = torch.zeros_like(input_ids, dtype=torch.int)
        for kind, attribute in ((1, "image_token_id"), (2, "video_token_id")):
            token = getattr(model.config, attribute, None)
            if token is not None:
                types[input_ids == int(token)] = kind
        return types

    def check(self, model, input_ids, inputs):
        """Each pixel input comes with its grid, the grid's patches are the pixel rows, and the
        prompt holds prod(grid) / merge^2 placeholders per image or video (checked before the
        vision tower runs)."""
        merge = model.config.vision_config.spatial_merge_size
        for attribute, pixels in self.placeholders.items():
            grid = self.grids[pixels]
            if inputs.get(pixels) is None:
                continue
            if inputs.get(grid) is None:
                raise ValueError(f"{pixels} were given without {grid}; pass the processor's full output")
            grids, rows = inputs[grid], inputs[pixels].shape[0]
            if int(grids.prod(-1).sum()) != rows:
                raise ValueError(f"{grid} covers {int(grids.prod(-1).sum())} patches but {pixels} has {rows} rows; pass "
                                 "the processor's output unchanged")
            placeholders, expected = int((input_ids == getattr(model.config, attribute)).sum()), int((grids.prod(-1) // merge**2).sum())
            if placeholders != expected:
                raise ValueError(f"the prompt has {placeholders} {'video' if 'video' in pixels else 'image'} tokens but "
                                 f"{grid} needs {expected}; build the prompt with the model's processor")
        given = inputs.get("mm_token_type_ids")
        if given is not None and tuple(given.shape) != tuple(input_ids.shape):
            raise ValueError(f"mm_token_type_ids has shape {list(given.shape)} but input_ids {list(input_ids.shape)}; "
                             "pass the processor's mm_token_type_ids unchanged (or none)")

    def split_items(self, model, rows, inputs):
        """The Qwen processors flatten a batch's patches: ``pixel_values`` [sum of patches, D] with
        ``image_grid_thw`` [images, 3] (videos: ``pixel_values_videos``, ``video_grid_thw``,
        ``second_per_grid_ts``). Image i has prod(grid_i) patches and prod(grid_i) / merge^2
        placeholder tokens; the items go to the rows in order, each row taking the items whose
        placeholders it holds. Raises ValueError when the placeholders and grids disagree."""
        merge = model.config.vision_config.spatial_merge_size
        split: dict[str, list[Any]] = {}
        for attribute, pixels in self.placeholders.items():
            grid_name, token = self.grids[pixels], getattr(model.config, attribute, None)
            grids = inputs.get(grid_name)
            if grids is None or token is None:
                continue
            tokens_per_item = (grids.prod(-1) // merge**2).tolist()
            patches = [0, *grids.prod(-1).cumsum(0).tolist()]
            extra = [name for name in ("second_per_grid_ts",) if pixels == "pixel_values_videos" and inputs.get(name) is not None]
            item = 0
            for name in (pixels, grid_name, *extra):
                split[name] = []
            for ids in rows:
                need, first = int((ids == token).sum()), item
                while need > 0 and item < len(tokens_per_item):
                    need -= tokens_per_item[item]
                    item += 1
                if need != 0:
                    raise ValueError(f"the prompts' {grid_name} does not match their placeholder tokens; pass the "
                                     "processor's output for this batch unchanged")
                taken = item > first
                split[pixels].append(inputs[pixels][patches[first] : patches[item]] if taken else None)
                split[grid_name].append(grids[first:item] if taken else None)
                for name in extra:
                    split[name].append(inputs[name][first:item] if taken else None)
            if item != len(tokens_per_item):
                raise ValueError(f"{grid_name} holds {len(tokens_per_item)} items but the prompts' placeholders only "
                                 f"{item}; pass the processor's output for this batch unchanged")
        return split

    def prompt_positions(self, model, input_ids, inputs):
        base = model.base_model
        if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
            # text only: t = h = w = the token index (passed, so the model never reads its own rope_deltas)
            return torch.arange(input_ids.shape[1], device=input_ids.device)[None], 0
        accepted = inspect.signature(base.get_rope_index).parameters
        extra = {k: v for k, v in inputs.items() if k in accepted and k not in ("input_ids", "mm_token_type_ids", "attention_mask")}
        positions, delta = base.get_rope_index(input_ids, mm_token_type_ids=self.token_types(model, input_ids, inputs), **extra)
        return positions, int(delta.reshape(-1)[0])


def position_scheme(config) -> PositionScheme:
    """The position scheme of a model with this config (by ``model_type``; default ``"index"``)."""
    return POSITION_SCHEMES[FAMILY_SCHEMES.get(getattr(config, "model_type", ""), "index")]()
