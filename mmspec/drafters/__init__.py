"""Drafters: proposers of tokens for the target to verify, registered by name."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.drafter import DRAFTERS, Draft, DraftContext, Drafter, register_drafter
from .layer_skip import LayerSkipDrafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = [
    "DRAFTERS", "Draft", "DraftContext", "Drafter", "register_drafter",
    "LayerSkipDrafter", "ModelDrafter", "PromptLookupDrafter", "resolve_drafter",
]

NO_DRAFTER = (None, "ar", "none")


def resolve_drafter(spec: Any, target, num_draft_tokens: int | None = None) -> Drafter | None:
    """Turn the user's ``drafter=`` argument into a Drafter (None = plain AR decoding).

    Args:
        spec: None / "ar"; a registered name with an optional argument ("prompt-lookup",
            "prompt-lookup:10", "layer-skip:8"); a transformers model sharing the target's
            vocabulary (independent draft); or a Drafter instance.
        target: the TransformersTarget being decoded.
        num_draft_tokens: K, overriding the drafter's default.
    """
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if spec in NO_DRAFTER:
        return None
    if isinstance(spec, Drafter):
        return spec
    if isinstance(spec, nn.Module):
        return ModelDrafter(spec, num_draft_tokens or 4)
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name not in DRAFTERS or not hasattr(DRAFTERS[name], "from_spec"):
            usable = sorted(n for n, cls in DRAFTERS.items() if hasattr(cls, "from_spec"))
            raise ValueError(
                f"unknown drafter {spec!r}; use one of {usable} (e.g. 'layer-skip:8'), "
                "a transformers draft model, a Drafter object, or None for plain decoding"
            )
        return DRAFTERS[name].from_spec(target, arg or None, num_draft_tokens=num_draft_tokens)
    raise TypeError(f"drafter must be a name, a transformers model or a Drafter, got {type(spec).__name__}")
