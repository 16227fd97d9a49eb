"""Captioning drafters as methods of the shared :class:`~mmspec.pipelines.methods.Method` base:
the spec a user gives (``drafter="prompt-lookup:10"``, ``"layer-skip:layers=8"``,
``"eagle2:DIR"``, ``"ar"``) is parsed and checked here, in the one spec syntax, before anything
loads; :meth:`CaptionMethod.build_drafter` then builds the drafter through
:func:`mmspec.drafters.resolve_drafter` from the short form (:meth:`CaptionMethod.drafter_spec`),
so a spec's drafter is exactly the one the drafter registry makes of it.

A drafter of :mod:`mmspec.drafters` that can be named by a spec and has no class here is a
:class:`DrafterSpecMethod`: its one setting, ``arg``, is passed to the drafter as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from ...drafters import (DRAFTERS, NO_DRAFTER, Drafter, check_drafter_dir, resolve_drafter, spec_drafter_names,
                        split_drafter_spec, unknown_drafter)
from ..methods import Method, MethodRegistry, Setting, at_least, parse_spec

#: every setting a captioning drafter may read
SETTINGS: dict[str, Setting] = {
    "num_draft_tokens": Setting(int, "K, the tokens drafted per step (prompt lookup's)", at_least(1), "an integer >= 1"),
    "layers": Setting(int, "the target's first layers that draft (layer skip)", at_least(1), "an integer >= 1"),
    "path": Setting(str, "the trained drafter's directory (default: the one shipped with the model)"),
    "arg": Setting(str, "the drafter's spec argument, passed on as it is"),
}

#: drafter name -> its class (more names: every spec drafter of mmspec.drafters, :func:`caption_method_class`)
METHODS = MethodRegistry("captioning drafter", example="layer-skip:8")
register_method = METHODS.register


class CaptionMethod(Method):
    """A captioning drafter named by a spec; the rule is the generation's ``acceptance`` (greedy
    or speculative sampling: exact)."""

    SETTINGS = SETTINGS
    registry = METHODS
    #: the one line refusing a spec without its argument, for methods that need one (None: optional)
    missing_argument: ClassVar[str | None] = None

    def __init__(self, arg: str | None = None, **settings: Any) -> None:
        super().__init__(arg, **settings)
        if self.missing_argument and self.settings[self.argument] is None:
            raise ValueError(self.missing_argument)

    def drafter_spec(self) -> str:
        """The short form the drafter registry reads: ``"prompt-lookup:10"``, ``"eagle:DIR"``, ``"ar"``."""
        value = self.settings.get(self.argument) if self.argument else None
        return self.name if value is None else f"{self.name}:{value}"

    def build_drafter(self, target: Any, num_draft_tokens: int | None = None) -> Drafter | None:
        """The drafter over ``target`` (a TransformersTarget; None: plain decoding), with
        ``num_draft_tokens`` as the drafter's default K where the spec does not set it."""
        return resolve_drafter(self.drafter_spec(), target, num_draft_tokens)


@register_method
class PlainDecoding(CaptionMethod):
    name = "ar"
    aliases = ("none",)
    description = "no drafter: plain autoregressive decoding"


@register_method
class PromptLookup(CaptionMethod):
    name = "prompt-lookup"
    description = "n-gram lookup in the prompt and the caption so far (training-free)"
    argument = "num_draft_tokens"
    defaults = {"num_draft_tokens": None}


@register_method
class LayerSkip(CaptionMethod):
    name = "layer-skip"
    description = "the target's first layers and its LM head draft (training-free)"
    argument = "layers"
    defaults = {"layers": None}
    missing_argument = 'layer-skip needs the number of layers, e.g. drafter="layer-skip:8"'


class TrainedDrafter(CaptionMethod):
    """A drafter with trained weights: its directory is the argument (default: the one shipped
    beside the model, :mod:`mmspec.drafters.shipped`)."""

    argument = "path"
    defaults = {"path": None}


@register_method
class Eagle(TrainedDrafter):
    name = "eagle"
    description = "EAGLE head chains"


@register_method
class Eagle2(TrainedDrafter):
    name = "eagle2"
    description = "EAGLE-2 dynamic trees from the EAGLE head"


@register_method
class Medusa(TrainedDrafter):
    name = "medusa"
    description = "Medusa heads' static tree"


@register_method
class Hydra(TrainedDrafter):
    name = "hydra"
    description = "Hydra heads' static tree"


@register_method
class Kangaroo(TrainedDrafter):
    name = "kangaroo"
    description = "Kangaroo: the target's shallow layers and a trained adapter"


@register_method
class SmallDraft(TrainedDrafter):
    name = "spd"
    description = "a text-only draft LM of the captioner (SPD)"


@register_method
class Assistant(CaptionMethod):
    name = "assistant"
    description = "Gemma 4's multi-token-prediction assistant (gemma4_assistant), drafting over the target's KV"
    argument = "path"
    defaults = {"path": None}
    missing_argument = ('the assistant drafter needs its checkpoint: drafter="assistant:DIR" (a directory or hub id, '
                        'e.g. google/gemma-4-e2b-it-assistant)')


class DrafterSpecMethod(CaptionMethod):
    """A spec drafter of :mod:`mmspec.drafters` without a class here: its argument goes to the
    drafter's ``from_spec`` as it is."""

    argument = "arg"
    defaults = {"arg": None}
    _made: ClassVar[dict[str, type["DrafterSpecMethod"]]] = {}

    @classmethod
    def named(cls, name: str) -> type["DrafterSpecMethod"]:
        """The class of spec drafter ``name`` (made once)."""
        if name not in cls._made:
            cls._made[name] = type(f"DrafterSpec[{name}]", (cls,), {"name": name, "description": f"the {name} drafter"})
        return cls._made[name]


def caption_method_class(name: str) -> type[CaptionMethod] | None:
    """The class of drafter ``name`` (a registered method, an alias, or any spec drafter of
    :mod:`mmspec.drafters`), None when there is none."""
    found = METHODS.get(name) or METHODS.aliases().get(name)
    if found is None and name in spec_drafter_names():
        found = DrafterSpecMethod.named(name)
    return found


def is_caption_spec(drafter: Any) -> bool:
    """Whether ``drafter`` is a spec string naming a drafter (else it may be a path)."""
    return isinstance(drafter, str) and caption_method_class(drafter.partition(":")[0].strip()) is not None


def drafter_choices(auto: bool = True) -> str:
    """What a ``drafter=`` string may name, for the refusal lines (``auto``: "auto" too)."""
    first = "'auto', " if auto else ""
    return f"{first}one of {spec_drafter_names()} (e.g. 'layer-skip:8'), 'ar', or a draft model directory"


def make_caption_method(spec: str, **settings: Any) -> CaptionMethod:
    """A drafter spec (``"prompt-lookup:10"``, ``"layer-skip:layers=8"``) -> its method, every
    setting checked (one ValueError line)."""
    parsed = parse_spec(spec)
    cls = caption_method_class(parsed.name)
    if cls is None:
        raise ValueError(unknown_drafter(spec, drafter_choices()))
    return cls.from_spec(parsed, **settings)


def check_tree_drafter(model: Any, drafter: Any, trust_remote_code: bool = False) -> None:
    """Refuse a tree drafter (``Drafter.drafts_trees``) for a model with recurrent layers (Qwen3.5's
    linear attention, LFM2's convolutions) from its config alone, before its weights load (the
    target refuses it again, for models passed loaded). Silent where the config does not read
    (the load reports that)."""
    if not isinstance(model, (str, os.PathLike)) or drafter in NO_DRAFTER or not is_caption_spec(drafter):
        return
    name = split_drafter_spec(make_caption_method(drafter).drafter_spec())[0]
    if name not in DRAFTERS or not DRAFTERS[name].drafts_trees:
        return
    from transformers import AutoConfig

    from ...adapters.recurrent import TREES_REFUSED, has_recurrent_layers

    try:
        config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return
    if has_recurrent_layers(config):
        raise ValueError(f"drafter {drafter!r}: {model} {TREES_REFUSED}")


def check_drafter_name(drafter: str | os.PathLike, auto: bool = True) -> Path | None:
    """A ``drafter=`` string checked without loading anything: None for "auto" (unless ``auto``
    is False: a text LM's ``mmspec generate`` has no table to choose from), "ar" and specs (their
    settings checked), else the draft model directory it names.

    Raises:
        ValueError: an unknown drafter name, a bad setting of a spec, a trained drafter's
            directory without its files.
        FileNotFoundError: a path that is not a directory (a draft model's or a trained drafter's).
    """
    if (drafter == "auto" and auto) or drafter in NO_DRAFTER:
        return None
    if isinstance(drafter, str) and not drafter.strip():  # (Path("") is ".": "holds no draft model" with no name)
        raise ValueError(f"the drafter is empty; give {drafter_choices(auto)}")
    if is_caption_spec(drafter):
        method = make_caption_method(drafter)
        if method.argument and method.name in DRAFTERS:  # a trained drafter's directory: there, and of its kind
            check_drafter_dir(method.name, method.settings.get(method.argument))
            DRAFTERS[method.name].check_spec_argument(method.settings.get(method.argument))
        return None
    path = Path(drafter).expanduser()
    if not path.is_dir():
        if isinstance(drafter, str) and os.sep not in drafter and "/" not in drafter:
            raise ValueError(unknown_drafter(drafter, drafter_choices(auto)))
        name, colon, _ = drafter.partition(":") if isinstance(drafter, str) else ("", "", "")
        if colon and len(name) > 1 and os.sep not in name and "/" not in name and not path.exists():
            # a misspelt kind before a head's directory ("eagle4:heads/x"): the name is what is wrong, not a missing path
            raise ValueError(unknown_drafter(name, drafter_choices(auto)) + f" (in {drafter!r})")
        raise FileNotFoundError(f"draft model directory not found: {drafter}")
    if not (path / "config.json").is_file():  # (transformers' "Unrecognized model", after the target loaded)
        raise ValueError(f"{drafter} holds no draft model (no config.json); a draft model is a transformers causal LM "
                         "directory sharing the target's tokenizer, and a trained head is named by its kind "
                         f"('eagle3:{drafter}', 'eagle:{drafter}', ...)")
    return path
