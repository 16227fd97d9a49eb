"""``mmspec train caption-data``: images + prompts for a captioner's drafter, as a ``--data`` JSONL.

Writes ``OUT/images/GROUP-INDEX.png`` and ``OUT/data.jsonl``, one ``{"image", "prompt", "group"}``
a line (no response: ``mmspec train drafter`` has the captioner write its own answers). Groups:

* the six caption families (:data:`mmspec.train.data.FAMILIES`), each image made at a size drawn
  from ``--sizes`` and, with probability ``--crop``, cropped to 55-100 % of its side at a random
  place and scaled back; the family's own prompt, except that short-answer questions (1-3 token
  answers: nothing for a drafter to learn) get a caption or detailed-description prompt instead;
* the renders the family generator never makes (:mod:`mmspec.train.data.renders`: abstract,
  patterns, documents, plots, collage).

Rows are interleaved over the groups (row i is group i mod G), so the file's first rows cover
every group. ``--split`` picks the seed stream (the families' splits are disjoint by content;
the renders' by seed): build the drafter's data from ``train`` and the benchmark's from ``test``.
Groups can then be held out of a head's training with ``mmspec train drafter --hold-out-groups``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from .data import FAMILIES, SPLITS, make_sample
from .data.core import CAPTION_PROMPTS, DETAILED_PROMPTS, parse_names, stable_hash
from .data.renders import RENDERS, make_render
from ..core import words

GROUPS = (*FAMILIES, *RENDERS)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/caption-data", help="folder for images/ and data.jsonl")
    parser.add_argument("--per-group", type=int, default=200, help="rows per group")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--sizes", default="64,96,128,160,224", help="image sides to draw from (pixels)")
    parser.add_argument("--crop", type=float, default=0.5, help="share of family images cropped and rescaled")


def row_rng(group: str, split: str, index: int) -> np.random.Generator:
    """The seeded stream of one row's choices (its size first)."""
    return np.random.default_rng(stable_hash(f"caption-data/{group}/{split}/{index}"))


def family_row(family: str, split: str, index: int, sizes: list[int], crop: float) -> tuple[Image.Image, str]:
    """A family's sample at a drawn size, maybe cropped -> (image, prompt)."""
    rng = row_rng(family, split, index)
    size = int(rng.choice(sizes))
    sample = make_sample(family, split, index, size=size)
    image = sample.image
    if rng.random() < crop:
        side = max(16, int(size * rng.uniform(0.55, 1.0)))
        x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
        image = image.crop((x, y, x + side, y + side)).resize((size, size), Image.BICUBIC)
    prompt = sample.prompt
    if sample.kind == "short":
        prompt = str(rng.choice(DETAILED_PROMPTS if rng.random() < 0.3 else CAPTION_PROMPTS))
    return image, prompt


def run(args) -> int:
    groups = parse_names(args.groups, GROUPS, "--groups")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes: give comma-separated pixel sides, e.g. 64,128,224 (got {args.sizes!r})") from None
    if not sizes or min(sizes) < 16:
        raise ValueError(f"--sizes: every side must be at least 16 pixels (got {args.sizes!r})")
    if args.per_group < 1:
        raise ValueError(f"--per-group must be at least 1, got {args.per_group}")
    if not 0 <= args.crop <= 1:
        raise ValueError(f"--crop is a share in [0, 1], got {args.crop}")
    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(args.per_group):
        for group in groups:
            name = f"images/{group}-{index:05d}.png"
            if group in RENDERS:
                image, prompt = make_render(group, args.split, index, size=int(row_rng(group, args.split, index).choice(sizes)))
            else:
                image, prompt = family_row(group, args.split, index, sizes, args.crop)
            image.save(out / name)
            lines.append(json.dumps({"image": name, "prompt": prompt, "group": group}))
    (out / "data.jsonl").write_text("\n".join(lines) + "\n")
    print(f"caption-data: {words.count(len(lines), 'row')} ({args.per_group} per group: {', '.join(groups)}) in {out / 'data.jsonl'}")
    return 0
