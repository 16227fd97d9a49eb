"""Dataset-scale runs of a command: inputs from files, folders and globs; results streamed to a
JSONL file as they finish; a killed run resumed where it stopped; many processes through
accelerate (``accelerate launch -m mmspec caption DIR --out x.jsonl``).

Each process (rank r of n, from accelerate's process state) takes the inputs i with i % n == r and
appends its records to ``OUT.rank-r-of-n`` (or straight to ``OUT`` when alone). When every process
is done, rank 0 merges the parts and what ``OUT`` already held into ``OUT``, in input order. A
record is one JSON object per line with the input under ``key``; a line cut short by a kill is
dropped, so its input runs again.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def expand_images(patterns: Iterable[str]) -> list[str]:
    """Files as given, folders as the images under them (recursively, sorted), globs as their
    sorted matches; each path once, in the order given.

    Raises:
        ValueError: a folder without images or a glob that matches nothing.
    """
    paths: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(str(p) for p in Path(pattern).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not found:
                raise ValueError(f"{pattern} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        elif glob.has_magic(pattern):
            found = sorted(glob.glob(pattern, recursive=True))
            if not found:
                raise ValueError(f"{pattern!r} matches no file")
        else:
            found = [pattern]
        paths += found
    return list(dict.fromkeys(paths))


def read_records(path: Path, key: str) -> dict[str, dict[str, Any]]:
    """The complete records of a JSONL file by their ``key`` (a last line cut short is dropped from
    the file)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        path.write_bytes(complete)  # a kill mid-line: that input runs again
    records = {}
    for line in complete.decode().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record[key]] = record
    return records


class ProcessState:
    """This process's rank, the process count and its device: accelerate's process state when more
    than one process runs (``accelerate launch``, or ``torchrun``: WORLD_SIZE > 1; on a machine
    without CUDA as accelerate's multi-CPU state, over gloo), else (0, 1, None) without importing it.

    Attributes:
        device: the process's own device ("cuda:LOCAL_RANK" on GPUs) for ``--device auto``, or None.
    """

    def __init__(self) -> None:
        self._state, self.device = None, None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch
            from accelerate import PartialState

            self._state = PartialState(cpu=not torch.cuda.is_available())
            self.device = str(self._state.device)
        self.rank = self._state.process_index if self._state else 0
        self.world = self._state.num_processes if self._state else 1

    def device_for(self, requested: str) -> str:
        """The device to load on: this process's own for "auto" under accelerate, else ``requested``."""
        return self.device if self.device and requested == "auto" else requested

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_for_everyone()


class ShardedResults:
    """Results of ``inputs`` streamed to ``out`` (module doc).

    Attributes:
        todo: this process's inputs that no file holds yet, in order.
        done: the records already held (all processes' parts and ``out``).
    """

    def __init__(self, out: str | os.PathLike, inputs: list[str], key: str, process: ProcessState | None = None) -> None:
        self.out, self.inputs, self.key = Path(out), inputs, key
        self.process = process or ProcessState()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        rank, world = self.process.rank, self.process.world
        self.part = self.out if world == 1 else self.out.with_name(f"{self.out.name}.rank-{rank}-of-{world}")
        self.done = {**read_records(self.out, key), **self._parts()}
        mine = [x for i, x in enumerate(inputs) if i % world == rank]
        self.todo = [x for x in mine if x not in self.done]
        self._file = None

    def _parts(self) -> dict[str, dict[str, Any]]:
        records = {}
        for part in sorted(self.out.parent.glob(f"{glob.escape(self.out.name)}.rank-*-of-*")):
            records.update(read_records(part, self.key))
        return records

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed: a kill loses at most the line being written)."""
        if self._file is None:
            self._file = self.part.open("a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> list[dict[str, Any]]:
        """Close this process's part, wait for the others; rank 0 writes ``out`` in input order and
        removes the parts. Returns every record held, in input order."""
        if self._file is not None:
            self._file.close()
        self.process.wait()
        parts = self._parts()
        records = {**read_records(self.out, self.key), **parts}
        ordered = [records[x] for x in self.inputs if x in records]
        if self.process.rank == 0:  # input order (header failures were written first); parts of a killed run too
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in ordered))
            tmp.replace(self.out)
            for part in self.out.parent.glob(f"{glob.escape(self.out.name)}.rank-*-of-*"):
                part.unlink()
        self.process.wait()
        return ordered


class Progress:
    """A progress bar on stderr (tqdm when installed, else "[i/n] item" lines) for more than one
    item, or always (``always``: dataset runs): items/s, and the running tokens/s and speedup
    over plain decoding (when baselines run); ``write`` prints without breaking the bar."""

    def __init__(self, total: int, always: bool = False, unit: str = "item", show: bool = True) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        self.total, self.done = total, 0
        self.tokens = self.seconds = self.baseline_seconds = 0.0
        show = show and (total > 1 or always)
        self.bar = tqdm(total=total, file=sys.stderr, unit=unit, leave=False) if tqdm and show else None
        self.lines = show

    def start(self, path: str) -> None:
        if self.bar is None and self.lines:
            print(f"[{self.done + 1}/{self.total}] {path}", file=sys.stderr)

    def step(self, tokens: int = 0, seconds: float = 0.0, speedup: float | None = None, count: int = 1) -> None:
        """``count`` items done, with their tokens and time (an item of a batch: its share of the
        batch's wall time), and the speedup over plain decoding when a baseline ran."""
        self.done += count
        self.tokens += tokens
        self.seconds += seconds
        if speedup:
            self.baseline_seconds += seconds * speedup
        if self.bar is not None:
            self.bar.set_postfix_str(self.summary(), refresh=False)
            self.bar.update(count)

    def summary(self) -> str:
        """The running tokens/s and speedup over plain decoding so far (what the bar shows)."""
        text = f"{self.tokens / self.seconds:.1f} tok/s" if self.seconds else ""
        if self.baseline_seconds:
            text += f", {self.baseline_seconds / self.seconds:.2f}x over plain decoding"
        return text

    def write(self, text: str, file=None) -> None:
        file = file or sys.stdout
        if self.bar is not None:
            self.bar.write(text, file=file)
        else:
            print(text, file=file)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
