"""One mmspec computation at a time per process, under PyTorch's default dtype float32.

:func:`exclusive` holds :data:`LOCK` (reentrant) and, inside, PyTorch's default dtype float32
(the caller's back afterwards). ``mmspec.generate`` / ``generate_rows`` and every pipeline's
construction, call and stream step run inside it, so that

- calls from several threads run one at a time, each giving what it gives alone (threads sharing
  one captioning pipeline shared its drafter's state: wrong captions, a ValueError from the fused
  EAGLE-3 chain);
- a model built on one thread, which sets the process-wide default dtype to bfloat16 for a while
  (transformers does while it builds one), no longer reaches the tensors another thread's decoding
  makes then (the speech server saw sampled codes change about 1 run in 9);
- a caller who set another default dtype (``torch.set_default_dtype(torch.float64)``) gets the
  outputs of the default one: the same seed, the same output (with float64 every task's output
  changed, and with bfloat16 a fused chain's float32 buffers came out bfloat16).
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
def exclusive() -> Iterator[None]:
    """Hold :data:`LOCK`, with PyTorch's default dtype float32 inside."""
    with LOCK:
        previous = torch.get_default_dtype()
        if previous == torch.float32:
            yield
            return
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def exclusively(function: F) -> F:
    """``function`` run inside :func:`exclusive`; its signature and docs are the original's."""
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with exclusive():
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
