"""Public entry points: :func:`make_sample`, :func:`iter_split`, :func:`write_split`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from . import charts, counting, maths, photos, scenes, text
from .core import Content, Sample, check_request, compose_sample, sample_rng

FAMILIES = ("scenes", "counting", "text", "charts", "math", "photos")

GENERATORS: dict[str, Callable[[np.random.Generator, str, int], Content]] = {
    "scenes": scenes.generate,
    "counting": counting.generate,
    "text": text.generate,
    "charts": charts.generate,
    "math": maths.generate,
    "photos": photos.generate,
}


def make_sample(family: str, split: str, index: int, size: int = 128) -> Sample:
    """Generate sample ``index`` of ``family`` in ``split``.

    Deterministic in ``(family, split, index, size)``: the same arguments always give the same
    image bytes, prompt and answer, independent of call order or global random state.

    Args:
        family: one of :data:`FAMILIES`.
        split: ``"train"``, ``"validation"`` or ``"test"``.
        index: any non-negative integer.
        size: side of the square RGB image in pixels.

    Raises:
        ValueError: for an unknown family or split, or a non-positive size.

    Example:
        >>> s = make_sample("counting", "train", 0)
        >>> s.image.size, s.kind in ("caption", "short", "detailed")
        ((128, 128), True)
    """
    check_request(family, FAMILIES, "family", split, size)
    rng = sample_rng(family, split, index)
    content = GENERATORS[family](rng, split, size)
    sample = compose_sample(rng, family, content)
    sample.meta.update(split=split, index=index)
    return sample


def iter_split(split: str, n_per_family: int, families: Iterable[str] = FAMILIES,
               size: int = 128) -> Iterator[Sample]:
    """Yield ``n_per_family`` samples of each family, interleaved by index.

    The order is ``(index 0: every family), (index 1: every family), ...`` so that any prefix
    of the stream is balanced across families.
    """
    families = tuple(families)
    for index in range(n_per_family):
        for family in families:
            yield make_sample(family, split, index, size)


def write_split(out_dir, split: str, n_per_family: int, size: int = 128,
                families: Iterable[str] = FAMILIES) -> Path:
    """Write a split as PNG files plus a JSON-lines manifest.

    Layout: ``out_dir/<split>/<family>/<index>.png`` and ``out_dir/<split>.jsonl`` with one
    record per sample: ``image`` (path relative to ``out_dir``), ``prompt``, ``answer``,
    ``family``, ``kind``, ``index`` and ``meta``.

    Returns:
        The path of the manifest.
    """
    out_dir = Path(out_dir)
    manifest = out_dir / f"{split}.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with manifest.open("w", encoding="utf-8") as f:
        for sample in iter_split(split, n_per_family, families, size):
            index = sample.meta["index"]
            rel = Path(split) / sample.family / f"{index:06d}.png"
            (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            sample.image.save(out_dir / rel)
            record = {"image": rel.as_posix(), "prompt": sample.prompt, "answer": sample.answer,
                      "family": sample.family, "kind": sample.kind, "index": index, "meta": sample.meta}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return manifest
