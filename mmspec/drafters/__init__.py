"""Drafters: proposers of tokens for the target to verify, registered by name."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..adapters.hf import TransformersTarget
from ..core.batch import BatchDrafting
from ..core.drafter import DRAFTERS, Draft, DraftContext, Drafter, register_drafter
from ..core.spec import parse_spec
from ..core.target import tree_refusal
from .assistant import AssistantDrafter
from .continuous import MARDrafter
from .eagle import Eagle2Drafter, EagleDrafter
from .eagle3 import Eagle3Drafter, Eagle3TreeDrafter
from .image_eagle import ImageEagle2Drafter, ImageEagleDrafter
from .jacobi import CoupledJacobiDrafter, JacobiDrafter
from .kangaroo import KangarooDrafter
from .layer_skip import LayerSkipDrafter
from .medusa import HydraDrafter, MedusaDrafter
from .model import ModelDrafter, SpdDrafter
from .prompt_lookup import PromptLookupDrafter
from .shipped import check_drafter_dir
from .steps import CodecEagleDrafter, CodecMedusaDrafter, StepAwareDrafter, StepCompletionDrafter

__all__ = [
    "DRAFTERS", "BatchDrafting", "Draft", "DraftContext", "Drafter", "register_drafter",
    "AssistantDrafter", "CodecEagleDrafter", "CodecMedusaDrafter", "CoupledJacobiDrafter", "Eagle2Drafter", "Eagle3Drafter", "Eagle3TreeDrafter", "JacobiDrafter", "EagleDrafter", "HydraDrafter", "ImageEagle2Drafter", "ImageEagleDrafter", "KangarooDrafter", "MARDrafter", "MedusaDrafter", "LayerSkipDrafter", "ModelDrafter", "SpdDrafter", "PromptLookupDrafter", "StepAwareDrafter", "StepCompletionDrafter", "check_drafter_dir", "is_drafter_spec", "resolve_drafter", "unknown_drafter",
    "spec_drafter_names", "split_drafter_spec",
]

NO_DRAFTER = (None, "ar", "none")


def check_draft_length_use(spec: Any, num_draft_tokens: Any) -> None:
    """Refuse a draft length K given with plain decoding (``spec`` in :data:`NO_DRAFTER`), which
    drafts nothing and would ignore it (one ValueError line). For the user-facing entries (the
    CLI, the captioning pipeline); :func:`resolve_drafter` and :func:`mmspec.generate` themselves take K with None, as a baseline
    run of the same settings does."""
    if num_draft_tokens is not None and isinstance(spec, (str, type(None))) and spec in NO_DRAFTER:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} is a drafter's draft length, but drafter={spec!r} is "
                         "plain decoding, which drafts nothing: drop it or name a drafter")
    check_draft_length_once(spec, num_draft_tokens)


def check_draft_length_once(spec: Any, num_draft_tokens: Any) -> None:
    """Refuse a draft length given both in a spec whose argument is it (``"prompt-lookup:3"``) and
    as another ``num_draft_tokens`` (one ValueError line, rather than one of them winning silently;
    the same value twice is accepted)."""
    if num_draft_tokens is None or not is_drafter_spec(spec):
        return
    try:
        name, argument = split_drafter_spec(spec)
    except ValueError:
        return  # (a bad spec: its own check says so)
    if argument is not None and DRAFTERS[name].spec_argument == "num_draft_tokens" and argument != str(num_draft_tokens):
        raise ValueError(f"the draft length is given twice: drafter={spec!r} and num_draft_tokens={num_draft_tokens}; "
                         f"give it once ('{name}:{num_draft_tokens}' or '{name}' with num_draft_tokens)")


def spec_drafter_names() -> list[str]:
    """Drafters that can be named by a spec string for a text LM or a VLM ("prompt-lookup",
    "layer-skip", ...; not those that draft only image tokens, which the text-to-image methods use)."""
    return sorted(name for name, cls in DRAFTERS.items() if hasattr(cls, "from_spec") and not cls.image_tokens_only)


def unknown_drafter(name: str, choices: str) -> str:
    """The line refusing drafter ``name`` (a text-to-image drafter named for a text LM or a VLM
    says so); ``choices``: what the caller takes instead."""
    cls = DRAFTERS.get(str(name).partition(":")[0])
    if cls is not None and cls.image_tokens_only:
        return (f"drafter {name!r} drafts the image tokens of a text-to-image model (mmspec t2i's methods use it); "
                f"for a text LM or a VLM use {choices}")
    if name == "auto":  # (the captioning pipeline's pick by measured speed; it never asks here)
        return (f"unknown drafter 'auto' here: it picks by measured speed for image captioning only (mmspec caption, "
                f"mmspec.pipeline(\"image-captioning\")); use {choices}")
    return f"unknown drafter {name!r}; use {choices}"


def is_drafter_spec(drafter: Any) -> bool:
    """Whether ``drafter`` is a spec string such as "prompt-lookup:10" (else it may be a path)."""
    return isinstance(drafter, str) and drafter.partition(":")[0] in spec_drafter_names()


def split_drafter_spec(spec: str) -> tuple[str, str | None]:
    """A drafter spec in the one spec syntax -> (name, the drafter's argument): the short form
    ``"layer-skip:8"`` or its key, the drafter's :attr:`~mmspec.core.drafter.Drafter.spec_argument`
    (``"layer-skip:layers=8"``, ``"eagle2:path=DIR"``). Raises ValueError (one line) for another key."""
    parsed = parse_spec(spec)
    key, argument = DRAFTERS[parsed.name].spec_argument, parsed.argument
    for given, value in parsed.pairs:
        if given != key or value is None:
            raise ValueError(f"drafter {parsed.name!r} takes no setting {given!r}; its setting is {key}=... "
                             f"(e.g. '{parsed.name}:{key}=VALUE', or '{parsed.name}:VALUE')")
        argument = value
    return parsed.name, argument


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
    check_draft_length_once(spec, num_draft_tokens)
    if spec in NO_DRAFTER:
        return None
    if isinstance(spec, Drafter):
        return spec
    transformers_target = isinstance(target, TransformersTarget)
    if isinstance(spec, nn.Module):
        if not transformers_target:  # (it would be wrapped as a transformers LM, which this target is not)
            raise ValueError(f"a draft model for a {type(target).__name__} is a Drafter over a target of its kind, e.g. "
                             f"ModelDrafter({type(target).__name__}(draft)), not the bare model")
        return ModelDrafter(spec, num_draft_tokens or 4)
    if isinstance(spec, str):
        if not is_drafter_spec(spec):
            raise ValueError(unknown_drafter(spec, f"one of {spec_drafter_names()} (e.g. 'layer-skip:8'), a transformers "
                                                   "draft model, a Drafter object, or None for plain decoding"))
        name, arg = split_drafter_spec(spec)
        if DRAFTERS[name].needs_transformers_target and not transformers_target:
            usable = [n for n in spec_drafter_names() if not DRAFTERS[n].needs_transformers_target]
            raise ValueError(f"drafter {name!r} reads a transformers LM's own layers and heads; a {type(target).__name__} "
                             f"takes {', '.join(usable)} by name, or a Drafter object of its kind")
        refusal = tree_refusal(target) if DRAFTERS[name].drafts_trees else None
        if refusal:  # before loading (or looking for) the drafter's weights
            raise ValueError(refusal)
        return DRAFTERS[name].from_spec(target, arg or None, num_draft_tokens=num_draft_tokens)
    raise TypeError(f"drafter must be a name, a transformers model or a Drafter, got {type(spec).__name__}")
