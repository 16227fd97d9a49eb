"""Image-caption pairs for the embedded text-to-image model: the ``scenes`` family of the caption
data generator (1-4 coloured shapes on a plain background, captions that name colours, shapes,
sizes, positions and relations), rendered at 128 x 128.

:func:`scene_pool` renders ``n`` consecutive samples of a split once and caches them
(``$MMSPEC_CACHE/t2i-data/SPLIT-START-N-SIZE.pt``: uint8 images [n, 3, S, S] and, per image, its
captions with the detailed description last). The prompt set of the benchmark
(:data:`BENCH_PROMPTS`) comes from the test split, which owns object combinations the train split
never draws.
"""

from __future__ import annotations

import os
import threading
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from .data.core import sample_rng
from .data import scenes


#: renders of fewer samples than this run in the calling process (a pool's start costs more)
POOL_FROM = 512


def _worker_signals() -> None:
    """A render worker's signals as a plain process's: the pool ends its workers with SIGTERM, and a
    fork inherits the CLI's handler, which raised ``Terminated`` (a traceback on every cold cache);
    Ctrl-C is the parent's to handle."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _render(args: tuple[str, int, int]) -> tuple[np.ndarray, list[str]]:
    split, index, size = args
    content = scenes.generate(sample_rng("scenes", split, index), split, size)
    image = np.asarray(content.image.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1).copy()
    return image, [*content.captions, content.detailed]


def cache_root() -> Path:
    """``$MMSPEC_CACHE/t2i-data`` (see :func:`mmspec.hub.cache_dir`)."""
    from ..hub import cache_dir

    return cache_dir() / "t2i-data"


def content_stamp(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256: the key of a cache computed from the file (a
    tokenizer's weights), so a file replaced within the same second, or copied with its time kept,
    gets a new key (a time stamp did not tell them apart). Hashing the ~6 MB weights takes ~10 ms."""
    import hashlib

    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()[:16]


def scene_pool(split: str, n: int, start: int = 0, size: int = 128, workers: int = 2) -> tuple[torch.Tensor, list[list[str]]]:
    """Render (or load the cached) samples ``start .. start + n - 1`` of the ``scenes`` split
    (``workers`` forked processes for :data:`POOL_FROM` samples or more, from a process without other
    Python threads; else in this process: the same images either way).

    Returns:
        images: uint8 [n, 3, size, size]; captions: n lists of strings (short captions first, the
        detailed description last).
    """
    path = cache_root() / f"{split}-{start}-{n}-{size}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return saved["images"], saved["captions"]
    jobs = [(split, i, size) for i in range(start, start + n)]
    if workers > 1 and n >= POOL_FROM and threading.active_count() == 1:
        # forked only from a process without other Python threads: a fork copies a lock that another
        # thread (a test runner's, a server's, a progress bar's) holds, and the child waits on it for
        # ever (a test worker hung so); spawning would re-run an unguarded __main__, `python -m mmspec`'s
        with get_context("fork").Pool(workers, initializer=_worker_signals) as pool:
            rendered = pool.map(_render, jobs, chunksize=64)
    else:
        rendered = [_render(job) for job in jobs]
    images = torch.from_numpy(np.stack([r[0] for r in rendered]))
    captions = [r[1] for r in rendered]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # per process: workers building the same file at once
    torch.save({"images": images, "captions": captions}, tmp)
    tmp.replace(path)
    return images, captions


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float [B, 3, H, W] in [-1, 1]."""
    return images.float() / 127.5 - 1.0


def pick_captions(captions: list[list[str]], rows: torch.Tensor, generator: torch.Generator) -> list[str]:
    """One of each row's captions (short captions and the detailed description), drawn uniformly."""
    picks = torch.randint(100, (len(rows),), generator=generator).tolist()
    return [captions[r][p % len(captions[r])] for r, p in zip(rows.tolist(), picks)]
