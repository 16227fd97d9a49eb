"""The three served tasks: each checks its request, names the batch key its rows share, loads its
pipeline once (lazily, on the worker thread) and runs a batch of rows as one pipeline call.

Only the public pipeline API is used: ``mmspec.pipeline(task, ...)``, ``pipe(list, ...,
batch_size=len(list))`` and the outputs' ``.text`` / ``.images`` / ``.audio`` / ``.sampling_rate`` /
``.stats.to_dict()``.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Sequence

from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

from ..adapters.audio.codec import wav_header
from ..pipelines import pipeline_class
from ..pipelines.captioning import CaptionStream, Conversation
from ..pipelines.text_to_speech.components import EMBEDDED_VOICES
from ..pipelines.text_to_speech.pipeline import MAX_SPEED
from .config import TASKS, ServeConfig
from .errors import APIError, bad_request
from .inputs import MAX_IMAGE_PIXELS, Fields, clip, decode_image, short

#: the roles of a chat request's messages (OpenAI's "developer" is read as "system")
CHAT_ROLES = ("system", "user", "assistant")
#: the fields of a chat request that the server cannot honour, with why (absent or a default value is fine)
CHAT_UNSUPPORTED = {
    "n": ((1,), "one caption per request; send several requests (they are batched)"),
    "tools": (([],), "tools are not supported by the captioning models"),
    "tool_choice": (("none",), "tools are not supported by the captioning models"),
    "logprobs": ((False,), "log-probabilities are not returned"),
    "stop": (([],), "stop sequences are not supported; use max_tokens"),
    "response_format": (({"type": "text"},), "only text responses"),
    # (OpenAI's clients send both as 0 by default: 0, the no-op, is what the server does)
    "frequency_penalty": ((0,), "this server applies no penalties; send 0 or leave it out"),
    "presence_penalty": ((0,), "this server applies no penalties; send 0 or leave it out"),
}


#: held by every pipeline load and batch of the server: tasks run one at a time, and a waiting task
#: stops a caption batch from taking more rows (:data:`LOCK_WAITERS`). Loading the text-to-image
#: pipeline on one thread while a text-to-speech batch decoded on another changed the speech's
#: sampled codes in about 1 run of 9 (tests/test_serve.py's mixed-task test found it): building a
#: model sets torch's process-wide default dtype for a while, which the library's own
#: :data:`mmspec.pipelines.base.PIPELINE_LOCK` now keeps from other pipelines' calls too; this lock
#: also covers the batches the server drives below a pipeline's ``__call__``.
PIPELINE_LOCK = threading.Lock()
#: batches of other tasks waiting for PIPELINE_LOCK: while any waits, a running caption batch takes
#: no more rows (it ends as its rows finish, and the other task runs)
LOCK_WAITERS = 0
_WAITERS_LOCK = threading.Lock()


class TaskService:
    """One task's pipeline (loaded once, on first use) and its request handling."""

    name = ""  # short task name, a key of TASKS
    #: bare model names the task loads from this checkout, not from the hub (None: the default)
    embedded_models: tuple[str, ...] = ()

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._pipe: Any = None
        self._lock = threading.Lock()
        self.load_error: str | None = None

    @property
    def model_id(self) -> str:
        return self.config.model_id(self.name)

    @property
    def loaded(self) -> bool:
        return self._pipe is not None

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``mmspec.pipeline`` for this task (before the config's overrides)."""
        raise NotImplementedError

    def all_pipeline_kwargs(self) -> dict[str, Any]:
        """Every keyword argument of this task's ``mmspec.pipeline`` (the config's overrides included)."""
        return {**self.pipeline_kwargs(), **self.config.pipeline_kwargs.get(self.name, {})}

    def check(self) -> None:
        """The pipeline's settings checked without loading it (``mmspec serve`` at start: an
        unknown drafter or method, a method that does not fit the model, a bad dtype or device).

        Raises:
            ValueError: one line naming the task.
        """
        try:
            pipeline_class(TASKS[self.name]).check_init(self.all_pipeline_kwargs())
            self.check_model()
        except (ValueError, TypeError, FileNotFoundError) as error:
            raise ValueError(f"{TASKS[self.name]}: {error}") from None

    def check_model(self) -> None:
        """Refuse a model name that nothing could load, without loading it: not a local path, not
        one of :attr:`embedded_models`, and, the hub being off (``HF_HUB_OFFLINE``, which
        ``mmspec serve`` sets), no entry of the Hugging Face cache. Raises ValueError (one line)."""
        model = self.all_pipeline_kwargs().get("model")
        if not isinstance(model, str) or model in self.embedded_models or Path(model).expanduser().exists():
            return
        # (read here, not huggingface_hub's HF_HUB_OFFLINE constant: that is fixed at its import, and
        # mmspec serve sets the variable after it)
        if os.environ.get("HF_HUB_OFFLINE", "").upper() in ENV_VARS_TRUE_VALUES and not in_hub_cache(model):
            embedded = f", an embedded model ({', '.join(self.embedded_models)})" if self.embedded_models else ""
            raise ValueError(f"--{self.name}-model {clip(model)!r} is not a local directory{embedded} or a model in the "
                             "Hugging Face cache, and HF_HUB_OFFLINE is set (mmspec serve downloads no models)")

    def pipeline(self) -> Any:
        """The task's pipeline, built on first call (thread-safe). Raises APIError 503 when it cannot load."""
        if self._pipe is None:
            with self._lock:
                if self._pipe is None:
                    import mmspec

                    kwargs = self.all_pipeline_kwargs()
                    try:
                        self._pipe = mmspec.pipeline(TASKS[self.name], **kwargs)
                    except (ValueError, OSError, TypeError, ImportError) as error:
                        self.load_error = f"{type(error).__name__}: {error}"
                        raise APIError(503, f"the {self.name} model could not be loaded ({error})", code="model_unavailable") from None
        return self._pipe

    def call(self, key: Hashable, items: Sequence[Any], rows: Any = None) -> list[Any]:
        """:meth:`run_batch` under :data:`PIPELINE_LOCK` (what the batcher's worker thread calls)."""
        global LOCK_WAITERS
        with _WAITERS_LOCK:
            LOCK_WAITERS += 1
        try:
            PIPELINE_LOCK.acquire()
        finally:
            with _WAITERS_LOCK:
                LOCK_WAITERS -= 1
        try:
            return self.run_batch(key, items, rows)
        finally:
            PIPELINE_LOCK.release()

    def load(self) -> None:
        """Load the pipeline now, under :data:`PIPELINE_LOCK` (``--preload``)."""
        with PIPELINE_LOCK:
            self.pipeline()

    def run_batch(self, key: Hashable, items: Sequence[Any], rows: Any = None) -> list[Any]:
        """Run rows sharing ``key`` as one pipeline call (worker thread; use :meth:`call`);
        ``rows``: the batcher's :class:`~mmspec.serve.batching.Rows` of the run (or None)."""
        raise NotImplementedError

    def _dtype_kwargs(self) -> dict[str, Any]:
        return {} if self.config.dtype == "auto" else {"dtype": self.config.dtype}


def in_hub_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds a model ``name`` (its ``config.json``), looked up
    without the network; False for a name that is no valid repo id."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # (HFValidationError: not a repo id)
        return False


def sampling_fields(fields: Fields, default_temperature: float | None) -> dict[str, Any]:
    """temperature (0 = greedy), top_p, top_k -> the pipelines' do_sample / temperature / top_p / top_k."""
    temperature = fields.number("temperature", default_temperature, 0.0, 2.0)
    top_p = fields.number("top_p", None, 0.0, 1.0, low_open=True)
    top_k = fields.integer("top_k", None, 1, 1_000_000)
    greedy = temperature is not None and temperature == 0.0
    return {"do_sample": not greedy, "temperature": 1.0 if greedy else temperature,
            "top_p": None if greedy or top_p == 1.0 else top_p, "top_k": None if greedy else top_k}


#: top-level fields every endpoint takes besides its own: read by the router (model), by
#: :func:`mmspec_options` (mmspec), or accepted unused as OpenAI's API does (user: an end-user id)
COMMON_FIELDS = ("model", "mmspec", "user")
#: a chat request's max_tokens when it sends none (capped by ``max_tokens_limit``)
DEFAULT_MAX_TOKENS = 64

#: the fields of a request's ``"mmspec"`` object
MMSPEC_OPTIONS = ("compare_baseline",)


def mmspec_options(data: dict[str, Any]) -> Fields:
    """The request's ``"mmspec"`` object (``{}`` when absent or null, as every field's null is);
    a field it does not know (a typo) is refused."""
    options = data.get("mmspec")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise bad_request(f"'mmspec' must be an object, got {type(options).__name__}", "mmspec", "invalid_type")
    unknown = sorted(set(options) - set(MMSPEC_OPTIONS))
    if unknown:
        raise bad_request(f"'mmspec' has unknown field(s) {clip(', '.join(map(repr, unknown)))}; it takes "
                          f"{', '.join(MMSPEC_OPTIONS)}", f"mmspec.{unknown[0]}", "unknown_field")
    return Fields(options, "mmspec.")


# -- captioning / visual QA ------------------------------------------------------------------------

@dataclass
class ChatRequest:
    key: tuple  # (max_tokens, do_sample, temperature, top_p, top_k, seed, compare_baseline, solo)
    item: "ChatItem"
    stream: bool
    include_usage: bool


@dataclass
class ChatItem:
    """One chat request's input: its messages (roles and parts, images as ``{"type": "image"}``)
    and the decoded images, in order; made a captioning Conversation on the worker thread."""

    messages: list[dict[str, Any]]
    images: list[Any]

    def conversation(self, default_prompt: str) -> Any:
        """The pipeline's Conversation (its default prompt appended to the last turn, the user's,
        when that turn has no text: an image alone, after a system message or a history too)."""
        messages = [dict(m) for m in self.messages]
        if not any(part["type"] == "text" for part in messages[-1]["content"]):
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + [{"type": "text", "text": default_prompt}]}
        return Conversation(messages, list(self.images))


class CaptionService(TaskService):
    """``POST /v1/chat/completions``: a chat over one or more images -> the assistant's answer."""

    name = "caption"

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"model": self.config.models.get("caption"), "drafter": self.config.caption_drafter,
                "device": self.config.device, "dtype": self.config.dtype}

    def parse(self, data: dict[str, Any]) -> ChatRequest:
        """Check a chat request: system / user / assistant messages, the last the user's, images
        (``image_url`` parts of user messages, at least one in all), the sampling fields."""
        fields = Fields(data)
        for name, (allowed, why) in CHAT_UNSUPPORTED.items():
            fields.refuse(name, allowed + (None,), why)
        messages = fields.get("messages", list, required=True)
        if not messages:
            raise bad_request("'messages' is empty; send a user message with an image", "messages", "empty_field")
        turns, images, chars = [], [], 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
            role = message.get("role")
            if role == "developer":  # OpenAI's newer name for the system turn
                role = "system"
            if role not in CHAT_ROLES:
                raise bad_request(f"messages[{i}].role is {short(role)}; use system, user or assistant (tools are not "
                                  "supported)", f"messages[{i}].role", "unsupported")
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list):
                raise bad_request(f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content",
                                  "invalid_type")
            out = []
            for j, part in enumerate(parts):
                param = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text = Fields(part, param + ".").text("text", self.config.max_prompt_chars, required=role == "user")
                    chars += len(text or "")
                    if text:
                        out.append({"type": "text", "text": text})
                elif kind == "image_url":
                    if role != "user":
                        raise bad_request(f"{param} is an image in a {role} message; images go in user messages",
                                          param, "unsupported")
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise bad_request(f"{param}.image_url.url must be a string", f"{param}.image_url", "invalid_type")
                    left = MAX_IMAGE_PIXELS - sum(image.width * image.height for image in images)
                    images.append(decode_image(url, self.config, f"{param}.image_url", left))
                    if len(images) > self.config.max_chat_images:
                        raise bad_request(f"more than {self.config.max_chat_images} images in one request "
                                          "(--max-chat-images)", "messages", "image_count")
                    out.append({"type": "image"})
                else:
                    raise bad_request(f"{param} must be a text or image_url part", param, "invalid_type")
            turns.append({"role": role, "content": out})
        if turns[-1]["role"] != "user":
            raise bad_request(f"the last message is the {turns[-1]['role']}'s; end with a user message (the answer is "
                              "the assistant's next turn)", f"messages[{len(turns) - 1}].role", "unsupported")
        if not images:
            raise bad_request("send at least one image (an image_url part in a user message)", "messages", "image_count")
        if chars > self.config.max_prompt_chars:
            raise bad_request(f"the messages have {chars} characters; at most {self.config.max_prompt_chars}",
                              "messages", "too_long")
        completion = fields.integer("max_completion_tokens", None, 1, self.config.max_tokens_limit)
        max_tokens = fields.integer("max_tokens", None, 1, self.config.max_tokens_limit)
        if completion is not None and max_tokens is not None and completion != max_tokens:
            raise bad_request(f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({completion}) differ; send one "
                              "(max_completion_tokens is OpenAI's current name)", "max_tokens", "conflicting_fields")
        max_tokens = completion or max_tokens or min(DEFAULT_MAX_TOKENS, self.config.max_tokens_limit)  # (the limit holds)
        sampling = sampling_fields(fields, 1.0)
        seed = fields.integer("seed", None, 0, 2**63 - 1)
        compare = bool(mmspec_options(data).get("compare_baseline", bool, False))
        stream = bool(fields.get("stream", bool, False))
        stream_options = Fields(fields.get("stream_options", dict, {}), "stream_options.")
        # drafter="auto" drafts a sampled caption alone with the head trained for sampling and a batch
        # with the batch table's drafter: both exact samples, but not the same tokens for one seed. A
        # seeded sampled request runs alone so that its seed reproduces its answer.
        solo = uuid.uuid4().hex if sampling["do_sample"] and seed is not None and self.config.caption_drafter == "auto" else None
        key = (max_tokens, sampling["do_sample"], sampling["temperature"], sampling["top_p"], sampling["top_k"], seed,
               compare, solo)
        fields.refuse_unknown(*COMMON_FIELDS)
        include_usage = bool(stream_options.get("include_usage", bool, False))
        stream_options.refuse_unknown()  # (a typo such as include_usag would leave the usage chunk out silently)
        return ChatRequest(key, ChatItem(turns, images), stream, include_usage)

    def run_batch(self, key: Hashable, items: Sequence[Any], rows: Any = None) -> list[Any]:
        """The batch as one pipeline call, each row answered as soon as it ends, its text streamed
        to its row, rows of the key joining between steps (unless ``solo`` or compare_baseline)."""
        max_tokens, do_sample, temperature, top_p, top_k, seed, compare, solo = key
        pipe = self.pipeline()
        stream = _RowsStream(rows, lambda item: item.conversation(pipe.default_prompt), joins=solo is None)
        pipe([item.conversation(pipe.default_prompt) for item in items], max_new_tokens=max_tokens, do_sample=do_sample,
             seed=seed, compare_baseline=compare, temperature=temperature, top_p=top_p, top_k=top_k,
             batch_size=len(items), stream=stream)
        return [stream.results.get(i, RuntimeError("the row did not run")) for i in range(len(rows))]


class _RowsStream(CaptionStream):
    """A pipeline call's stream -> the batcher's rows: text to each row's events, each output as
    soon as its row ends, cancelled rows, waiting jobs of the key joining (``joins``)."""

    def __init__(self, rows: Any, conversation: Any, joins: bool) -> None:
        self.rows, self.conversation, self.admits, self.results = rows, conversation, joins, {}

    def text(self, index: int, piece: str) -> None:
        self.rows[index].text(piece)

    def done(self, index: int, output: Any) -> None:
        self.results[index] = (output, output.prompt_tokens)
        self.rows.finish(index, self.results[index])

    def cancelled(self, index: int) -> bool:
        return self.rows[index].cancelled()

    def more(self) -> list[Any]:
        if LOCK_WAITERS:  # another task waits for the pipelines: let this batch drain
            return []
        return [self.conversation(item) for item, _ in self.rows.more()]

    def error(self, index: int, error: Exception) -> None:
        self.results[index] = error
        self.rows.finish(index, error)


# -- text-to-image ---------------------------------------------------------------------------------

class ImageService(TaskService):
    """``POST /v1/images/generations``: a prompt -> ``n`` PNG images (base64)."""

    name = "t2i"
    embedded_models = ("mar",)  # (T2IComponents.names_continuous: the embedded MAR model)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"model": self.config.models.get("t2i"), "method": self.config.t2i_method, "device": self.config.device,
                **self._dtype_kwargs()}

    def parse(self, data: dict[str, Any]) -> tuple[tuple, str]:
        """Check an image request -> (batch key, prompt)."""
        fields = Fields(data)
        prompt = fields.text("prompt", self.config.max_prompt_chars, required=True)
        n = fields.integer("n", 1, 1, self.config.max_images)
        fields.refuse("response_format", ("b64_json",), "the server keeps no files; ask for b64_json")
        fields.refuse("size", ("auto",), "the model makes images of its one native size; leave size out or send auto")
        method = fields.get("method", str)
        if method is not None and method != self.config.t2i_method:
            raise bad_request(f"this server runs text-to-image method {self.config.t2i_method!r} (--t2i-method); "
                              f"got {clip(method)!r}", "method", "unsupported")
        sampling = sampling_fields(fields, 1.0)
        guidance = fields.number("guidance_scale", 3.0, 1.0, 20.0)
        seed = fields.integer("seed", 0, 0, 2**63 - n)  # (image i uses seed + i, within a generator's range)
        compare = bool(mmspec_options(data).get("compare_baseline", bool, False))
        fields.refuse_unknown(*COMMON_FIELDS)
        key = (n, seed, guidance, sampling["do_sample"], sampling["temperature"], sampling["top_p"], sampling["top_k"], compare)
        return key, prompt

    def run_batch(self, key: Hashable, items: Sequence[Any], rows: Any = None) -> list[Any]:
        n, seed, guidance, do_sample, temperature, top_p, top_k, compare = key
        return list(self.pipeline()(list(items), guidance_scale=guidance, seed=seed, num_images=n, do_sample=do_sample,
                                    temperature=temperature, top_k=top_k, top_p=top_p, compare_baseline=compare,
                                    batch_size=len(items) * n))


# -- text-to-speech --------------------------------------------------------------------------------

SPEECH_FORMATS = ("wav", "pcm")


class SpeechService(TaskService):
    """``POST /v1/audio/speech``: text -> 16-bit mono WAV or raw PCM at the voice's rate."""

    name = "tts"
    embedded_models = tuple(EMBEDDED_VOICES)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"model": self.config.models.get("tts"), "method": self.config.tts_method, "device": self.config.device,
                "dtype": self.config.dtype}

    def parse(self, data: dict[str, Any]) -> tuple[tuple, str, str, bool]:
        """Check a speech request -> (batch key, text, response format, stream)."""
        fields = Fields(data)
        text = fields.text("input", self.config.max_prompt_chars, required=True)
        fields.text("voice", 64)  # one voice per model: the name is accepted, the model's voice speaks
        fmt = fields.get("response_format", str, "wav")
        if fmt not in SPEECH_FORMATS:
            raise bad_request(f"response_format {clip(fmt)!r} is not supported; use wav or pcm", "response_format", "unsupported")
        fields.refuse("stream_format", ("audio", None), "the server streams the audio itself (stream: true), not server-sent events")
        speed = fields.number("speed", 1.0, 0.25, MAX_SPEED)  # OpenAI's range, 0.25 to 4 (the voice's MAX_SPEED)
        sampling = sampling_fields(fields, None)
        seed = fields.integer("seed", 0, 0, 2**63 - 1)
        max_seconds = fields.number("max_seconds", self.config.max_speech_seconds, 0.0, self.config.max_speech_seconds,
                                    low_open=True)
        stream = bool(fields.get("stream", bool, False))
        compare = bool(mmspec_options(data).get("compare_baseline", bool, False))
        fields.refuse_unknown(*COMMON_FIELDS)
        key = (seed, sampling["do_sample"], sampling["temperature"], sampling["top_p"], sampling["top_k"], max_seconds,
               speed, compare)
        return key, text, fmt, stream

    def run_batch(self, key: Hashable, items: Sequence[Any], rows: Any = None) -> list[Any]:
        seed, do_sample, temperature, top_p, top_k, max_seconds, speed, compare = key
        return list(self.pipeline()(list(items), do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, max_seconds=max_seconds, speed=speed, compare_baseline=compare,
                                    batch_size=len(items)))


def wav_bytes(pcm: bytes, sampling_rate: int, channels: int = 1) -> bytes:
    """16-bit PCM (``channels`` interleaved) -> a WAV file's bytes."""
    return wav_header(int(sampling_rate), len(pcm), channels) + pcm


# -- stats -----------------------------------------------------------------------------------------

def clean_json(value: Any) -> Any:
    """Stats -> strict JSON: non-finite floats become None, tuples lists, other objects strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def stats_summary(stats: Any, batch_size: int, queue_wait_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An output's stats -> the response's ``"mmspec"`` object: method, tau, acceptance, speedup
    (None unless compare_baseline), wall time, the server batch it ran in, and the full stats."""
    full = clean_json(stats.to_dict() if hasattr(stats, "to_dict") else dict(stats))
    generation = full.get("generation") or {}
    config = full.get("config") or {}
    summary = {  # (the method named in the config, as the speech and image pipelines record it: their drafter
                 # alone reads "sjd" for coupled SJD too; else, for a caption, the head drafter="auto" picked)
        "method": config.get("method") or config.get("drafter") or full.get("method"),
        "tau": full.get("tau", full.get("mean_accepted_length")),
        "acceptance_rate": full.get("acceptance_rate", generation.get("acceptance_rate")),
        "speedup": full.get("speedup"),
        "wall_time_s": full.get("wall_time_s"),
        "batch_size": batch_size,
        "queue_wait_s": round(queue_wait_s, 6),
    }
    summary.update(extra or {})
    summary["stats"] = full
    return summary
