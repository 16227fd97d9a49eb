"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)


def add_model_args(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    shown = default_model or "the embedded default"
    parser.add_argument("--model", default=default_model, help=f"built-in name, local path or hub id (default: {shown})")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where fast: GPU, CPU with AMX; else fp32) | bf16 | fp32 | fp16")
