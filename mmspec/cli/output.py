"""The files a command writes (audio, images, JSON, tables), through one writer: all or nothing,
and a failure is one line naming the path.

Every command writes its output files inside one :class:`OutputFiles` block::

    with OutputFiles() as out:
        out.write("x.wav", lambda tmp: write_wav(tmp, audio, rate))
        out.write("x.png", lambda tmp: figure.savefig(tmp))
    # both files are in place here, or neither is

Each file is written to a hidden temporary file beside its path (same folder, same suffix, so a
writer that picks the format from the name still does), and the block moves them all into place
when it ends without an error. When a write fails (a folder that cannot hold files, such as
``/proc``, where the permission check passes as root; a full disk; a codec error), or anything
else raises in the block (a failed run, Ctrl-C), the temporary files are removed: no partial
output is left, and an old file at the path is kept as it was. A failure to open or write is an
:class:`OutputError` (a ValueError: ``mmspec: error: cannot write PATH: reason``, exit 2).

Streamed JSONL results (:mod:`mmspec.cli.dataset`) append line by line instead, so that a killed
run keeps what it finished; their opening and writing fail the same way (:func:`output_error`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

#: what a writer raises when it cannot open or write its file (soundfile: a RuntimeError; PIL and
#: matplotlib: an OSError, or a ValueError for a suffix they have no format for)
WRITE_ERRORS = (OSError, RuntimeError, ValueError)


class OutputError(ValueError):
    """An output file could not be opened or written (one line naming the path)."""


def output_error(path: str | os.PathLike, error: BaseException, written: str | os.PathLike | None = None) -> OutputError:
    """``error`` from writing ``path`` (through the temporary file ``written``) -> the one line:
    "cannot write PATH: reason" (the reason names ``path``, not the temporary file)."""
    if isinstance(error, OutputError):
        return error
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    if reason.strip(" .").lower() == "system error":  # libsndfile's word for a failed write
        reason = "the system refused the write (a full disk, or a file over the size limit?)"
    if written is not None:
        reason = reason.replace(str(written), str(path))
    reason = " ".join(reason.split()) or type(error).__name__
    return OutputError(f"cannot write {path}: {reason}")


def check_writable_path(path: Path) -> None:
    """Refuse a path that exists but is not a regular file (a folder, a device such as /dev/full,
    a pipe): replacing it with a file is never what was meant."""
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise OutputError(f"cannot write {path}: it is not a regular file (a device or a pipe); give a file name")


class OutputFiles:
    """A command's output files, written all together or not at all (module doc).

    Attributes:
        written: the paths moved into place so far (after the block: every file, in order).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary file, path)
        self.written: list[Path] = []

    def write(self, path: str | os.PathLike, writer: Callable[[Path], Any]) -> Path:
        """Have ``writer`` write the file ``path`` (it is given the temporary path to write);
        missing parent folders are created. Returns ``path``.

        Raises:
            OutputError: the folder or the file cannot be made, or ``writer`` fails to open or
                write it (an OSError, a RuntimeError such as soundfile's, a ValueError).
        """
        path = Path(path)
        check_writable_path(path)
        temporary = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise output_error(path, error) from None
        self._pending.append((temporary, path))
        try:
            writer(temporary)
        except WRITE_ERRORS as error:
            raise output_error(path, error, temporary) from None
        if not temporary.is_file():
            raise OutputError(f"cannot write {path}: nothing was written")
        return path

    def write_text(self, path: str | os.PathLike, text: str) -> Path:
        """Write ``text`` (UTF-8) as the file ``path``."""
        return self.write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))

    def write_json(self, path: str | os.PathLike, value: Any, indent: int | None = 1) -> Path:
        """Write ``value`` as JSON (with a final newline) as the file ``path``."""
        return self.write_text(path, json.dumps(value, indent=indent) + "\n")

    def commit(self) -> None:
        """Move every written file into place (the block's end does it)."""
        try:
            for temporary, path in self._pending:
                try:
                    temporary.replace(path)
                except OSError as error:
                    raise output_error(path, error, temporary) from None
                self.written.append(path)
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the temporary files not moved into place."""
        for temporary, _ in self._pending:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:  # a folder that could not hold it in the first place
                pass
        self._pending = []

    def __enter__(self) -> "OutputFiles":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        else:  # any error, Ctrl-C included: no partial output
            self.discard()


#: the locks this process holds (path -> its open file): held until the process ends
_HELD: dict[str, Any] = {}


def hold_lock(path: str | os.PathLike, what: str) -> None:
    """An exclusive lock on the file ``path`` (made if absent), held by this process until it ends
    (however it ends): another process writing ``what`` at the same time is refused in one line
    (two runs appending to one results file lost rows; two trainings into one folder crashed on
    the other's checkpoint). This process may take it again (a command run twice in one process).
    Where locks are not available (no fcntl, a file system without them) nothing is locked."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        return
    key = os.path.realpath(path)
    if key in _HELD:
        return
    try:
        handle = open(path, "a+")
    except OSError as error:
        raise output_error(path, error) from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip()
        handle.close()
        raise ValueError(f"another mmspec run{f' (pid {owner})' if owner.isdigit() else ''} is writing {what}; wait for it "
                         "to finish, or choose another output") from None
    except OSError:  # (a file system without locks)
        handle.close()
        return
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    if not _HELD:
        import atexit

        atexit.register(lambda: [held.close() for held in _HELD.values()])  # (released at exit, the files closed)
    _HELD[key] = handle


def write_output(path: str | os.PathLike, writer: Callable[[Path], Any]) -> Path:
    """One output file through :class:`OutputFiles` (all or nothing, a failure names ``path``)."""
    with OutputFiles() as out:
        out.write(path, writer)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """One text file (UTF-8) through :class:`OutputFiles` (all or nothing, a failure names ``path``)."""
    with OutputFiles() as out:
        out.write_text(path, text)
    return Path(path)


def difference_note(sampled: bool, half_precision: bool) -> str | None:
    """Why an output differs from plain decoding's in the same run, where that is expected: under
    sampling the draws differ (the distribution is kept); in half precision a forward over several
    tokens rounds differently from one-token forwards. None otherwise (a difference to look at)."""
    if sampled:
        return "(sampling: speculative sampling keeps plain decoding's distribution, not its random draws)"
    if half_precision:
        return ("(half precision rounds a forward over several tokens differently from one-token forwards, "
                "so near-ties can flip; --dtype fp32 gives token-identical output, see docs/usage.md)")
    return None


def speedup_words(stats: Any, baseline: Any) -> str:
    """``speedup 1.95x`` for a run compared with plain decoding (``stats.speedup``: the baseline's
    wall time over this one's); when the two outputs differ in length (sampling, or an EOS one of
    them reached) the wall-time ratio compares different amounts of work, so the per-token ratio
    follows: ``speedup 2.03x in time, 0.97x per token (11 and 23 tokens)``."""
    words = f"speedup {stats.speedup:.2f}x"
    if stats.new_tokens != baseline.new_tokens and stats.new_tokens and baseline.new_tokens and stats.wall_time_s:
        per_token = (baseline.wall_time_s / baseline.new_tokens) / (stats.wall_time_s / stats.new_tokens)
        words += f" in time, {per_token:.2f}x per token ({stats.new_tokens} and {baseline.new_tokens} tokens)"
    return words
