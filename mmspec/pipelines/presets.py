"""Ready-made pipelines: one TOML file per preset in the top-level ``pipelines/`` folder.

A preset names the task, the pipeline's construction arguments (model, processor, method or
drafter, dtype, ...) and the defaults of each call::

    description = "The embedded captioner with its fastest measured drafter."
    task = "image-captioning"

    [init]                 # ImageCaptioningPipeline(**init); no `model` = the embedded default
    drafter = "auto"

    [call]                 # defaults of every call, overridden by the caller's arguments
    max_new_tokens = 64

``mmspec.pipeline.from_preset("caption-embedded")`` (a name in ``pipelines/``, or a path to a
TOML file) checks the file and every argument it can without weights (argument names against the
pipeline's signature, drafter / method names and settings, dtype), then builds the pipeline;
``mmspec run PRESET INPUTS...`` does the same from the command line.
"""

from __future__ import annotations

import inspect
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.arguments import check_argument_types
from ..hub import outside_clone

#: sections of a preset file, and its top-level keys
SECTIONS = ("init", "call")
KEYS = ("task", "description", *SECTIONS)


def presets_dir() -> Path:
    """The top-level ``pipelines/`` folder of the repository (override with $MMSPEC_PIPELINES_DIR)."""
    return Path(os.environ.get("MMSPEC_PIPELINES_DIR", Path(__file__).resolve().parents[2] / "pipelines"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


@dataclass(frozen=True)
class Preset:
    """A parsed preset: ``task``, ``init`` (the pipeline's keyword arguments), ``call`` (each call's
    defaults), ``description`` and the ``path`` it came from."""

    task: str
    path: Path
    description: str = ""
    init: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.stem

    def pipeline_class(self) -> type:
        from .base import pipeline_class

        return pipeline_class(self.task)

    def check(self) -> None:
        """Everything that can be checked without the weights: argument names against the
        pipeline's ``__init__`` and ``__call__``, the ``[call]`` values' types against
        ``__call__``'s annotations (``temperature = "hot"``: one line naming the preset file, the
        key and the type it takes) and ranges (``max_new_tokens = 0``;
        :meth:`~mmspec.pipelines.base.Pipeline.check_call_values`),
        then the pipeline's own pre-load checks (``check_arguments``, given the bound ``__init__``
        arguments with their defaults: drafter / method names and settings, dtype, device).

        Raises:
            ValueError: one line naming the preset and what to change.
        """
        cls = self.pipeline_class()
        takes = {section: inspect.signature(function).parameters for section, function in (("init", cls.__init__),
                                                                                           ("call", cls.__call__))}
        for section, other in (("init", "call"), ("call", "init")):  # a key in the other section's place
            misplaced = [k for k in getattr(self, section) if k in takes[other] and k not in takes[section] and k != "self"]
            if misplaced:
                raise ValueError(f"preset {self.name}: {', '.join(misplaced)} belong{'s' if len(misplaced) == 1 else ''} "
                                 f"under [{other}] (an argument of {'each call' if other == 'call' else 'the pipeline'}), "
                                 f"not [{section}]; move {'it' if len(misplaced) == 1 else 'them'} there")
        for section, parameters in takes.items():
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            unknown = [k for k in getattr(self, section) if k not in parameters or k == "self"]
            if unknown and not (takes_any and section == "init"):  # **settings: the pipeline checks them
                allowed = [k for k in parameters if k != "self" and parameters[k].kind is not inspect.Parameter.VAR_KEYWORD]
                raise ValueError(f"preset {self.name}: unknown [{section}] key(s) {unknown} for {cls.__name__}; "
                                 f"use {', '.join(allowed)}")
        check_argument_types(cls.__init__, self.init, where=f"preset {self.name} ({self.path}): [init] ")
        cls.check_call_values(self.call, where=f"preset {self.name} ({self.path}): [call] ")
        try:
            cls.check_init(self.init)
        except (ValueError, TypeError, FileNotFoundError) as error:
            raise ValueError(f"preset {self.name}: {error}") from None

    def build(self) -> "PresetPipeline":
        """:meth:`check`, then the pipeline (its weights load now)."""
        self.check()
        return PresetPipeline(self, self.pipeline_class()(**self.init))


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    """A preset by name (``pipelines/NAME.toml``) or path -> :class:`Preset` (parsed, not checked).

    Raises:
        FileNotFoundError: no such preset (the message lists the known names).
        ValueError: not valid TOML, or a missing / unknown key or task.
    """
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        candidate = presets_dir() / f"{name_or_path}.toml"
        if not candidate.is_file():
            raise FileNotFoundError(outside_clone(presets_dir(), "the presets", "MMSPEC_PIPELINES_DIR") or
                                    f"no preset {str(name_or_path)!r}; use one of {', '.join(preset_names())} "
                                    "or a path to a preset TOML file")
        path = candidate
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"preset {path}: not valid TOML ({error})") from None
    from .base import known_tasks

    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise ValueError(f"preset {path.stem}: unknown key(s) {unknown}; a preset has {', '.join(KEYS)}")
    if "task" not in data:
        raise ValueError(f"preset {path.stem}: no task key; add task = \"...\" (one of {', '.join(known_tasks())})")
    if data["task"] not in known_tasks():
        raise ValueError(f"preset {path.stem}: task must be one of {', '.join(known_tasks())}, got {data['task']!r}")
    for section in SECTIONS:
        if not isinstance(data.get(section, {}), dict):
            raise ValueError(f"preset {path.stem}: [{section}] must be a table of arguments")
    return Preset(task=data["task"], path=path, description=data.get("description", ""),
                  init=dict(data.get("init", {})), call=dict(data.get("call", {})))


class PresetPipeline:
    """A pipeline built from a preset: calls take the preset's ``[call]`` defaults, overridden by
    the caller's keyword arguments; everything else is the pipeline's (``.pipeline``)."""

    def __init__(self, preset: Preset, pipeline: Any) -> None:
        self.preset, self.pipeline = preset, pipeline

    def __call__(self, *args: Any, **kwargs: Any):
        return self.pipeline(*args, **{**self.preset.call, **kwargs})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipeline, name)

    def __repr__(self) -> str:
        return f"PresetPipeline({self.preset.name!r}, {self.pipeline!r})"


def from_preset(name_or_path: str | os.PathLike, **overrides: Any) -> PresetPipeline:
    """Build the pipeline a preset describes (checked first, see :meth:`Preset.check`);
    ``overrides`` replace the preset's ``[init]`` arguments (e.g. ``device="cuda"``)."""
    preset = load_preset(name_or_path)
    cls = preset.pipeline_class()
    init, call = (inspect.signature(function).parameters for function in (cls.__init__, cls.__call__))
    per_call = [key for key in overrides if key in call and key not in init]
    if per_call:  # (merged into [init], the preset file was blamed: "temperature belongs under [call] ..., not [init]")
        name, value = per_call[0], overrides[per_call[0]]
        raise ValueError(f"{name} is an argument of each call, not of the pipeline: pipe = mmspec.pipeline.from_preset("
                         f"{str(name_or_path)!r}), then pipe(..., {name}={value!r})")
    return replace(preset, init={**preset.init, **overrides}).build()
