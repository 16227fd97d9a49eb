"""``mmspec serve``: an OpenAI-compatible HTTP server over the pipelines, with request batching.

:func:`create_app` builds the FastAPI app from a :class:`ServeConfig` (no socket; tests use it
in-process); ``mmspec serve`` runs it with uvicorn (docs/serving.md). FastAPI is imported on first
use of :func:`create_app`, so this package imports without the ``serve`` extra.
"""

from __future__ import annotations

from typing import Any

from .config import TASKS, ServeConfig


def create_app(config: ServeConfig | None = None) -> Any:
    """The FastAPI app serving ``config`` (see :func:`mmspec.serve.app.create_app`)."""
    from .app import create_app as _create_app

    return _create_app(config)


__all__ = ["TASKS", "ServeConfig", "create_app"]
