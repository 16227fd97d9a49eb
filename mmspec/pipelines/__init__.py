"""Task pipelines: ``mmspec.pipeline(task, **kwargs)`` composes a model, its processor and a drafter.

Every task is a :class:`~mmspec.pipelines.base.Pipeline` registered by name in :data:`PIPELINES`
(:func:`register_pipeline`); the built-in tasks' modules are imported on first use
(:data:`~mmspec.pipelines.base.TASK_MODULES`), so a task's optional dependencies load only when it
is used. Each task is a subpackage -- ``captioning/``, ``text_to_image/``, ``text_to_speech/`` --
of ``components.py`` (its model's parts), ``methods.py`` (its methods on the shared
:class:`~mmspec.pipelines.methods.Method` base) and ``pipeline.py``.
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import PIPELINES, PLANNED_TASKS, TASK_MODULES, Pipeline, known_tasks, pipeline_class, register_pipeline
from .captioning import CaptionOutput, ImageCaptioningPipeline
from .methods import Method, MethodRegistry, Setting, parse_spec
from .presets import from_preset


def pipeline(task: str, **kwargs: Any):
    """Build the pipeline of ``task``.

    Args:
        task: "image-captioning" (see :class:`ImageCaptioningPipeline` for its arguments),
            "text-to-image" (:class:`~mmspec.pipelines.text_to_image.TextToImagePipeline`) or
            "text-to-speech" (:class:`~mmspec.pipelines.text_to_speech.TextToSpeechPipeline`).
        **kwargs: the pipeline's arguments (model=None, drafter="auto", device="auto", dtype="auto", ...).
    Raises:
        ValueError: an unknown task (the message lists the known ones).
    Example:
        >>> cap = mmspec.pipeline("image-captioning", drafter="auto")
        >>> cap("photo.jpg").text
    """
    cls = pipeline_class(task)
    built, called = inspect.signature(cls.__init__).parameters, inspect.signature(cls.__call__).parameters
    settings = {name for method in (cls.methods or {}).values() for name in method.SETTINGS}  # (tts' top_k: both)
    for name in kwargs:
        if name not in built and name in called and name not in settings:  # (else refused as a method's setting)
            raise ValueError(f"{name} is an argument of each call, not of the pipeline: pipe = mmspec.pipeline({task!r}), "
                             f"then pipe(..., {name}={kwargs[name]!r})")
    return cls(**kwargs)


pipeline.from_preset = from_preset  # mmspec.pipeline.from_preset("caption-embedded"), as diffusers' from_pretrained

__all__ = ["PIPELINES", "PLANNED_TASKS", "TASK_MODULES", "CaptionOutput", "ImageCaptioningPipeline", "Method",
           "MethodRegistry", "Pipeline", "Setting", "from_preset", "known_tasks", "parse_spec", "pipeline",
           "pipeline_class", "register_pipeline"]
