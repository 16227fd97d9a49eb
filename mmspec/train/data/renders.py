"""Images the caption generator never makes: drafter data and benchmarks outside its six families.

The captioner was trained on :data:`mmspec.train.data.FAMILIES`; a drafter trained and measured only
on those overstates what a user's images get. These renders are drawn by other code, in other
styles, and carry no caption (the captioner's own answers are the drafter's targets):

* ``abstract`` -- overlapping translucent polygons, ellipses and strokes on a two-colour gradient;
* ``patterns`` -- stripes, checkerboards, concentric rings, dots or value noise in random palettes;
* ``documents`` -- a page of several lines of words in a random font, sometimes with a heading;
* ``plots`` -- matplotlib scatter, pie, histogram, area and box plots with random data and words
  (kinds the ``charts`` family does not draw);
* ``collage`` -- 2 x 2 or 1 x 2 tiles of different families' images of the same split.

:func:`make_render` is deterministic in ``(kind, index)``; the ``split`` names a disjoint seed
stream, as the families' splits do.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw

from .core import CAPTION_PROMPTS, DETAILED_PROMPTS, check_request, stable_hash
from .render import FONT_FILES, font

WORDS = ("river", "market", "yellow", "engine", "winter", "garden", "signal", "orbit", "copper", "window", "forest",
         "harbor", "silver", "rocket", "pencil", "island", "planet", "bridge", "candle", "mirror", "ticket", "thunder",
         "meadow", "anchor", "violet", "canyon", "lantern", "marble", "summit", "velvet", "glacier", "compass")


def _rng(kind: str, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(stable_hash(f"render/{kind}/{split}/{index}"))


def _color(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def _gradient(rng: np.random.Generator, size: int) -> Image.Image:
    a, b = np.array(_color(rng), float), np.array(_color(rng), float)
    angle = rng.uniform(0, 2 * math.pi)
    y, x = np.mgrid[0:size, 0:size] / max(1, size - 1)
    t = np.clip((x * math.cos(angle) + y * math.sin(angle) + 1) / 2, 0, 1)[..., None]
    return Image.fromarray((a * (1 - t) + b * t).astype(np.uint8))


def abstract(rng: np.random.Generator, size: int, split: str) -> Image.Image:
    image = _gradient(rng, size).convert("RGBA")
    for _ in range(int(rng.integers(3, 12))):
        layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(layer)
        fill = (*_color(rng), int(rng.integers(90, 230)))
        points = [tuple(float(v) for v in rng.uniform(-0.1, 1.1, 2) * size) for _ in range(int(rng.integers(2, 7)))]
        if len(points) == 2:
            draw.line(points, fill=fill, width=max(1, int(rng.uniform(0.01, 0.06) * size)))
        elif rng.random() < 0.4:
            (x0, x1), (y0, y1) = sorted((points[0][0], points[1][0])), sorted((points[0][1], points[1][1]))
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon(points, fill=fill)
        image = Image.alpha_composite(image, layer)
    return image.convert("RGB")


def patterns(rng: np.random.Generator, size: int, split: str) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size] / size
    period = rng.uniform(0.05, 0.3)
    kind = int(rng.integers(5))
    if kind == 0:  # stripes at an angle
        angle = rng.uniform(0, math.pi)
        t = ((x * math.cos(angle) + y * math.sin(angle)) / period) % 1 < 0.5
    elif kind == 1:  # checkerboard
        t = ((x // period + y // period) % 2) == 0
    elif kind == 2:  # rings about a point
        cx, cy = rng.uniform(0.2, 0.8, 2)
        t = (np.hypot(x - cx, y - cy) / period) % 1 < 0.5
    elif kind == 3:  # a grid of dots
        t = np.hypot((x / period) % 1 - 0.5, (y / period) % 1 - 0.5) < rng.uniform(0.15, 0.45)
    else:  # smooth value noise, thresholded into two tones
        cells = int(rng.integers(3, 10))
        coarse = Image.fromarray((rng.random((cells, cells)) * 255).astype(np.uint8)).resize((size, size), Image.BICUBIC)
        t = np.asarray(coarse) > 127
    a, b = np.array(_color(rng)), np.array(_color(rng))
    return Image.fromarray(np.where(t[..., None], a, b).astype(np.uint8))


def documents(rng: np.random.Generator, size: int, split: str) -> Image.Image:
    paper = tuple(int(v) for v in rng.integers(215, 256, 3))
    ink = tuple(int(v) for v in rng.integers(0, 90, 3))
    image = Image.new("RGB", (size, size), paper)
    draw = ImageDraw.Draw(image)
    face = str(rng.choice(sorted(FONT_FILES)))
    px = max(6, int(size * rng.uniform(0.06, 0.12)))
    y = int(size * 0.06)
    if rng.random() < 0.5:  # a heading, larger and bold
        draw.text((int(size * 0.06), y), " ".join(rng.choice(WORDS, 2)).title(), fill=ink, font=font("sans-bold", int(px * 1.4)))
        y += int(px * 1.9)
    while y < size - px:
        line = " ".join(rng.choice(WORDS, int(rng.integers(2, 6))))
        draw.text((int(size * 0.06), y), line, fill=ink, font=font(face, px))
        y += int(px * rng.uniform(1.3, 1.8))
    return image


def plots(rng: np.random.Generator, size: int, split: str) -> Image.Image:
    """Drawn on matplotlib's Agg canvas directly (no pyplot, no global backend), as ``charts`` is."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(3, 3), dpi=max(40, size // 3))
    canvas = FigureCanvasAgg(figure)
    axes = figure.subplots()
    kind = int(rng.integers(5))
    n = int(rng.integers(3, 7))
    labels = [str(w).title() for w in rng.choice(WORDS, n, replace=False)]
    if kind == 0:
        axes.scatter(rng.normal(size=40), rng.normal(size=40), c=rng.random(40), s=rng.uniform(10, 60, 40))
    elif kind == 1:
        axes.pie(rng.uniform(1, 5, n), labels=labels)
    elif kind == 2:
        axes.hist(rng.normal(size=300) * rng.uniform(0.5, 3), bins=int(rng.integers(6, 25)), color=np.array(_color(rng)) / 255)
    elif kind == 3:
        xs = np.arange(12)
        axes.stackplot(xs, *(rng.uniform(0, 3, (int(rng.integers(2, 4)), 12))), labels=labels[:3])
        axes.legend(loc="upper left", fontsize=6)
    else:
        axes.boxplot([rng.normal(i, 1 + rng.random(), 30) for i in range(n)], tick_labels=labels)
    axes.set_title(" ".join(rng.choice(WORDS, 2)).title(), fontsize=9)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy()).resize((size, size), Image.BICUBIC)


def collage(rng: np.random.Generator, size: int, split: str) -> Image.Image:
    """Tiles of the families' images of the same ``split`` (a training collage holds no test image)."""
    from .api import FAMILIES, make_sample

    rows, cols = (2, 2) if rng.random() < 0.6 else (1, 2)
    tile = max(16, size // cols)
    image = Image.new("RGB", (tile * cols, tile * rows), (255, 255, 255))
    for r in range(rows):
        for c in range(cols):
            family = str(rng.choice(FAMILIES))
            image.paste(make_sample(family, split, int(rng.integers(10_000)), size=tile).image, (c * tile, r * tile))
    return image.resize((size, size), Image.BICUBIC)


RENDERS: dict[str, Callable[[np.random.Generator, int, str], Image.Image]] = {
    "abstract": abstract, "patterns": patterns, "documents": documents, "plots": plots, "collage": collage,
}


def make_render(kind: str, split: str, index: int, size: int = 128) -> tuple[Image.Image, str]:
    """-> (an RGB ``size`` x ``size`` image of ``kind``, a caption or detailed-description prompt).

    Raises:
        ValueError: an unknown kind or split, or a size below 16.
    """
    check_request(kind, tuple(RENDERS), "render kind", split, size)
    rng = _rng(kind, split, index)
    image = RENDERS[kind](rng, size, split)
    prompts = DETAILED_PROMPTS if rng.random() < 0.3 else CAPTION_PROMPTS
    return image, str(rng.choice(prompts))
