"""Task pipelines: ``mmspec.pipeline(task, **kwargs)`` composes a model, its processor and a drafter.

Tasks are registered by name in :data:`PIPELINES` (task -> "module:Class", imported on first use,
so a task's optional dependencies load only when it is used).
"""

from __future__ import annotations

import importlib
from typing import Any

from .captioning import CaptionOutput, ImageCaptioningPipeline
from .presets import from_preset

#: task name -> "module:class" of its pipeline
PIPELINES: dict[str, str] = {
    "image-captioning": "mmspec.pipelines.captioning:ImageCaptioningPipeline",
    "text-to-image": "mmspec.pipelines.text_to_image:TextToImagePipeline",
    "text-to-speech": "mmspec.pipelines.text_to_speech:TextToSpeechPipeline",
}
#: tasks of the design that have no pipeline yet
PLANNED_TASKS: tuple[str, ...] = ()


def register_pipeline(task: str, target: str) -> None:
    """Register ``target`` ("module:Class", the class taking the pipeline's keyword arguments) as ``task``."""
    PIPELINES[task] = target


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
    return pipeline_class(task)(**kwargs)


def pipeline_class(task: str) -> type:
    """The pipeline class registered as ``task`` (imported now).

    Raises:
        ValueError: an unknown task (the message lists the known ones).
    """
    if task not in PIPELINES:
        planned = f" ({task!r} is planned but not available yet)" if task in PLANNED_TASKS else ""
        raise ValueError(f"unknown task {task!r}{planned}; known tasks: {', '.join(sorted(PIPELINES))}")
    module, _, name = PIPELINES[task].partition(":")
    return getattr(importlib.import_module(module), name)


pipeline.from_preset = from_preset  # mmspec.pipeline.from_preset("caption-embedded"), as diffusers' from_pretrained

__all__ = ["PIPELINES", "CaptionOutput", "ImageCaptioningPipeline", "from_preset", "pipeline", "pipeline_class",
           "register_pipeline"]
