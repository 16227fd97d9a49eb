"""``counting`` family (MMT-Bench-like counting): N copies of shapes, possibly mixed.

Three modes: one shape in one colour (1-10 copies), one shape in several colours, and a
mixture of 2-3 shapes.  Objects never touch (at least 4 units apart on a plain background),
so the number of connected blobs in the image equals the number of objects.

Content key: the background and the multiset of (shape, colour, count) groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .core import QA, Content, capitalize, draw_for_split, join_words, number_word, pick, sentence, yes_no
from .render import BACKGROUNDS, COLORS, SHAPES, Canvas, draw_shape, jitter, place_disks, plural, shade


@dataclass(frozen=True)
class Group:
    shape: str
    color: str
    count: int

    def phrase(self, with_color: bool = True) -> str:
        """``"three red stars"``, ``"one circle"``."""
        noun = self.shape if self.count == 1 else plural(self.shape)
        return f"{number_word(self.count)} {self.color + ' ' if with_color else ''}{noun}"


def _draw_spec(rng: np.random.Generator) -> tuple[str, tuple[str, str, list[Group]]]:
    background = pick(rng, list(BACKGROUNDS))
    mode = pick(rng, ["single", "single", "colors", "mixed"])
    if mode == "single":
        groups = [Group(pick(rng, SHAPES), pick(rng, list(COLORS)), int(rng.integers(1, 11)))]
    else:
        k = int(rng.integers(2, 4))
        colors = [str(c) for c in rng.choice(list(COLORS), size=k, replace=False)]
        if mode == "colors":
            shapes = [pick(rng, SHAPES)] * k
        else:
            shapes = [str(s) for s in rng.choice(SHAPES, size=k, replace=False)]
        counts = rng.integers(1, 6 if mode == "colors" else 5, size=k)
        groups = [Group(s, c, int(n)) for s, c, n in zip(shapes, colors, counts)]
    key = "counting|" + background + "|" + ";".join(sorted(f"{g.shape}:{g.color}:{g.count}" for g in groups))
    return key, (background, mode, groups)


def _number_distractors(n: int) -> list[str]:
    return [str(k) for k in range(max(0, n - 2), n + 3) if k != n]


def _questions(rng: np.random.Generator, mode: str, groups: list[Group]) -> list[QA]:
    total = sum(g.count for g in groups)
    by_shape = Counter()
    by_color = Counter()
    for g in groups:
        by_shape[g.shape] += g.count
        by_color[g.color] += g.count
    qas = [QA(pick(rng, ["How many shapes are there in total?", "How many objects are there?",
                         "How many shapes are in the image?"]), str(total),
              _number_distractors(total), "counting.total")]
    for shape, n in by_shape.items():
        qas.append(QA(f"How many {plural(shape)} are there?", str(n), _number_distractors(n), "counting.shape"))
    if rng.random() < 0.25:  # occasionally ask about a shape that is not there
        absent = pick(rng, [s for s in SHAPES if s not in by_shape])
        qas.append(QA(f"How many {plural(absent)} are there?", "0", ["1", "2", "3"], "counting.shape"))
    if len(groups) > 1:
        for g in groups:
            noun = plural(g.shape) if mode == "colors" else "shapes"
            n = by_color[g.color]
            qas.append(QA(f"How many {g.color} {noun} are there?", str(n), _number_distractors(n),
                          "counting.color"))
        a, b = rng.choice(len(groups), size=2, replace=False)
        ga, gb = groups[int(a)], groups[int(b)]
        if ga.count != gb.count:
            name = (lambda g: f"{g.color} {plural(g.shape)}") if mode == "colors" else (lambda g: plural(g.shape))
            qas.append(yes_no(f"Are there more {name(ga)} than {name(gb)}?", ga.count > gb.count, "counting.compare"))
        counts = sorted((g.count for g in groups), reverse=True)
        if mode == "mixed" and counts[0] > counts[1]:
            top = max(groups, key=lambda g: g.count)
            qas.append(QA("Which shape appears most often?", capitalize(plural(top.shape)),
                          [capitalize(plural(g.shape)) for g in groups if g is not top], "counting.most"))
    return qas


def _captions(mode: str, groups: list[Group], background: str) -> list[str]:
    total = sum(g.count for g in groups)
    listed = join_words([g.phrase() for g in groups])
    caps = [f"{listed} on a {background} background.", f"A picture of {listed}."]
    if mode == "single":
        g = groups[0]
        if g.count > 1:
            caps.append(f"A group of {g.phrase()} scattered on a {background} background.")
    elif mode == "colors":
        shape = plural(groups[0].shape)
        parts = join_words([f"{number_word(g.count)} {g.color}" for g in groups])
        caps.append(f"{number_word(total)} {shape}: {parts}.")
    else:
        caps.append(f"{number_word(total)} shapes: {listed}.")
    return [sentence(c) for c in caps]


def _detailed(groups: list[Group], background: str) -> str:
    total = sum(g.count for g in groups)
    listed = join_words([g.phrase() for g in groups])
    verb = "placed" if total == 1 else "scattered"
    text = f"The image shows {listed} {verb} on a plain {background} background."
    if len(groups) > 1:
        text += f" In total there are {total} shapes, and none of them overlap."
    elif total > 1:
        text += f" All {total} shapes have the same form and color, and none of them overlap."
    return text


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One ``counting`` image; ``meta["groups"]`` lists what was drawn."""
    key, (background, mode, groups) = draw_for_split(rng, split, _draw_spec)
    total = sum(g.count for g in groups)
    r = float(rng.uniform(12, 14) if total <= 4 else rng.uniform(9.5, 11) if total <= 7 else rng.uniform(7.5, 8.5))
    objects = [g for g in groups for _ in range(g.count)]
    order = rng.permutation(len(objects))
    centres = None
    while centres is None:
        centres = place_disks(rng, [r] * total, gap=4.0, margin=3.0)

    canvas = Canvas(size, jitter(rng, BACKGROUNDS[background], 6))
    outlined = rng.random() < 0.3
    for i, (x, y) in zip(order, centres):
        g = objects[int(i)]
        fill = jitter(rng, COLORS[g.color], 10)
        draw_shape(canvas, g.shape, x, y, r, fill, shade(fill, 0.6) if outlined else None, 1.0)

    meta = {"key": key, "background": background, "mode": mode, "total": total,
            "groups": [{"shape": g.shape, "color": g.color, "count": g.count} for g in groups]}
    return Content(canvas.finish(), _captions(mode, groups, background), _detailed(groups, background),
                   _questions(rng, mode, groups), meta=meta)
