"""The ``mmspec`` command. Each subcommand lives in its own module, which provides
``add_parser(subparsers)`` (registering a parser whose ``handler`` default is its ``run(args)``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..hub import MissingDependencyError
from .args import check_args

#: modules that define a subcommand, in the order of ``mmspec --help``
SUBCOMMAND_MODULES = ("mmspec.cli.generate", "mmspec.cli.caption", "mmspec.cli.t2i", "mmspec.cli.tts", "mmspec.cli.run", "mmspec.bench.cli", "mmspec.train.cli", "mmspec.serve.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmspec",
        description="Fast autoregressive multimodal generation with speculative decoding.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.parse_args([*(argv or sys.argv[1:]), "--help"])
        return 0
    try:
        check_args(args)  # device, counts, output paths: before any model loads
        return handler(args)
    except (ValueError, OSError, MissingDependencyError) as error:
        # user errors (bad arguments, files or model ids that cannot be found): one line, no traceback
        print(f"mmspec: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
