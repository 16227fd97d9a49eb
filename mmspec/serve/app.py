"""The FastAPI application: :func:`create_app` (no socket; ``mmspec serve`` runs it with uvicorn).

Routes: ``GET /`` (a demo page), ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/images/generations``, ``POST /v1/audio/speech`` (docs/serving.md). Every error answers
an OpenAI-style JSON body (:mod:`mmspec.serve.errors`); a failing request never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..adapters.audio.codec import pcm16
from ..pipelines.images import png_base64
from .batching import Batcher
from .config import TASKS, ServeConfig
from .errors import APIError
from .inputs import clip, parse_json
from .tasks import CaptionService, ImageService, SpeechService, TaskService, stats_summary, wav_bytes


#: short task -> the service class answering it
SERVICES: dict[str, type[TaskService]] = {"caption": CaptionService, "t2i": ImageService, "tts": SpeechService}
#: bytes of audio per streamed chunk
AUDIO_CHUNK = 32 * 1024
#: the error code of Starlette's own HTTP errors (an unknown path, a wrong method)
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
#: refusals after which the connection closes: a body that stalled (408). Not a 413: its client is
#: still sending, and closing on unread bytes resets the connection before it reads the answer
CLOSES_CONNECTION = (408,)
#: short task -> the endpoint that serves it (named when a model is sent to another one)
ENDPOINTS = {"caption": "POST /v1/chat/completions", "t2i": "POST /v1/images/generations", "tts": "POST /v1/audio/speech"}


class Server:
    """The app's state: the config, one service per task and, per event loop, one batcher per task."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.services: dict[str, TaskService] = {task: SERVICES[task](config) for task in config.tasks}
        self.started = time.time()
        self._batchers: dict[str, Batcher] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executors: dict[str, Any] = {}

    def batcher(self, task: str) -> Batcher:
        """The task's batcher in the running event loop (made on first use; a new loop -- a test
        client's -- gets new ones, the worker threads and pipelines stay)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._batchers, self._loop = {}, loop
        if task not in self._batchers:
            service = self.services[task]
            batcher = Batcher(task, service.call, self.config.max_batch_size, self.config.max_queue,
                              self.config.batch_wait_s, self._executors.get(task), self.config.stream_stall_s)
            self._executors[task] = batcher.executor
            self._batchers[task] = batcher
        return self._batchers[task]

    def service_for(self, model: Any, task: str, required: bool = True) -> TaskService:
        """The service a request's ``model`` names for ``task``: its id, the task's short name or
        pipeline name. Raises APIError 404 for an unknown model, 400 for a missing one or for one
        that another served task answers to (``wrong_endpoint``, naming that task's endpoint)."""
        if task not in self.services:
            raise APIError(404, f"this server does not serve {TASKS[task]} (start it with --tasks including {task})",
                           "model", "task_not_served")
        if model is None and not required:
            return self.services[task]
        if model is None:
            raise APIError(400, "'model' is required; GET /v1/models lists the served ones", "model", "missing_field")
        if not isinstance(model, str):
            raise APIError(400, f"'model' must be a string, got {type(model).__name__}", "model", "invalid_type")
        if model in model_names(task, self.services[task]):
            return self.services[task]
        for other, service in self.services.items():
            if model in model_names(other, service):
                raise APIError(400, f"the model {clip(model)!r} is the {TASKS[other]} model; send it to {ENDPOINTS[other]}",
                               "model", "wrong_endpoint")
        served = ", ".join(s.model_id for s in self.services.values())
        raise APIError(404, f"the model {clip(model)!r} does not exist here; served models: {served}", "model",
                       "model_not_found")

    async def close(self) -> None:
        for batcher in self._batchers.values():
            await batcher.close()
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)


def create_app(config: ServeConfig | None = None) -> FastAPI:
    """A FastAPI app serving ``config`` (default: every task with its embedded default model).

    Pipelines load on their task's first request (or at start-up with ``preload(app)``).
    Example:
        >>> from fastapi.testclient import TestClient
        >>> with TestClient(create_app(ServeConfig(tasks=("caption",)))) as client:
        ...     client.get("/health").json()["status"]
        'ok'
    """
    config = config or ServeConfig()
    server = Server(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await server.close()  # waiting jobs get 503; a batch already running finishes

    # redirect_slashes=False: a path with a trailing slash ("/v1/chat/completions/") got Starlette's
    # empty 307 to the path without it (curl and httpx follow none by default); now the JSON 404 below
    app = FastAPI(title="mmspec", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"Connection": "close"} if error.status in CLOSES_CONNECTION else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors, with what to send instead: a wrong method names the path's
        methods, an unknown path the routes."""
        code, message = HTTP_CODES.get(error.status_code, "http_error"), str(error.detail)
        if error.status_code == 405:
            allowed = (error.headers or {}).get("Allow")  # (Starlette's 405 names the path's methods there)
            message = f"{request.url.path} takes {allowed or 'another method'}, not {request.method}"
        elif error.status_code == 404 and message == "Not Found":
            routes = sorted(f"{method} {route.path}" for route in app.routes if getattr(route, "include_in_schema", True)
                            for method in sorted(getattr(route, "methods", None) or ()) if method != "HEAD")
            path = request.url.path
            bare = path.rstrip("/")
            hint = (f"send it without the trailing slash ({bare}); " if bare != path and bare
                    and any(getattr(route, "path", None) == bare for route in app.routes) else "")
            message = f"no route {request.method} {path}; {hint}this server has: {', '.join(routes)}"
        return JSONResponse(APIError(error.status_code, message, code=code).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, f"invalid request: {error.errors()[:1]}", code="invalid_request").body(), status_code=400)

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    @app.exception_handler(FileNotFoundError)
    async def input_error(request: Request, error: Exception) -> JSONResponse:
        """A pipeline refused a request's input: its one-line message, 400."""
        message = (str(error).splitlines() or [type(error).__name__])[0]
        return JSONResponse(APIError(400, message, code="invalid_input").body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        """Anything else: a one-line 500 to the client (the server logs the traceback)."""
        return JSONResponse(APIError(500, "internal server error (see the server log)", code="internal_error").body(), status_code=500)

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        """The demo page (:mod:`mmspec.serve.page`): caption, image and speech panels with their stats."""
        from .page import render_page

        return HTMLResponse(render_page(config.max_tokens_limit))

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: the headers of GET, uvicorn sends no body)
    async def health() -> dict[str, Any]:
        """Liveness and what runs: tasks, whether each pipeline is loaded, queue depths, batches
        decoding now, requests dropped before their batch / cancelled inside it / joined into a
        running batch."""
        batchers = server._batchers if server._loop is asyncio.get_running_loop() else {}
        return {"status": "ok", "uptime_s": round(time.time() - server.started, 3),
                "tasks": {task: {"model": s.model_id, "loaded": s.loaded, "load_error": s.load_error,
                                 **{name: getattr(batchers[task], name) if task in batchers else 0
                                    for name in ("waiting", "running", "dropped", "cancelled", "joined")}}
                          for task, s in server.services.items()}}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The served models, OpenAI's list shape."""
        check_api_key(request, config)
        return {"object": "list", "data": [
            {"id": s.model_id, "object": "model", "created": int(server.started), "owned_by": "mmspec", "task": TASKS[task]}
            for task, s in server.services.items()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """A chat over images -> the answer, whole or as server-sent events (each verification
        step's accepted text as one delta)."""
        data = parse_json(await read_body(request, config))
        service = server.service_for(data.get("model"), "caption")
        parsed = await run_in_threadpool(service.parse, data)  # decodes the image: off the event loop
        model = data["model"]
        batcher = server.batcher("caption")
        created, chat_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            # (a full queue answers 429 here, before the stream's 200)
            # (no is_disconnected: a streaming client that leaves ends the event stream, which cancels the job)
            job = batcher.enqueue(parsed.key, parsed.item, stream=True)
            return StreamingResponse(stream_chat(batcher, job, parsed, model, chat_id, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        (output, prompt_tokens), info = await batcher.submit(parsed.key, parsed.item, request.is_disconnected)
        completion_tokens = int(getattr(output.stats, "new_tokens", 0))
        return JSONResponse({
            "id": chat_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": output.text},
                         "logprobs": None, "finish_reason": finish_reason(output, completion_tokens, parsed.key[0])}],
            "usage": usage(prompt_tokens, completion_tokens),
            "mmspec": caption_summary(output, info),
        })

    @app.post("/v1/images/generations")
    async def images_generations(request: Request) -> JSONResponse:
        """A prompt -> ``n`` PNG images as base64, with the method's stats."""
        data = parse_json(await read_body(request, config))
        key, prompt = server.service_for(data.get("model"), "t2i", required=False).parse(data)
        output, info = await server.batcher("t2i").submit(key, prompt, request.is_disconnected)
        return JSONResponse({
            "created": int(time.time()),
            "data": [{"b64_json": png_base64(image), "revised_prompt": None} for image in output.images],
            "mmspec": stats_summary(output.stats, info.batch_size, info.queue_wait_s),
        })

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request) -> Response:
        """Text -> speech: a 16-bit WAV (or raw PCM, channels interleaved), whole or in chunks; stats in a header."""
        data = parse_json(await read_body(request, config))
        service = server.service_for(data.get("model"), "tts")
        key, text, fmt, stream = service.parse(data)
        output, info = await server.batcher("tts").submit(key, text, request.is_disconnected)
        pcm, channels = pcm16(output.audio), output.audio.shape[0]
        body = wav_bytes(pcm, output.sampling_rate, channels) if fmt == "wav" else pcm
        summary = stats_summary(output.stats, info.batch_size, info.queue_wait_s)
        summary.pop("stats")
        headers = {"X-Mmspec-Stats": json.dumps(summary), "X-Sampling-Rate": str(output.sampling_rate)}
        media = "audio/wav" if fmt == "wav" else f"audio/L16; rate={output.sampling_rate}; channels={channels}"
        if not stream:
            return Response(body, media_type=media, headers=headers)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), AUDIO_CHUNK):
                if await request.is_disconnected():  # (a client gone: no more writes to its dead socket)
                    return
                yield body[start : start + AUDIO_CHUNK]

        return StreamingResponse(chunks(), media_type=media, headers=headers)

    return app


def check_settings(app: FastAPI) -> None:
    """Every served task's pipeline settings checked without loading (``mmspec serve`` at start).
    Raises ValueError: one line naming the task and what to change."""
    for service in app.state.server.services.values():
        service.check()


def preload(app: FastAPI) -> None:
    """Load every served task's pipeline now (``mmspec serve --preload``).
    Raises ValueError: one line, when one cannot load."""
    for service in app.state.server.services.values():
        try:
            service.load()
        except APIError as error:
            raise ValueError(error.message) from None


async def read_body(request: Request, config: ServeConfig) -> bytes:
    """The API key checked, then the body, refused with 413 as soon as it passes ``max_body_bytes``
    (a Content-Length over it before reading; chunked bodies while reading).

    Raises:
        APIError: 401 (the key), 413 (too large), 408 when the whole body has not arrived within
            ``body_timeout_s`` (a Content-Length larger than what is sent, a client that stalls),
            499 when the client hangs up while sending it (answered to no one, without a traceback).
    """
    check_api_key(request, config)
    check_json_content_type(request)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
        raise APIError(413, f"the request body is larger than {config.max_body_bytes} bytes (--max-body-bytes)",
                       code="body_too_large")
    try:
        return await asyncio.wait_for(_read_chunks(request, config.max_body_bytes), config.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {config.body_timeout_s:g} s (--body-timeout-s)",
                       code="body_timeout") from None
    except ClientDisconnect:
        raise APIError(499, "the client closed the request while sending its body", code="client_closed") from None


def check_json_content_type(request: Request) -> None:
    """Refuse (415) a body not sent as ``Content-Type: application/json`` (parameters such as
    ``charset`` allowed). The body was parsed as JSON whatever its type, so any web page the
    server's user opened could make it decode (a form or ``text/plain`` POST is sent cross-site
    without asking the server first; an ``application/json`` one is not)."""
    media = request.headers.get("content-type")
    if media is None or media.split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {clip(media)!r}" if media is not None else "got none"
        raise APIError(415, f"send the body as JSON with Content-Type: application/json ({got}; curl: "
                       "-H 'Content-Type: application/json')", code="unsupported_media_type")


async def _read_chunks(request: Request, max_body_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise APIError(413, f"the request body is larger than {max_body_bytes} bytes (--max-body-bytes)",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def model_names(task: str, service: TaskService) -> tuple[str, str, str]:
    """The names a request's ``model`` may give a served task: its model id, the task's short name
    and its pipeline name (``tts``, ``text-to-speech``)."""
    return service.model_id, task, TASKS[task]


def check_api_key(request: Request, config: ServeConfig) -> None:
    """With an API key set: ``Authorization: Bearer <key>`` compared in constant time. Raises APIError 401."""
    if config.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")


def finish_reason(output: Any, completion_tokens: int, max_tokens: int) -> str:
    """OpenAI's finish reason of a caption: "length" when the budget cut it (``max_tokens`` tokens
    and no end token among them), else "stop" (an end token as the last allowed token is a stop)."""
    return "length" if completion_tokens >= max_tokens and not output.ended_with_eos else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def caption_summary(output: Any, info: Any) -> dict[str, Any]:
    """The chat response's ``"mmspec"`` object (the baseline's caption and stats when compared)."""
    extra = {}
    if output.baseline_stats is not None:
        extra = {"baseline_text": output.baseline_text, "identical_to_baseline": output.identical_to_baseline,
                 "baseline_wall_time_s": output.baseline_stats.wall_time_s}
    return stats_summary(output.stats, info.batch_size, info.queue_wait_s, extra)


async def stream_chat(batcher: Batcher, job: Any, parsed: Any, model: str, chat_id: str, created: int) -> AsyncIterator[str]:
    """Server-sent events of a chat completion: a role chunk at once, then one chunk per
    verification step's accepted text (as the batch decodes), then a chunk with the finish reason,
    the ``mmspec`` stats and ``usage``, with ``include_usage`` OpenAI's usage chunk, then ``[DONE]``.

    An error after the stream opened is sent as an ``{"error": ...}`` event. A client that goes
    away ends this generator (Starlette cancels it): the job's row leaves its batch.
    """
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return event({"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    async for piece in batcher.events(job):
        yield chunk({"content": piece})
    try:
        (output, prompt_tokens), info = await job.future
    except APIError as error:
        yield event(error.body())
        yield "data: [DONE]\n\n"
        return
    except Exception as error:  # a pipeline error after the 200 went out
        refused = isinstance(error, (ValueError, TypeError))
        yield event(APIError(400 if refused else 500, (str(error).splitlines() or [type(error).__name__])[0],
                             code="invalid_input" if refused else "internal_error").body())
        yield "data: [DONE]\n\n"
        return
    completion_tokens = int(getattr(output.stats, "new_tokens", 0))
    yield chunk({}, finish_reason(output, completion_tokens, parsed.key[0]), mmspec=caption_summary(output, info),
                usage=usage(prompt_tokens, completion_tokens))
    if parsed.include_usage:
        yield event({"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                     "usage": usage(prompt_tokens, completion_tokens)})
    yield "data: [DONE]\n\n"


def _version() -> str:
    from .. import __version__

    return __version__
