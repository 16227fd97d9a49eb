"""The ``mmspec`` command. Each subcommand lives in its own module (:data:`COMMANDS`), which provides
``add_parser(subparsers)`` (registering a parser whose ``handler`` default is its ``run(args)``); a
command's module, and PyTorch, load only when that command runs or shows its help."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import threading
import warnings
from contextlib import contextmanager

from .. import in_package


#: each command, in the order of ``mmspec --help``: the module that defines it and its one-line help
#: (its module's parser takes the help from here, so ``mmspec --help`` lists every command without
#: importing any module, or PyTorch: :func:`build_parser`)
COMMANDS = {
    "generate": ("mmspec.cli.generate", "generate text from a prompt with a drafter, and show the speed"),
    "caption": ("mmspec.cli.caption", "caption images (or ask about them) with a drafter, and show the speed"),
    "t2i": ("mmspec.cli.t2i", "generate images from a text prompt with an AR image-token model"),
    "tts": ("mmspec.cli.tts", "say a sentence with a codec-token TTS model, and show the speed"),
    "run": ("mmspec.cli.run", "a ready-made pipeline from pipelines/ (a preset) on images, prompts or sentences"),
    "bench": ("mmspec.bench.cli", "benchmarks, measured side by side (see docs/benchmarks.md)"),
    "train": ("mmspec.train.cli", "training recipes for the embedded models (resumable)"),
    "export": ("mmspec.cli.export", "write a trained drafter in a serving engine's format"),
    "serve": ("mmspec.serve.cli", "serve captioning, text-to-image and text-to-speech over an OpenAI-compatible HTTP "
                                  "API, batching concurrent requests"),
}


def command_help(name: str) -> str:
    """Command ``name``'s one-line help (:data:`COMMANDS`), for its module's ``add_parser``."""
    return COMMANDS[name][1]


def _no_default(action: argparse.Action) -> bool:
    """An option whose default its help need not state: unset, suppressed, or an on / off flag (a
    ``--no-x`` flag's True default would read as "no x"); 0 is a default."""
    value = action.default
    return value is None or value == argparse.SUPPRESS or (action.nargs == 0 and isinstance(value, bool))


class OneLineParser(argparse.ArgumentParser):
    """argparse with a misspelt flag or a bad value as one line (``mmspec: error: ...``, exit 2),
    pointing at the command's ``--help``, instead of the usage block first; subcommands' parsers
    are of this class too (argparse makes them of the parent's class). Options are not abbreviated
    (``--batch-size`` was taken as ``bench caption --batch-sizes``, ``t2i --prompt`` as
    ``--prompts``), and every help says its default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        """argparse's, the option's default appended to its help where the help names none."""
        action = super().add_argument(*args, **kwargs)
        text = action.help or ""
        if action.option_strings and not _no_default(action) and text != argparse.SUPPRESS and "default" not in text:
            action.help = f"{text} (default: %(default)s)".lstrip()
        return action

    def error(self, message: str):
        self.exit(2, f"mmspec: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The ``mmspec`` parser with every command's own arguments (``command="*"``), or with only
    ``command``'s, the others named with their help alone (:func:`main` builds the one it runs:
    ``mmspec --help`` and ``--version`` import no command's module, so no PyTorch until a command runs)."""
    parser = OneLineParser(
        prog="mmspec",
        description="Fast autoregressive multimodal generation with speculative decoding.",
    )
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        if command in ("*", name):
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=text)
    return parser


class VersionAction(argparse.Action):
    """``--version``: :func:`version_line`, made when asked (it imports PyTorch for its version)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show mmspec's, Python's and PyTorch's versions and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line())  # (to standard output, as argparse's own version action prints)
        parser.exit()


def version_line() -> str:
    """``mmspec --version``: mmspec's version and the Python and torch it runs on."""
    import platform

    import torch

    from .. import __version__
    return f"mmspec {__version__} (Python {platform.python_version()}, torch {torch.__version__})"


def one_line_warnings(show):
    """A ``warnings.showwarning`` for a command: mmspec's own UserWarnings (a prompt cut to what a
    model reads, a budget that does not fit) as one line ``mmspec: warning: ...``; other warnings
    through ``show`` (Python's own)."""
    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, UserWarning) and in_package(filename):  # (mmspec's advice to the user)
            print(f"mmspec: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


#: the exit status after Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED = 130
#: the exit status after SIGTERM (128 + SIGTERM): ``timeout``, ``kill``, a job scheduler
TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command, raised where the command is, so what cleans up after Ctrl-C (a
    ``--stream`` run's ``.part`` file, a training run's note) runs for it too."""


@contextmanager
def signals_noted(seen: list[int]):
    """While the block runs (in the main thread only: Python delivers signals there), SIGTERM
    raises :class:`Terminated` and SIGINT ``KeyboardInterrupt``, each noted in ``seen``: a library
    that turns the interrupt into another error (transformers' lazy imports, interrupted while
    numpy loads, raise ModuleNotFoundError) is still known as an interrupt. The previous handlers
    come back afterwards. A signal the process was told to ignore stays ignored (a shell without job
    control starts `mmspec ... &` with SIGINT ignored, so that Ctrl-C meant for the script that
    started it does not end it; Python keeps such a SIGINT ignored too)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        seen.append(signum)
        raise Terminated()

    def interrupt(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt()

    ours = {signal.SIGTERM: terminate, signal.SIGINT: interrupt}
    # (None: a handler installed outside Python, which could not be put back: left as it is)
    replaced = {signum: handler for signum in ours if (handler := signal.getsignal(signum)) not in (signal.SIG_IGN, None)}
    for signum in replaced:
        signal.signal(signum, ours[signum])
    try:
        yield
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Run one ``mmspec`` command; returns its exit status.

    0: done. 2: a user error (a bad argument, a file that cannot be read or written, rows that
    failed): one line ``mmspec: error: ...`` on stderr, no traceback. 130: interrupted (Ctrl-C),
    143: terminated (SIGTERM): one line saying what was saved and how to resume (the subcommand's
    ``interrupted(args, command)`` default; "nothing was saved" without one), from the first
    moment (PyTorch and transformers load inside).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    seen: list[int] = []
    args = None
    try:
        with warnings.catch_warnings(), signals_noted(seen):  # (both undone afterwards: tests run commands in-process)
            parser = build_parser(next((word for word in argv if not word.startswith("-")), None))
            from .args import apply_threads, check_args

            args, unknown = parser.parse_known_args(argv)
            if unknown:  # named by the subcommand whose --help lists the right ones
                where = " ".join(a for a in ("mmspec", args.command, getattr(args, "suite", None),
                                             getattr(args, "recipe", None)) if isinstance(a, str))
                parser.exit(2, f"mmspec: error: unrecognized arguments: {' '.join(unknown)} (see {where} --help)\n")
            handler = getattr(args, "handler", None)
            if handler is None:
                parser.parse_args([*argv, "--help"])
                return 0
            warnings.showwarning = one_line_warnings(warnings.showwarning)
            check_args(args)  # device, counts, output paths: before any model loads
            apply_threads(args)
            return handler(args)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        first = int(os.environ.get("RANK", "0")) == 0  # (under a launcher every process gets the same line: the first says it)
        if seen or isinstance(error, KeyboardInterrupt):
            terminated = signal.SIGTERM in seen or isinstance(error, Terminated)
            if first:
                note = interrupted_note(args, argv) if args is not None else "nothing was saved"
                print(f"mmspec: {'terminated' if terminated else 'interrupted'}; {note}", file=sys.stderr)
            return TERMINATED if terminated else INTERRUPTED
        from ..hub import MissingDependencyError

        if isinstance(error, (ValueError, OSError, MissingDependencyError)):
            # user errors (bad arguments, files or model ids that cannot be found or written): one line, no traceback
            if first:
                print(f"mmspec: error: {error}", file=sys.stderr)
            return 2
        raise


def interrupted_note(args: argparse.Namespace, argv: list[str]) -> str:
    """What an interrupted command saved and how to resume it, from the subcommand's
    ``interrupted(args, command)`` (``command``: the command line to rerun)."""
    note = getattr(args, "interrupted", None)
    if note is None:
        return "nothing was saved"
    try:
        return note(args, "mmspec " + shlex.join(argv))
    except Exception as error:  # reading what was saved failed: say so, never a traceback here
        return f"could not tell what was saved ({error})"


if __name__ == "__main__":
    sys.exit(main())
