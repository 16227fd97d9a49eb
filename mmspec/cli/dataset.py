"""Dataset-scale runs of a command: inputs from files, folders and globs; results streamed to a
JSONL file as they finish; a killed run resumed where it stopped; many processes through
accelerate (``accelerate launch -m mmspec caption DIR --out x.jsonl``).

Each process (rank r of n, from accelerate's process state) takes the inputs i with i % n == r and
appends its records to ``OUT.rank-r-of-n`` (or straight to ``OUT`` when alone). When every process
is done, rank 0 merges the parts and what ``OUT`` already held into ``OUT``, in input order (rows
``OUT`` held for inputs not given this time stay, after them). A record is one JSON object per
line with the input under ``key``; a line cut short by a kill is dropped, so its input runs again.

One exit rule for every command that writes rows (``mmspec caption``, ``mmspec t2i --prompts``):
a row that failed is a record with an ``error`` field, the run goes on with the other rows, and
the command exits 2 when any row of its output failed, after one summary line ("N of M rows
failed; see their error field in OUT"). ``--retry-errors`` redoes only the failed rows of an
existing output file (the done rows are kept, as a resume keeps them). Ctrl-C leaves the rows
finished so far in the file; the command says so and how to resume (:func:`interrupted_rows`).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from .output import OutputFiles, hold_lock, output_error, write_text
from ..core import words

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def expand_images(patterns: Iterable[str]) -> list[str]:
    """Files as given, folders as the images under them (recursively, sorted), globs as their
    sorted matches, a folder among them as its images (as the shell's own glob passes the folder);
    each path once, in the order given. A path that exists is itself, even when its name holds
    glob characters (``[2024] trip.png``); else a leading ``~`` is the home folder (a quoted
    ``'~/photos/*.png'``, which the shell does not expand).

    Raises:
        ValueError: a folder without images, a glob that matches nothing or only such folders.
    """
    paths: list[str] = []
    for given in patterns:
        pattern = given if os.path.lexists(given) else os.path.expanduser(given)  # (a quoted '~/photos': the shell left it)
        if os.path.isdir(pattern):
            found = images_under(pattern)
            if not found:
                raise ValueError(f"{pattern} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        elif glob.has_magic(pattern) and not os.path.lexists(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise ValueError(f"{pattern!r} matches no file")
            found = [path for match in matches for path in (images_under(match) if os.path.isdir(match) else [match])]
            if not found:
                raise ValueError(f"{pattern!r} matches no image, only folders without images ({', '.join(IMAGE_SUFFIXES)})")
        else:
            found = [pattern]
        paths += found
    return list(dict.fromkeys(paths))


def images_under(folder: str) -> list[str]:
    """The image files under ``folder``, recursively, sorted."""
    return sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def changed_settings(before: Any, now: dict[str, Any]) -> str:
    """The settings of ``now`` that ``before`` (a run's recorded settings) holds with another value,
    as "name X there, Y now; ..." (at most three; "" when none): what a refused resume names."""
    if not isinstance(before, dict):
        return ""
    changed = [name for name in now if name in before and before[name] != now[name]]
    return "; ".join(f"{name} {before[name]!r} there, {now[name]!r} now" for name in changed[:3])


def read_records(path: Path, key: str) -> dict[str, dict[str, Any]]:
    """The complete records of a JSONL file by their ``key``. A last line cut short by a kill (an
    object begun, not JSON) is dropped from the file, so that its input runs again -- only once
    every other line has read as a record: a file that is not such a results file is refused in
    one line and left as it was."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a JSONL results file (not UTF-8 text); choose another output file") from None
    cut = tail.strip() != b"" and _cut_short(tail.decode())
    records = {}
    for number, line in enumerate(lines[:-1] if cut else lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path} line {number} is not JSON, so the file is not a results file to resume; "
                             "choose another output file (or delete it)") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f"{path} line {number} has no {key!r} field naming its input: it holds another command's "
                             "results; choose another output file")
        records[record[key]] = record
    if cut:
        try:
            path.write_bytes(complete)  # a kill mid-line: that input runs again
        except OSError as error:
            raise output_error(path, error) from None
    elif tail.strip():  # a complete last line without its newline: the next record must not join it
        try:
            with path.open("ab") as file:
                file.write(b"\n")
        except OSError as error:
            raise output_error(path, error) from None
    return records


def _cut_short(line: str) -> bool:
    """Whether a last line without its newline is a record a kill cut short: an object begun
    (``{``) that does not read as JSON."""
    if not line.lstrip().startswith("{"):
        return False
    try:
        json.loads(line)
    except ValueError:
        return True
    return False


def launched_processes() -> int:
    """How many processes a launcher started for this command (``accelerate launch``, ``torchrun``:
    WORLD_SIZE), without importing accelerate; 1 when run alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_sharded_output(out: Any, option: str = "--out FILE.jsonl") -> None:
    """Under a launcher, refuse a run without an output file in one line: the processes shard their
    inputs into one file; without it each did the whole job and printed all of it."""
    if launched_processes() > 1 and not out:
        raise ValueError(f"{launched_processes()} processes shard the inputs into one output file: pass {option} "
                         "(or run one process)")


class ProcessState:
    """This process's rank, the process count and its device: accelerate's process state when more
    than one process runs (``accelerate launch``, or ``torchrun``: WORLD_SIZE > 1; on a machine
    without CUDA as accelerate's multi-CPU state, over gloo), else (0, 1, None) without importing it.

    Attributes:
        device: the process's own device ("cuda:LOCAL_RANK" on GPUs) for ``--device auto``, or None.
    """

    def __init__(self) -> None:
        self._state, self.device = None, None
        if launched_processes() > 1:
            import torch

            from ..hub import require_modules

            require_modules(("accelerate",), f"a run over {launched_processes()} processes", "pip install 'mmspec[distributed]'")
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

    Args:
        retry_errors: redo the inputs whose record holds an ``error`` (``--retry-errors``); their
            new records replace the failed ones. Without it a failed row counts as done.
    Attributes:
        todo: this process's inputs that no file holds yet (or whose record failed, with
            ``retry_errors``), in order.
        pending: every process's such inputs: what this run makes (its summary's counts).
        done: the records already held (all processes' parts and ``out``), less those retried.
        retried: how many failed records (of every process) are run again.
    Raises:
        OutputError: the folder or a file cannot be made or written (one line naming the path).
    """

    def __init__(self, out: str | os.PathLike, inputs: list[str], key: str, process: ProcessState | None = None,
                 retry_errors: bool = False, settings: dict[str, Any] | None = None,
                 input_fields: dict[str, dict[str, Any]] | None = None) -> None:
        self.out, self.inputs, self.key = Path(out), inputs, key
        self.process = process or ProcessState()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise output_error(self.out, error) from None
        rank, world = self.process.rank, self.process.world
        hold_lock(self.out.with_name(f".{self.out.name}.lock-{rank}"), str(self.out))  # (one run a rank at a time)
        self.part = self.out if world == 1 else self.out.with_name(f"{self.out.name}.rank-{rank}-of-{world}")
        self.done = {**read_records(self.out, key), **self._parts()}
        self._check_same_run(settings or {}, input_fields or {})
        failed = {x for x in inputs if "error" in self.done.get(x, {})} if retry_errors else set()
        self.retried = len(failed)
        self.done = {x: r for x, r in self.done.items() if x not in failed}
        self.pending = [x for x in inputs if x not in self.done]
        self.todo = [x for i, x in enumerate(inputs) if i % world == rank and x not in self.done]
        self._file = None
        if failed:  # the failed rows out of OUT and of every part (an earlier run's, any process count) first,
            self.process.wait()  # once every process has read them: a stale failed record could otherwise
            if rank == 0:  # win the final merge over the new one, and an interrupted retry keeps one record each
                with OutputFiles() as files:
                    for path in [self.out, *self._part_files()]:
                        if path.is_file():
                            held = read_records(path, key)
                            files.write_text(path, "".join(json.dumps(r) + "\n" for x, r in held.items() if x not in failed))
            self.process.wait()

    @property
    def settings_file(self) -> Path:
        """``OUT.settings.json``: the settings the rows of ``OUT`` were made with."""
        return self.out.with_name(self.out.name + ".settings.json")

    def _check_same_run(self, settings: dict[str, Any], input_fields: dict[str, dict[str, Any]]) -> None:
        """Refuse to resume rows made with other settings, or for other inputs under the same key
        (a prompts file edited since), in one line; record the settings for the next resume."""
        held = self.settings_file
        settings = {**settings, "cwd": os.getcwd()} if settings else settings  # (the rows' relative paths read from it)
        model = settings.get("model")
        if isinstance(model, str) and os.path.exists(os.path.expanduser(model)):  # ("./m" and "/abs/m": one model)
            settings["model"] = os.path.abspath(os.path.expanduser(model))
        if settings and self.done:  # (a run that failed before its first row left settings, no rows)
            try:
                before = json.loads(held.read_text())
            except (OSError, ValueError):
                before = None
            if not isinstance(before, dict):
                raise ValueError(f"{self.out} holds rows, but not the settings they were made with ({held.name} is missing "
                                 "or unreadable), so they cannot be resumed safely; choose another output (or delete it)")
            relative = next((x for x in self.done if not os.path.isabs(x)), None)
            if relative is not None and before.get("cwd", settings["cwd"]) != settings["cwd"]:
                raise ValueError(f"{self.out} holds rows of paths relative to {before['cwd']} ({relative!r}); run from "
                                 "there to resume (cd), or choose another output")
            shown = changed_settings(before, {k: v for k, v in settings.items() if k != "cwd"})
            if shown:
                raise ValueError(f"{self.out} holds rows made with other settings ({shown}); rerun with those to "
                                 "resume, or choose another output")
        for key, fields in input_fields.items():
            record = self.done.get(key)
            for name, value in fields.items():
                if record is not None and name in record and record[name] != value:
                    raise ValueError(f"{self.out}: row {key} was made for {name} {record[name]!r}, but that input is now "
                                     f"{value!r}; choose another output (or delete it)")
        if settings and self.process.rank == 0:
            write_text(held, json.dumps(settings, sort_keys=True) + "\n")

    def _part_files(self) -> list[Path]:
        """Every process's part of OUT (this run's and an interrupted earlier run's, any process count)."""
        return sorted(self.out.parent.glob(f"{glob.escape(self.out.name)}.rank-*-of-*"))

    def _parts(self) -> dict[str, dict[str, Any]]:
        records = {}
        for part in self._part_files():
            records.update(read_records(part, self.key))
        return records

    def made(self, records: list[dict[str, Any]]) -> tuple[int, int]:
        """Of ``records`` (:meth:`finish`'s), those this run made, every process's: (done, failed)."""
        pending = set(self.pending)
        mine = [r for r in records if r[self.key] in pending]
        failed = sum("error" in r for r in mine)
        return len(mine) - failed, failed

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed: a kill loses at most the line being written)."""
        try:
            if self._file is None:
                self._file = self.part.open("a")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as error:  # e.g. a full disk: the lines written so far stay (a rerun resumes)
            raise output_error(self.part, error) from None

    def finish(self) -> list[dict[str, Any]]:
        """Close this process's part, wait for the others; rank 0 writes ``out`` in input order, then
        the rows it held for inputs not given this time, as they were (an earlier run's), and
        removes the parts. Returns the records of this run's inputs, in input order."""
        if self._file is not None:
            self._file.close()
        self.process.wait()
        parts = self._parts()
        records = {**read_records(self.out, self.key), **parts}
        ordered = [records[x] for x in self.inputs if x in records]
        given = set(self.inputs)
        others = [r for x, r in records.items() if x not in given]  # an earlier run's other inputs: kept
        if self.process.rank == 0:  # input order (header failures were written first); parts of a killed run too
            with OutputFiles() as files:  # replaced whole, or kept as it was
                files.write_text(self.out, "".join(json.dumps(r) + "\n" for r in ordered + others))
            for part in self._part_files():
                part.unlink()
        self.process.wait()
        return ordered


def add_row_args(parser) -> None:
    """``--retry-errors``, for every command that writes rows."""
    parser.add_argument("--retry-errors", action="store_true",
                        help="redo only the rows of an existing output file that failed (their record has an \"error\"); "
                             "done rows are kept")


def failed_rows_exit(records: list[dict[str, Any]], where: str, retry: bool = True, show: bool = True,
                     process: "ProcessState | None" = None) -> int:
    """The exit rule of every command that writes rows (module doc): 0 when no record has an
    ``error``, else 2 after one summary line on stderr ("N of M rows failed; see their error field
    in WHERE", and how to redo them when ``retry``; ``show`` False: no line, as on the processes
    of a sharded run other than rank 0, which all exit 2 too). With a sharded run's ``process``
    every process returns only once rank 0 has printed its line: torchrun stops the other
    processes as soon as one exits non-zero, which could cut rank 0 off before its summary."""
    failed = sum("error" in r for r in records)
    if failed and show:
        redo = "; rerun with --retry-errors to redo only them" if retry else ""
        print(f"mmspec: {failed} of {words.count(len(records), 'row')} failed; see their error field in {where}{redo}", file=sys.stderr,
              flush=True)
    if process is not None:
        process.wait()
    return 2 if failed else 0


def count_rows(out: str | os.PathLike, key: str) -> tuple[int, int]:
    """(inputs with a complete record in ``out`` and its processes' parts, of which failed: their
    last record holds an ``error``) -- read only: what Ctrl-C left."""
    out = Path(out)
    done: dict[Any, bool] = {}
    for path in [out, *out.parent.glob(f"{glob.escape(out.name)}.rank-*-of-*")]:
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError:
            continue
        for line in data[: data.rfind(b"\n") + 1].decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
                done[record[key]] = "error" in record
            except (ValueError, KeyError, TypeError):
                continue
    return len(done), sum(done.values())


def interrupted_rows(out: str | os.PathLike, key: str, command: str) -> str:
    """What Ctrl-C left of a run that streams rows to ``out``, and how to resume it (one line)."""
    count, failed = count_rows(out, key)
    if not count:
        return f"no row was finished, nothing was saved; rerun the same command to start again: {command}"
    of_which = f" ({failed} of them failed)" if failed else ""
    if launched_processes() > 1:  # (the rows sit in the processes' parts until the run's end merges them)
        return (f"{count} finished row{'s are' if count != 1 else ' is'} saved in {out}'s per-process parts "
                f"({Path(out).name}.rank-*){of_which}; rerun the same launch (any process count, or {command} alone) to "
                "resume: the parts are merged then")
    return (f"{count} finished row{'s are' if count != 1 else ' is'} saved in {out}{of_which}; rerun the same command "
            f"to resume: {command}")


class Progress:
    """A progress bar on stderr (tqdm when installed, else "[i/n] item" lines) for more than one
    item, or always (``always``: dataset runs): items/s, and the running tokens/s and speedup
    over plain decoding (when baselines run); ``write`` prints without breaking the bar."""

    def __init__(self, total: int, always: bool = False, unit: str = "item", show: bool = True, initial: int = 0) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        self.total, self.done = total, initial  # initial: done before this run (a resumed one), not in its rate
        self.tokens = self.seconds = self.baseline_seconds = 0.0
        show = show and (total > 1 or always)
        self.bar = tqdm(total=total, initial=initial, file=sys.stderr, unit=unit, leave=False) if tqdm and show else None
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
