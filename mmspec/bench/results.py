"""Benchmark result files: one JSON written atomically after every measurement, so a run resumes."""

from __future__ import annotations

import json
from pathlib import Path


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(path)
