"""``mmspec train open-text``: the SmolLM2-written part of the embedded voice's open-domain text
(:func:`mmspec.train.data.open_text.generate_smollm2`), appended to
``mmspec/train/data/open_text_smollm2.txt`` for seed 0, ``open_text_smollm2-seedN.txt`` beside it
for seed N (the ``smollm2-more`` source), or ``--out``. Resumable: rerun the same command; run
one seed per core."""

from __future__ import annotations

from pathlib import Path

from .data.open_text import generate_smollm2, smollm2_text


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="the text file (one sentence per line after a header; default: "
                        "mmspec/train/data/open_text_smollm2.txt for seed 0, open_text_smollm2-seedN.txt beside it for seed N)")
    parser.add_argument("--count", type=int, default=4000, help="distinct sentences to reach")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args) -> None:
    out = Path(args.out) if args.out else smollm2_text(args.seed)
    held = generate_smollm2(args.count, out, batch_size=args.batch_size, seed=args.seed)
    print(f"open-text: {held} sentences in {out}")
