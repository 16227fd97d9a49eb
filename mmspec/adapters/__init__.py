"""Modality adapters: turn a concrete model into the core's Target interface."""

from . import mllama  # noqa: F401  (registers Mllama's FamilyHooks)
from .hf import VLM_FAMILIES, TransformersTarget, text_decoder, truncated_decoder

__all__ = ["VLM_FAMILIES", "TransformersTarget", "text_decoder", "truncated_decoder"]
