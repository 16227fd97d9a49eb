"""``mmspec serve``: run the OpenAI-compatible server (docs/serving.md) with uvicorn.

Binds 127.0.0.1 by default; ``--host 0.0.0.0`` exposes it (use ``--api-key`` then).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from ..cli import command_help
from .config import DEFAULT_MODEL_IDS, TASKS, ServeConfig


def add_parser(subparsers) -> None:
    cmd = subparsers.add_parser("serve", help=command_help("serve"))
    cmd.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    cmd.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    cmd.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated tasks to serve: {', '.join(TASKS)}")
    cmd.add_argument("--caption-model", default=None, help="a VLM directory (default: the embedded captioner, "
                     f"model id {DEFAULT_MODEL_IDS['caption']})")
    cmd.add_argument("--t2i-model", default=None, help=f"a text-to-image model (default: embedded, id {DEFAULT_MODEL_IDS['t2i']})")
    cmd.add_argument("--tts-model", default=None, help=f"a TTS model directory or embedded voice (default: embedded, "
                     f"id {DEFAULT_MODEL_IDS['tts']})")
    cmd.add_argument("--caption-drafter", default="auto", help="the captioner's drafter (default: auto)")
    cmd.add_argument("--t2i-method", default="sjd-coupled", help="the text-to-image method (default: sjd-coupled)")
    cmd.add_argument("--tts-method", default="sjd-coupled", help="the text-to-speech method (default: sjd-coupled)")
    cmd.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    cmd.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (float32: greedy batch rows bit-equal "
                     "to single requests)")
    cmd.add_argument("--max-batch-size", type=int, default=16, help="requests of one task decoded together at most (default: 16)")
    cmd.add_argument("--batch-wait-ms", type=float, default=10.0, help="how long a request waits for others to batch with")
    cmd.add_argument("--max-queue", type=int, default=64, help="waiting requests per task before 429 (default: 64)")
    cmd.add_argument("--max-body-bytes", type=int, default=20 * 1024 * 1024, help="largest request body (default: 20 MB)")
    cmd.add_argument("--body-timeout-s", type=float, default=60.0,
                     help="longest wait for a request's whole body before a 408 (default: 60)")
    cmd.add_argument("--max-prompt-chars", type=int, default=4000, help="longest text prompt or speech input of a request")
    cmd.add_argument("--max-tokens-limit", type=int, default=512, help="largest max_tokens of a chat request (also the default's cap: 64 when none is sent)")
    cmd.add_argument("--max-chat-images", type=int, default=8, help="most images in one chat request (default: 8)")
    cmd.add_argument("--stream-stall-s", type=float, default=30.0,
                     help="a streaming client that reads nothing this long is treated as gone (default: 30)")
    cmd.add_argument("--api-key", default=os.environ.get("MMSPEC_API_KEY"),
                     help="require Authorization: Bearer KEY on /v1/* (default: $MMSPEC_API_KEY, else none)")
    cmd.add_argument("--allow-local-files", action="store_true", help="let image_url name a file on this machine")
    cmd.add_argument("--local-files-root", default=None, help="with --allow-local-files: only files under this folder")
    cmd.add_argument("--preload", action="store_true", help="load every pipeline before accepting requests")
    cmd.add_argument("--threads", type=int, default=None, help="torch threads")
    cmd.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="the server's log messages from this level up")
    cmd.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The parsed options -> a checked ServeConfig (ValueError with one line on a bad value)."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be between 1 and 65535, got {args.port}")
    for flag, model in (("--caption-model", args.caption_model), ("--t2i-model", args.t2i_model), ("--tts-model", args.tts_model)):
        check_local_model(flag, model)
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not tasks:
        raise ValueError(f"--tasks is empty; serve some of: {', '.join(TASKS)}")
    if args.local_files_root is not None and not args.allow_local_files:
        raise ValueError("--local-files-root needs --allow-local-files (without it image_url takes data URIs only)")
    if args.api_key is not None and not args.api_key:
        raise ValueError("the API key is empty (--api-key or $MMSPEC_API_KEY); give a key or unset it")
    if not 0 <= args.batch_wait_ms <= 10_000:  # (the limits >= 1: mmspec.cli.args's shared rules, before this)
        raise ValueError(f"--batch-wait-ms must be between 0 and 10000, got {args.batch_wait_ms}")
    return ServeConfig(
        tasks=tasks, models={"caption": args.caption_model, "t2i": args.t2i_model, "tts": args.tts_model},
        caption_drafter=args.caption_drafter, t2i_method=args.t2i_method, tts_method=args.tts_method,
        device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size, batch_wait_s=args.batch_wait_ms / 1000,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        max_prompt_chars=args.max_prompt_chars,
        max_tokens_limit=args.max_tokens_limit, max_chat_images=args.max_chat_images,
        stream_stall_s=args.stream_stall_s, api_key=args.api_key, allow_local_files=args.allow_local_files,
        local_files_root=args.local_files_root)


def check_local_model(flag: str, model: str | None) -> None:
    """The server downloads nothing: a model named with a path separator (a path, or a hub id such as
    ``org/name``) must be a local directory; a bare name is an embedded model's. Raises ValueError."""
    if model and ("/" in model or os.sep in model) and not Path(model).expanduser().is_dir():
        raise ValueError(f"{flag} {model}: no such local directory (mmspec serve downloads no models; "
                         "download it first and pass its directory)")


def check_address(host: str, port: int) -> None:
    """Whether the server could listen on ``host``:``port`` now (bound and released at once).
    Raises ValueError: one line (a port in use, an address that does not resolve or is not this
    machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: cannot resolve it ({error.strerror}); give an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            why = "the port is in use; choose another --port" if error.errno == errno.EADDRINUSE else error.strerror
            raise ValueError(f"cannot listen on {host}:{port} ({why})") from None


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    # nothing from the model hub at serving time, whatever a pipeline might try (set before they import)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import uvicorn

        from .app import check_settings, create_app, preload
    except ImportError as error:
        from ..hub import MissingDependencyError

        raise MissingDependencyError(f"mmspec serve needs FastAPI and uvicorn ({error}); pip install 'mmspec[serve]'") from None
    app = create_app(config)
    check_settings(app)  # an unknown drafter or method, a bad dtype: one line now, not a 503 per request
    check_address(args.host, args.port)
    if args.preload:
        preload(app)
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"mmspec serve: warning: listening on {args.host} without --api-key")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30)
    return 0
