"""``mmspec train open-text``: the SmolLM2-written part of the embedded voice's open-domain text
(:func:`mmspec.train.data.open_text.generate_smollm2`), appended to
``mmspec/train/data/open_text_smollm2.txt`` (or ``--out``). Resumable: rerun the same command."""

from __future__ import annotations

from pathlib import Path

from .data.open_text import SMOLLM2_TEXT, generate_smollm2


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=str(SMOLLM2_TEXT), help="the text file (one sentence per line after a header)")
    parser.add_argument("--count", type=int, default=4000, help="distinct sentences to reach")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args) -> None:
    if args.count < 1 or args.batch_size < 1:
        raise ValueError(f"--count and --batch-size must be at least 1, got {args.count} and {args.batch_size}")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    held = generate_smollm2(args.count, Path(args.out), batch_size=args.batch_size, seed=args.seed)
    print(f"open-text: {held} sentences in {args.out}")
