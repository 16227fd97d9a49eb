"""The ``mmspec`` command."""

from __future__ import annotations

import argparse
import json
import sys

from .hub import MissingDependencyError


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="built-in name (smollm2), local path or hub id (default: smollm2)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16) | bf16 | fp32 | fp16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmspec",
        description="Fast autoregressive multimodal generation with speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from a prompt with a drafter, and show the speed")
    gen.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    gen.add_argument("--drafter", default="prompt-lookup", help="ar | prompt-lookup[:K] | layer-skip:N | a draft model path")
    gen.add_argument("--num-draft-tokens", type=int, default=None, help="K (default: the drafter's own)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")
    gen.add_argument("--compare-baseline", action="store_true", help="also run plain AR decoding and report the speedup")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    _add_model_args(gen)
    _add_sampling_args(gen)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="suite", metavar="SUITE")
    text = bench_sub.add_parser("text", help="SmolLM2 text: AR vs training-free drafters vs transformers' own options")
    from .bench.text import add_arguments

    add_arguments(text)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "generate":
            from .textgen import run_generate_command

            return run_generate_command(args)
        if args.command == "bench":
            if args.suite == "text":
                from .bench.text import run

                return run(args)
            parser.parse_args(["bench", "--help"])
    except (ValueError, FileNotFoundError, MissingDependencyError) as error:
        print(f"mmspec: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
