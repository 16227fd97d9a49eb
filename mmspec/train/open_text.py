"""``mmspec train open-text``: the SmolLM2-written part of the embedded voice's open-domain text
(:func:`mmspec.train.data.open_text.generate_smollm2`), appended to ``--out`` (default
``runs/open-text/open_text_smollm2.txt`` for seed 0, ``runs/open-text/open_text_smollm2-seedN.txt``
for seed N). The package's own files, which the ``smollm2`` (seed 0) and ``smollm2-more`` (seeds
1 and up) sources read, are written only with ``--package``: they are shipped data, and changing
them changes those sources (and ``mmspec bench tts --text open``'s sentences) on this install.
Resumable: rerun the same command; run one seed per core."""

from __future__ import annotations

from pathlib import Path

from .data.open_text import SEED_TEXT, SMOLLM2_TEXT, generate_smollm2, smollm2_text
from ..core import words

#: where a run without --out or --package writes (under the working directory)
DEFAULT_DIR = Path("runs/open-text")


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help=f"the text file (one sentence per line after a header; default: "
                        f"{DEFAULT_DIR / SMOLLM2_TEXT.name} for seed 0, {DEFAULT_DIR / SEED_TEXT.format('N')} for seed N)")
    parser.add_argument("--package", action="store_true",
                        help=f"append to the package's own file instead (mmspec/train/data/{SMOLLM2_TEXT.name} for seed "
                             f"0, {SEED_TEXT.format('N')} beside it for seed N): the files the smollm2 and smollm2-more "
                             "sources read, so this changes them (and bench tts --text open) on this install")
    parser.add_argument("--count", type=int, default=4000, help="distinct sentences to reach")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def output_file(args) -> Path:
    """The file this run appends to: ``--out``, the package's own file with ``--package``, else
    one under :data:`DEFAULT_DIR`. Raises one ValueError line for both ``--out`` and ``--package``."""
    if args.package and args.out:
        raise ValueError(f"--out {args.out} and --package name two files; give one (--package: "
                         f"{smollm2_text(args.seed)})")
    if args.package:
        return smollm2_text(args.seed)
    if args.out:
        return Path(args.out)
    return DEFAULT_DIR / smollm2_text(args.seed).name


def run(args) -> None:
    from ..cli.args import check_output_path

    out = output_file(args)
    check_output_path(str(out), "file", "--out")  # (the default and --package too: before SmolLM2 loads)
    args.out = str(out)  # (what an interrupted run names)
    out.parent.mkdir(parents=True, exist_ok=True)
    held = generate_smollm2(args.count, out, batch_size=args.batch_size, seed=args.seed)
    print(f"open-text: {words.count(held, 'sentence')} in {out}")
