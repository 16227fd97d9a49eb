"""What ``mmspec serve`` serves and its limits: :class:`ServeConfig` (built by the CLI or by hand).

Nothing here imports FastAPI, so ``mmspec --help`` works without the ``serve`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: short task name (``--tasks``) -> the pipeline's task name (``mmspec.pipeline(task)``)
TASKS: dict[str, str] = {"caption": "image-captioning", "t2i": "text-to-image", "tts": "text-to-speech"}
#: short task name -> the model id a request names when the task runs an embedded default model
DEFAULT_MODEL_IDS: dict[str, str] = {"caption": "mmspec-caption", "t2i": "mmspec-t2i", "tts": "mmspec-tts"}


@dataclass
class ServeConfig:
    """Settings of one server.

    Attributes:
        tasks: the short task names served ("caption", "t2i", "tts"); pipelines load lazily, once
            per task, on its first request.
        models: short task -> model (a local directory or an embedded name); missing or None: the
            task's embedded default.
        caption_drafter: the captioning pipeline's ``drafter`` ("auto" by default).
        t2i_method / tts_method: the text-to-image / text-to-speech pipelines' ``method``.
        device / dtype: passed to every pipeline ("auto"; fp32 makes greedy batch rows bit-equal
            to batch-1 rows, bf16 only up to rounding near ties).
        max_batch_size: requests of one task gathered into one pipeline call at most.
        batch_wait_s: how long the first request of a batch waits for others.
        max_queue: requests waiting per task before new ones get 429.
        max_body_bytes: largest request body (413 above).
        body_timeout_s: longest wait for a request's whole body (408 after it: a Content-Length
            larger than what the client sends, or a client that stalls, holds no connection for ever).
        max_prompt_chars: longest text prompt / speech input (400 above).
        max_tokens_limit: largest ``max_tokens`` of a chat request, and the cap of its default (64).
        max_images: largest ``n`` of an image request.
        max_chat_images: most images in one chat request.
        stream_stall_s: a streaming client that reads nothing for this long while its text waits
            is treated as gone (its row leaves the batch).
        max_speech_seconds: cap on each piece of a speech request's audio, and the largest
            ``max_seconds`` a request may ask (a text too long for one generation is said in
            pieces, each capped: a long input can give a longer answer; ``max_prompt_chars``
            bounds the input).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        allow_local_files: let ``image_url`` name a file on the server's disk (off: data URIs only).
        local_files_root: with ``allow_local_files``, only files under this folder (None: anywhere
            the server's user may read).
        pipeline_kwargs: short task -> extra keyword arguments of its pipeline (tests, presets).
    """

    tasks: tuple[str, ...] = ("caption", "t2i", "tts")
    models: dict[str, str | None] = field(default_factory=dict)
    caption_drafter: str = "auto"
    t2i_method: str = "sjd-coupled"
    tts_method: str = "sjd-coupled"
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 16
    batch_wait_s: float = 0.01
    max_queue: int = 64
    max_body_bytes: int = 20 * 1024 * 1024
    body_timeout_s: float = 60.0
    max_prompt_chars: int = 4000
    max_tokens_limit: int = 512
    max_images: int = 4
    max_chat_images: int = 8
    stream_stall_s: float = 30.0
    max_speech_seconds: float = 20.0
    api_key: str | None = None
    allow_local_files: bool = False
    local_files_root: str | None = None
    pipeline_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tasks = tuple(self.tasks)
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {unknown or self.tasks!r}; serve some of: {', '.join(TASKS)}")
        for name in ("models", "pipeline_kwargs"):  # (a misspelt task's model or arguments were left out, unsaid)
            wrong = [key for key in getattr(self, name) if key not in TASKS]
            if wrong:
                raise ValueError(f"{name} has unknown task(s) {wrong!r}; its keys are the short task names: {', '.join(TASKS)}")
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_prompt_chars", "max_tokens_limit", "max_images",
                     "max_chat_images"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (0 <= self.batch_wait_s <= 10):
            raise ValueError(f"batch_wait_s must be between 0 and 10 seconds, got {self.batch_wait_s!r}")
        for name in ("stream_stall_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.max_speech_seconds > 0:
            raise ValueError(f"max_speech_seconds must be positive, got {self.max_speech_seconds!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; give a key or leave it out")
        if self.local_files_root is not None:
            self.local_files_root = str(Path(self.local_files_root).resolve())

    def model_id(self, task: str) -> str:
        """The id ``/v1/models`` lists for ``task`` (the model as named, or the embedded default's id)."""
        model = self.models.get(task)
        return str(model) if model else DEFAULT_MODEL_IDS[task]
