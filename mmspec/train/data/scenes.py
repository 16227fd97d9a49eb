"""``scenes`` family (SEED-Bench-like): 1-4 coloured shapes, their attributes and relations.

Content key: the background and the multiset of (size, colour, shape) objects, so an object
combination owned by the test split is never drawn for training (positions are then free).
Within a scene every (colour, shape) pair is unique, so "the red circle" always refers to
exactly one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core import (QA, Content, article, capitalize, draw_for_split, join_words, number_word, pick, sentence,
                   yes_no)
from .render import BACKGROUNDS, COLORS, SHAPES, Canvas, UNITS, draw_shape, jitter, place_disks, shade

SIZES = {"small": 9.0, "medium": 14.0, "large": 21.0}  # radius in units
_CLEAR = 10.0  # minimum offset (units) for a spatial relation to count as clear


@dataclass
class SceneObject:
    shape: str
    color: str
    size: str
    x: float = 0.0
    y: float = 0.0

    @property
    def name(self) -> str:
        """``"red circle"``: unique within a scene."""
        return f"{self.color} {self.shape}"

    @property
    def full_name(self) -> str:
        return f"{self.size} {self.color} {self.shape}"


def relation(a: SceneObject, b: SceneObject) -> str | None:
    """The dominant clear spatial relation of ``a`` to ``b`` ("to the left of", "above", ...)."""
    dx, dy = b.x - a.x, b.y - a.y
    if abs(dx) >= 1.5 * abs(dy) and abs(dx) > _CLEAR:
        return "to the left of" if dx > 0 else "to the right of"
    if abs(dy) >= 1.5 * abs(dx) and abs(dy) > _CLEAR:
        return "above" if dy > 0 else "below"
    return None


_OPPOSITE = {"to the left of": "to the right of", "to the right of": "to the left of",
             "above": "below", "below": "above"}


def holds(rel: str, a: SceneObject, b: SceneObject) -> bool | None:
    """Whether ``a rel b`` clearly holds (True), clearly fails (False) or is unclear (None)."""
    d = {"to the left of": b.x - a.x, "to the right of": a.x - b.x,
         "above": b.y - a.y, "below": a.y - b.y}[rel]
    if d > _CLEAR:
        return True
    if d < -_CLEAR:
        return False
    return None


def position_phrase(x: float, y: float) -> str | None:
    """"at the top left", "in the center", ... or ``None`` near a region border."""
    def third(v: float, names: tuple[str, str, str]) -> str | None:
        edges = (UNITS / 3, 2 * UNITS / 3)
        if v < edges[0] - 5:
            return names[0]
        if edges[0] + 5 < v < edges[1] - 5:
            return names[1]
        if v > edges[1] + 5:
            return names[2]
        return None

    col, row = third(x, ("left", "center", "right")), third(y, ("top", "middle", "bottom"))
    if col is None or row is None:
        return None
    if row == "middle":
        return "in the center" if col == "center" else f"on the {col}"
    return f"at the {row}" if col == "center" else f"at the {row} {col}"


ALL_POSITIONS = ("at the top left", "at the top", "at the top right", "on the left", "in the center",
                 "on the right", "at the bottom left", "at the bottom", "at the bottom right")


def _draw_spec(rng: np.random.Generator) -> tuple[str, tuple[str, list[SceneObject]]]:
    n = int(rng.integers(1, 5))
    background = pick(rng, list(BACKGROUNDS))
    pairs: set[tuple[str, str]] = set()
    objects = []
    while len(objects) < n:
        color, shape = pick(rng, list(COLORS)), pick(rng, SHAPES)
        if (color, shape) not in pairs:
            pairs.add((color, shape))
            objects.append(SceneObject(shape, color, pick(rng, list(SIZES))))
    key = "scenes|" + background + "|" + ";".join(sorted(o.full_name for o in objects))
    return key, (background, objects)


def _questions(rng: np.random.Generator, objects: list[SceneObject]) -> list[QA]:
    """All questions answerable unambiguously for this scene."""
    n = len(objects)
    qas = [QA(pick(rng, ["How many shapes are there?", "How many objects are in the image?"]),
              str(n), [str(k) for k in range(max(1, n - 2), n + 3) if k != n], "scenes.count")]
    shape_counts = {s: sum(o.shape == s for o in objects) for s in SHAPES}
    color_counts = {c: sum(o.color == c for o in objects) for c in COLORS}
    other_colors = lambda c: [capitalize(x) for x in COLORS if x != c]  # noqa: E731
    for o in objects:
        if shape_counts[o.shape] == 1:
            qas.append(QA(f"What color is the {o.shape}?", capitalize(o.color), other_colors(o.color),
                          "scenes.color"))
        if color_counts[o.color] == 1:
            qas.append(QA(f"What shape is the {o.color} object?", capitalize(o.shape),
                          [capitalize(s) for s in SHAPES if s != o.shape], "scenes.shape"))
        if n > 1 and len({p.size for p in objects}) > 1:
            qas.append(QA(f"What size is the {o.name}?", capitalize(o.size),
                          [capitalize(s) for s in SIZES if s != o.size], "scenes.size"))
        where = position_phrase(o.x, o.y)
        if where:
            qas.append(QA(f"Where is the {o.name}?", capitalize(where),
                          [capitalize(p) for p in ALL_POSITIONS if p != where], "scenes.position"))
        qas.append(yes_no(f"Is there {article(o.name)} in the image?", True, "scenes.exists"))
    present = {(o.color, o.shape) for o in objects}
    while True:
        color, shape = pick(rng, list(COLORS)), pick(rng, SHAPES)
        if (color, shape) not in present:
            break
    qas.append(yes_no(f"Is there {article(color + ' ' + shape)} in the image?", False, "scenes.exists"))

    for a in objects:
        for b in objects:
            if a is b:
                continue
            rel = relation(a, b)
            if rel is None:
                continue
            qas.append(yes_no(f"Is the {a.name} {rel} the {b.name}?", True, "scenes.relation"))
            qas.append(yes_no(f"Is the {a.name} {_OPPOSITE[rel]} the {b.name}?", False, "scenes.relation"))
            matches = [o for o in objects if o is not b and holds(rel, o, b) is not False]
            if matches == [a]:
                qas.append(QA(f"What is {rel} the {b.name}?", f"The {a.name}",
                              [f"The {o.name}" for o in objects if o is not a], "scenes.relation_what"))
            if SIZES[a.size] > SIZES[b.size]:
                qas.append(QA(f"Which is bigger, the {a.name} or the {b.name}?", f"The {a.name}",
                              [f"The {b.name}"], "scenes.compare"))
    radii = sorted((SIZES[o.size] for o in objects), reverse=True)
    if n > 1 and radii[0] > radii[1]:
        big = max(objects, key=lambda o: SIZES[o.size])
        qas.append(QA("Which shape is the largest?", f"The {big.name}",
                      [f"The {o.name}" for o in objects if o is not big], "scenes.largest"))
    return qas


def _captions(objects: list[SceneObject], background: str) -> list[str]:
    n = len(objects)
    listed = join_words([article(o.name) for o in objects])
    listed_sized = join_words([article(o.full_name) for o in objects])
    if n == 1:
        o = objects[0]
        caps = [f"A single {o.full_name} on a {background} background.",
                f"{article(o.name)} on a plain {background} background."]
    else:
        caps = [f"{number_word(n)} shapes on a {background} background: {listed_sized}.",
                f"{listed} on a {background} background."]
        if n == 2:
            a, b = objects
            rel = relation(a, b)
            if rel:
                caps.append(f"{article(a.name)} {rel} {article(b.name)}.")
                caps.append(f"{article(a.full_name)} {rel} {article(b.full_name)}.")
    return [sentence(c) for c in caps]


def _detailed(objects: list[SceneObject], background: str) -> str:
    n = len(objects)
    noun = "shape" if n == 1 else "shapes"
    parts = [f"The image shows {number_word(n)} {noun} on a plain {background} background."]
    places = []
    for o in objects:
        where = position_phrase(o.x, o.y)
        places.append(article(o.full_name) + (f" {where}" if where else ""))
    parts.append(sentence("There is " + join_words(places)))
    for a, b in zip(objects, objects[1:]):
        rel = relation(a, b)
        if rel:
            parts.append(f"The {a.name} is {rel} the {b.name}.")
    return " ".join(parts)


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One ``scenes`` image with its captions and questions."""
    key, (background, objects) = draw_for_split(rng, split, _draw_spec)
    radii = [SIZES[o.size] for o in objects]
    centres = None
    while centres is None:
        centres = place_disks(rng, radii, gap=6.0, margin=4.0)
    for o, (x, y) in zip(objects, centres):
        o.x, o.y = x, y

    canvas = Canvas(size, jitter(rng, BACKGROUNDS[background], 6))
    outlined = rng.random() < 0.3
    for o, r in zip(objects, radii):
        fill = jitter(rng, COLORS[o.color], 10)
        draw_shape(canvas, o.shape, o.x, o.y, r, fill, shade(fill, 0.6) if outlined else None, 1.2)

    meta = {"key": key, "background": background,
            "objects": [{"shape": o.shape, "color": o.color, "size": o.size,
                         "x": round(o.x, 1), "y": round(o.y, 1)} for o in objects]}
    return Content(canvas.finish(), _captions(objects, background), _detailed(objects, background),
                   _questions(rng, objects), meta=meta)
