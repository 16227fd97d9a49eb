"""Drawing helpers shared by the synthetic families: canvas, fonts, colours, shapes, layout.

All synthetic families draw in a fixed 128 x 128 *unit* coordinate system on a
:class:`Canvas`, which maps units to pixels for any output ``size`` and supersamples
(draws at 2x and downsamples with a Lanczos filter) so that PIL's aliased shapes look smooth.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

UNITS = 128  # side of the drawing coordinate system
SUPERSAMPLE = 2

Color = tuple[int, int, int]

# Named colours used in captions; chosen to be distinct from each other and from BACKGROUNDS.
COLORS: dict[str, Color] = {
    "red": (214, 39, 40),
    "orange": (245, 130, 20),
    "yellow": (236, 200, 20),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "purple": (140, 60, 180),
    "pink": (240, 110, 180),
    "brown": (130, 80, 40),
    "black": (25, 25, 25),
    "gray": (120, 120, 120),
}
BACKGROUNDS: dict[str, Color] = {
    "white": (250, 250, 250),
    "light gray": (222, 222, 222),
    "beige": (243, 233, 210),
    "light blue": (214, 230, 246),
}

SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon", "pentagon", "cross", "heart")
_PLURAL_IRREGULAR = {"cross": "crosses"}

FONT_FILES = {
    "sans": "DejaVuSans.ttf",
    "sans-bold": "DejaVuSans-Bold.ttf",
    "serif": "DejaVuSerif.ttf",
    "serif-bold": "DejaVuSerif-Bold.ttf",
    "serif-italic": "DejaVuSerif-Italic.ttf",
    "mono": "DejaVuSansMono.ttf",
    "mono-bold": "DejaVuSansMono-Bold.ttf",
}


def plural(noun: str) -> str:
    """``"circle" -> "circles"``, ``"cross" -> "crosses"``."""
    return _PLURAL_IRREGULAR.get(noun, noun + "s")


def _font_dirs() -> list[str]:
    dirs = []
    try:  # matplotlib ships DejaVu, which keeps the rendering identical across machines
        import matplotlib

        dirs.append(os.path.join(matplotlib.get_data_path(), "fonts", "ttf"))
    except ImportError:
        pass
    dirs.append("/usr/share/fonts/truetype/dejavu")
    return dirs


@lru_cache(maxsize=256)
def font(name: str, px: int) -> ImageFont.FreeTypeFont:
    """A TrueType font (see :data:`FONT_FILES`) at ``px`` pixels, DejaVu when available.

    Falls back to Pillow's built-in scalable default font.
    """
    for d in _font_dirs():
        path = os.path.join(d, FONT_FILES[name])
        if os.path.exists(path):
            return ImageFont.truetype(path, max(1, px))
    return ImageFont.load_default(size=max(1, px))


class Canvas:
    """A supersampled RGB drawing surface addressed in 128 x 128 units.

    Args:
        size: side of the final image in pixels.
        background: fill colour.
    """

    def __init__(self, size: int, background: Color | tuple[int, int, int, int], mode: str = "RGB"):
        self.size = size
        self.k = size * SUPERSAMPLE / UNITS  # pixels per unit on the supersampled image
        self.image = Image.new(mode, (size * SUPERSAMPLE,) * 2, background)
        self.draw = ImageDraw.Draw(self.image)

    def layer(self) -> "Canvas":
        """A transparent canvas of the same geometry, to draw something that gets rotated."""
        return Canvas(self.size, (0, 0, 0, 0), mode="RGBA")

    def paste_rotated(self, layer: "Canvas", degrees: float, cx: float = UNITS / 2, cy: float = UNITS / 2):
        """Composite ``layer`` onto this canvas, rotated counter-clockwise about ``(cx, cy)``."""
        rotated = layer.image.rotate(degrees, resample=Image.BICUBIC, center=(self.px(cx), self.px(cy)))
        self.image.paste(rotated, (0, 0), rotated)

    def vertical_gradient(self, top: Color, bottom: Color, y0: float = 0, y1: float = UNITS):
        """Fill the band ``y0..y1`` (units) with a top-to-bottom colour gradient."""
        p0, p1 = int(self.px(y0)), int(self.px(y1))
        for py in range(p0, p1):
            t = (py - p0) / max(1, p1 - p0 - 1)
            color = tuple(int(a + (b - a) * t) for a, b in zip(top, bottom))
            self.draw.line([(0, py), (self.image.width, py)], fill=color)

    def px(self, v: float) -> float:
        """Units -> supersampled pixels."""
        return v * self.k

    def pts(self, points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * self.k, y * self.k) for x, y in points]

    def width(self, w: float) -> int:
        return max(1, round(w * self.k))

    def rect(self, x0, y0, x1, y1, fill=None, outline=None, width=1.0, radius=0.0):
        box = [self.px(x0), self.px(y0), self.px(x1), self.px(y1)]
        if radius > 0:
            self.draw.rounded_rectangle(box, self.px(radius), fill, outline, self.width(width))
        else:
            self.draw.rectangle(box, fill, outline, self.width(width))

    def ellipse(self, cx, cy, rx, ry, fill=None, outline=None, width=1.0):
        box = [self.px(cx - rx), self.px(cy - ry), self.px(cx + rx), self.px(cy + ry)]
        self.draw.ellipse(box, fill, outline, self.width(width))

    def polygon(self, points, fill=None, outline=None, width=1.0):
        self.draw.polygon(self.pts(points), fill, outline, self.width(width))

    def line(self, points, fill, width=1.0):
        self.draw.line(self.pts(points), fill, self.width(width), joint="curve")

    def arc(self, cx, cy, r, start_deg, end_deg, fill, width=1.0):
        """Arc with angles in degrees, clockwise from 3 o'clock (PIL's convention)."""
        box = [self.px(cx - r), self.px(cy - r), self.px(cx + r), self.px(cy + r)]
        self.draw.arc(box, start_deg, end_deg, fill, self.width(width))

    def font(self, name: str, size_units: float) -> ImageFont.FreeTypeFont:
        return font(name, round(size_units * self.k))

    def text_size(self, text: str, name: str, size_units: float) -> tuple[float, float]:
        """Width and height of ``text`` in units."""
        x0, y0, x1, y1 = self.draw.textbbox((0, 0), text, font=self.font(name, size_units))
        return (x1 - x0) / self.k, (y1 - y0) / self.k

    def text(self, x, y, text, fill, name="sans", size_units=12.0, anchor="mm", **kw):
        """Draw ``text`` anchored at ``(x, y)`` units (PIL anchors, default centred)."""
        self.draw.text(
            (self.px(x), self.px(y)), text, fill=fill, font=self.font(name, size_units),
            anchor=anchor, **kw,
        )

    def fit_font(self, lines: Sequence[str], name: str, max_w: float, max_h: float,
                 lo: float = 10.0, hi: float = 40.0, spacing: float = 1.15) -> float | None:
        """Largest font size (units) in ``[lo, hi]`` at which ``lines`` fit in the box."""
        size = hi
        while size >= lo:
            widths, heights = zip(*(self.text_size(line, name, size) for line in lines))
            if max(widths) <= max_w and size * spacing * len(lines) <= max_h:
                return size
            size -= 1.0
        return None

    def finish(self) -> Image.Image:
        """The final ``size x size`` RGB image."""
        return self.image.resize((self.size, self.size), Image.LANCZOS)


def shade(color: Color, factor: float) -> Color:
    """Darken (factor < 1) or lighten (factor > 1, towards white) a colour."""
    if factor <= 1:
        return tuple(int(c * factor) for c in color)
    t = min(1.0, factor - 1)
    return tuple(int(c + (255 - c) * t) for c in color)


def jitter(rng: np.random.Generator, color: Color, amount: int = 12) -> Color:
    """A colour randomly made lighter or darker by up to ``amount`` (still the same name).

    The offset is mostly shared by the channels so that the hue is kept (a per-channel
    offset turns near-black into visible purples and greens).
    """
    shared = int(rng.integers(-amount, amount + 1))
    tint = rng.integers(-(amount // 4), amount // 4 + 1, size=3)
    return tuple(int(np.clip(c + shared + t, 0, 255)) for c, t in zip(color, tint))


def contrast_text_color(background: Color) -> Color:
    """Black or white, whichever reads better on ``background``."""
    r, g, b = background
    return (20, 20, 20) if 0.299 * r + 0.587 * g + 0.114 * b > 140 else (250, 250, 250)


def _regular(n: int, x: float, y: float, r: float, phase: float = -math.pi / 2):
    return [(x + r * math.cos(phase + 2 * math.pi * i / n), y + r * math.sin(phase + 2 * math.pi * i / n))
            for i in range(n)]


def shape_points(shape: str, x: float, y: float, r: float) -> list[tuple[float, float]] | None:
    """Polygon of ``shape`` centred at ``(x, y)`` fitting in radius ``r`` (``None`` for circle)."""
    if shape == "circle":
        return None
    if shape == "square":
        h = r * 0.8
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape == "triangle":
        return [(x, y - r), (x + r * 0.95, y + r * 0.75), (x - r * 0.95, y + r * 0.75)]
    if shape == "diamond":
        return [(x, y - r), (x + r * 0.7, y), (x, y + r), (x - r * 0.7, y)]
    if shape == "hexagon":
        return _regular(6, x, y, r, phase=0.0)
    if shape == "pentagon":
        return _regular(5, x, y, r)
    if shape == "star":
        outer, inner = _regular(5, x, y, r), _regular(5, x, y, r * 0.42, phase=-math.pi / 2 + math.pi / 5)
        return [p for pair in zip(outer, inner) for p in pair]
    if shape == "cross":
        a, b = r * 0.85, r * 0.3
        return [(x - b, y - a), (x + b, y - a), (x + b, y - b), (x + a, y - b), (x + a, y + b),
                (x + b, y + b), (x + b, y + a), (x - b, y + a), (x - b, y + b), (x - a, y + b),
                (x - a, y - b), (x - b, y - b)]
    if shape == "heart":
        t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        hx = 16 * np.sin(t) ** 3
        hy = 13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t)
        s = r / 17.0
        return [(x + s * a, y - s * (b + 2.5)) for a, b in zip(hx, hy)]
    raise ValueError(f"unknown shape {shape!r}")


def draw_shape(canvas: Canvas, shape: str, x: float, y: float, r: float, fill: Color,
               outline: Color | None = None, width: float = 1.0) -> None:
    """Draw a filled ``shape`` (one of :data:`SHAPES`)."""
    points = shape_points(shape, x, y, r)
    if points is None:
        canvas.ellipse(x, y, r * 0.9, r * 0.9, fill, outline, width)
    else:
        canvas.polygon(points, fill, outline, width)


def place_disks(rng: np.random.Generator, radii: Sequence[float], gap: float = 4.0,
                margin: float = 3.0, tries: int = 400) -> list[tuple[float, float]] | None:
    """Random non-overlapping centres for disks of ``radii`` inside the canvas.

    Returns ``None`` when the disks do not fit after ``tries`` attempts per disk.
    """
    centres: list[tuple[float, float]] = []
    for r in radii:
        lo, hi = r + margin, UNITS - r - margin
        for _ in range(tries):
            x, y = rng.uniform(lo, hi, size=2)
            if all(math.hypot(x - cx, y - cy) >= r + cr + gap for (cx, cy), cr in zip(centres, radii)):
                centres.append((float(x), float(y)))
                break
        else:
            return None
    return centres
