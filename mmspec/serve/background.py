"""A server on a free loopback port in a thread of this process: what the load test and the tests
run the app under when a real socket is the point (the ``openai`` client, streaming, hang-ups)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def serve_in_thread(app: Any, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1 at a free port until the block ends.

    Yields:
        The base URL, ``http://127.0.0.1:PORT``.
    Raises:
        RuntimeError: the server did not start within ``start_timeout_s``.
    """
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server on port {port} did not start within {start_timeout_s:g} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
