"""One mmspec computation at a time per process.

:func:`exclusive` holds :data:`LOCK` (reentrant). ``mmspec.generate`` / ``generate_rows`` and
every pipeline's construction, call and stream step run inside it, so that calls from several
threads run one at a time, each giving what it gives alone: threads sharing one captioning
pipeline shared its drafter's state (wrong captions, a ValueError from the fused EAGLE-3 chain),
and a model built on one thread while another decoded changed the decoding's sampled codes (the
speech server saw it about 1 run in 9): building a model sets PyTorch's process-wide default dtype
to bfloat16 for a while, and the decoding made tensors without naming their dtype.

Those tensors now name it (the sampling uniforms, the voice's logits rows, a fused chain's draw
buffers, which its C call also checks), so a call's outputs do not depend on the default dtype: a
caller who set ``torch.set_default_dtype(torch.float64)``, or a model of the caller's own built on
another thread meanwhile, changes nothing (tests/test_exclusive.py). Calls leave the default dtype
alone (a process-wide setting changed and restored around every call could be restored over
another thread's own change); only a pipeline's construction, which builds modules (their
parameters and buffers take the default dtype, as transformers' loading does), runs with it set to
float32 inside the lock (``exclusive(torch.float32)``), the caller's back afterwards.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

#: held while mmspec computes (reentrant: a pipeline's call runs ``mmspec.generate`` inside)
LOCK = threading.RLock()


@contextmanager
def exclusive(default_dtype: torch.dtype | None = None) -> Iterator[None]:
    """Hold :data:`LOCK` for the block; with ``default_dtype``, PyTorch's default dtype is that
    inside it (the caller's back afterwards)."""
    with LOCK:
        previous = torch.get_default_dtype()
        if default_dtype is None or previous == default_dtype:
            yield
            return
        torch.set_default_dtype(default_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def exclusively(function: F, default_dtype: torch.dtype | None = None) -> F:
    """``function`` run inside :func:`exclusive` (``default_dtype`` as there); its signature and
    docs are the original's."""
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with exclusive(default_dtype):
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def exclusive_steps(steps: Iterator[Any]) -> Iterator[Any]:
    """The items of ``steps`` (a stream's generator), each made inside :func:`exclusive` and handed
    over outside it (a consumer playing a chunk holds no other call up); closing this closes
    ``steps`` inside it too (its clean-up)."""
    try:
        while True:
            with exclusive():
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item
    finally:
        with exclusive():
            steps.close()
