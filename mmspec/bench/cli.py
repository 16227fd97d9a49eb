"""``mmspec bench SUITE``."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks, measured side by side (see docs/benchmarks.md)")
    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    from . import text

    text_parser = suites.add_parser("text", help="a causal LM (SmolLM2): AR vs training-free drafters vs transformers' options")
    text.add_arguments(text_parser)
    text_parser.set_defaults(handler=text.run)
