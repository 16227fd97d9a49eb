"""``math`` family (MathVista-like): clocks, labelled geometry, angles, dice and arithmetic.

Each puzzle type is a pair of functions registered in :data:`PUZZLES`: a cheap ``spec``
function that draws the parameters and a canonical key (gated by split, so e.g. a clock time
or a rectangle's side lengths owned by test never appear in training), and a ``render``
function that draws the figure and returns captions, a detailed description and questions.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .core import QA, Content, article, capitalize, draw_for_split, join_words, number_word, pick, sentence
from .render import BACKGROUNDS, COLORS, UNITS, Canvas, jitter

INK = (25, 25, 25)
LABEL_FONT = "sans"
Rendered = tuple[list[str], str, list[QA], str]  # captions, detailed, qas, subject


def _numeric_distractors(v: int, *likely_mistakes: int) -> list[str]:
    """Nearby numbers plus the results of typical mistakes, never ``v`` itself."""
    candidates = (*likely_mistakes, v - 2, v - 1, v + 1, v + 2, v * 2)
    return list(dict.fromkeys(str(w) for w in candidates if w >= 0 and w != v))


def _other_numbers(rng: np.random.Generator, choices: range, v: int, k: int = 3) -> list[str]:
    """``k`` random members of ``choices`` other than ``v``, as strings."""
    others = [n for n in choices if n != v]
    return [str(others[i]) for i in rng.permutation(len(others))[:k]]


# -- clock ------------------------------------------------------------------------------------

def _clock_spec(rng):
    h, m = int(rng.integers(1, 13)), int(rng.integers(0, 12)) * 5
    return f"clock|{h}:{m:02d}", (h, m)


def _fmt_time(h: int, m: int) -> str:
    return f"{h}:{m:02d}"


def _clock_render(rng, canvas: Canvas, params) -> Rendered:
    h, m = params
    rim_name = pick(rng, ["black", "blue", "red", "brown", "gray", "green"])
    rim = COLORS[rim_name]
    face = jitter(rng, pick(rng, [(252, 252, 250), (250, 243, 225)]), 4)
    cx = cy = UNITS / 2
    R = 58.0
    canvas.ellipse(cx, cy, R, R, fill=face, outline=rim, width=float(rng.uniform(3, 5)))
    numbers = pick(rng, ["all", "all", "quarters", "none"])
    minute_ticks = numbers == "none" or rng.random() < 0.5
    for i in range(60):
        a = math.radians(i * 6)
        hour = i % 5 == 0
        if not hour and not minute_ticks:
            continue
        r0 = R - (9 if hour else 5)
        canvas.line([(cx + r0 * math.sin(a), cy - r0 * math.cos(a)),
                     (cx + (R - 3) * math.sin(a), cy - (R - 3) * math.cos(a))], INK, 2.2 if hour else 0.8)
    for n in range(1, 13):
        if numbers == "all" or (numbers == "quarters" and n % 3 == 0):
            a = math.radians(n * 30)
            canvas.text(cx + 41 * math.sin(a), cy - 41 * math.cos(a), str(n), INK, LABEL_FONT, 12)
    hand_color = pick(rng, [INK, (40, 40, 90)])
    for length, width, angle in ((30, 4.5, (h % 12 + m / 60) * 30), (47, 2.5, m * 6)):
        a = math.radians(angle)
        canvas.line([(cx, cy), (cx + length * math.sin(a), cy - length * math.cos(a))], hand_color, width)
    canvas.ellipse(cx, cy, 3, 3, fill=(200, 30, 30))

    time = _fmt_time(h, m)
    swapped = _fmt_time(m // 5 or 12, (h % 12) * 5)
    distractors = [d for d in (swapped, _fmt_time(h % 12 + 1, m), _fmt_time((h - 2) % 12 + 1, m),
                               _fmt_time(h, (m + 5) % 60)) if d != time]
    minute_number = m // 5 or 12
    qas = [QA(pick(rng, ["What time is shown on the clock?", "What time does the clock show?",
                         "What time is it according to the clock?"]), time, distractors, "math.clock"),
           QA("Which number is the minute hand pointing at?", str(minute_number),
              _other_numbers(rng, range(1, 13), minute_number), "math.clock_minute")]
    face_name = "white" if face[2] > 240 else "cream"
    captions = [f"An analog clock showing {time}.", f"A round clock with a {rim_name} rim that reads {time}."]
    marks = {"all": "all twelve numbers", "quarters": "the numbers 12, 3, 6 and 9", "none": "tick marks only"}[numbers]
    hour_at = f"at {h}" if m == 0 else f"just past {h}" if m < 30 else f"between {h} and {h % 12 + 1}"
    detailed = (f"A round analog clock with a {face_name} face, a {rim_name} rim and {marks}. The short hour hand "
                f"points {hour_at} and the long minute hand points at {minute_number}, so the time is {time}.")
    return captions, detailed, qas, "clock"


# -- labelled rectangles and squares ----------------------------------------------------------

def _rect_spec(rng):
    square = rng.random() < 0.3
    w = int(rng.integers(2, 16))
    h = w if square else int(rng.integers(2, 16))
    if not square and h == w:
        h = w + 1
    unit = pick(rng, ["cm", "m", "in", ""])
    return f"rect|{w}x{h}|{unit}", (w, h, unit, square)


def _label(canvas: Canvas, x: float, y: float, text: str, size: float = 12, color=INK, anchor="mm"):
    canvas.text(x, y, text, color, LABEL_FONT, size, anchor=anchor)


def _rect_render(rng, canvas: Canvas, params) -> Rendered:
    w, h, unit, square = params
    suffix = f" {unit}" if unit else ""
    aspect = min(2.2, max(1 / 2.2, w / h))
    bw, bh = (76.0, 76.0 / aspect) if aspect >= 1 else (76.0 * aspect, 76.0)
    side_label = 0.0 if square else 4 + canvas.text_size(f"{h}{suffix}", LABEL_FONT, 12)[0]
    x0, y0 = (UNITS - bw - side_label) / 2, 56 - bh / 2
    fill = jitter(rng, pick(rng, [(200, 225, 250), (255, 235, 190), (215, 240, 210), (245, 215, 230)]), 6)
    canvas.rect(x0, y0, x0 + bw, y0 + bh, fill=fill, outline=INK, width=1.8)
    _label(canvas, x0 + bw / 2, y0 + bh + 9, f"{w}{suffix}")
    if not square:
        _label(canvas, x0 + bw + 4, y0 + bh / 2, f"{h}{suffix}", anchor="lm")
    else:  # equal-side tick marks
        for (xa, ya), (xb, yb) in (((x0 + bw / 2, y0 - 3), (x0 + bw / 2, y0 + 3)),
                                   ((x0 - 3, y0 + bh / 2), (x0 + 3, y0 + bh / 2)),
                                   ((x0 + bw - 3, y0 + bh / 2), (x0 + bw + 3, y0 + bh / 2)),
                                   ((x0 + bw / 2, y0 + bh - 3), (x0 + bw / 2, y0 + bh + 3))):
            canvas.line([(xa, ya), (xb, yb)], INK, 1.5)
    shape = "square" if square else "rectangle"
    perimeter, area = 2 * (w + h), w * h
    qas = [QA(f"What is the perimeter of the {shape}?", str(perimeter), _numeric_distractors(perimeter, area),
              "math.perimeter"),
           QA(f"What is the area of the {shape}?", str(area), _numeric_distractors(area, perimeter),
              "math.area")]
    sides = f"sides of {w}{suffix}" if square else f"sides labelled {w}{suffix} and {h}{suffix}"
    captions = [f"A {shape} with {sides}.", f"A geometry diagram of a {shape} with {sides}."]
    detailed = (f"A diagram of a shaded {shape}. " +
                (f"One side is labelled {w}{suffix} and tick marks show that all four sides are equal. "
                 if square else f"The bottom side is labelled {w}{suffix} and the right side {h}{suffix}. ") +
                f"Its perimeter is {perimeter} and its area is {area}.")
    return captions, detailed, qas, "diagram"


# -- right triangle with a missing hypotenuse --------------------------------------------------

TRIPLES = ((3, 4, 5), (6, 8, 10), (5, 12, 13), (9, 12, 15), (8, 15, 17), (12, 16, 20), (15, 20, 25),
           (7, 24, 25), (10, 24, 26), (20, 21, 29), (9, 40, 41), (12, 35, 37), (18, 24, 30), (15, 8, 17))


def _rtri_spec(rng):
    a, b, c = TRIPLES[int(rng.integers(len(TRIPLES)))]
    if rng.random() < 0.5:
        a, b = b, a
    return f"rtri|{a},{b}", (a, b, c)


def _rtri_render(rng, canvas: Canvas, params) -> Rendered:
    a, b, c = params  # a: horizontal leg, b: vertical leg
    scale = 84.0 / max(a, b)
    ax, ay = 24.0, 104.0  # right-angle vertex
    bx, by = ax + a * scale, ay
    tx, ty = ax, ay - b * scale
    fill = jitter(rng, pick(rng, [(255, 240, 200), (210, 235, 250), (225, 245, 215)]), 6)
    canvas.polygon([(ax, ay), (bx, by), (tx, ty)], fill=fill, outline=INK, width=1.8)
    canvas.polygon([(ax, ay - 7), (ax + 7, ay - 7), (ax + 7, ay)], outline=INK, width=1.2)
    _label(canvas, (ax + bx) / 2, ay + 10, str(a))
    _label(canvas, ax - 4, (ay + ty) / 2, str(b), anchor="rm")
    _label(canvas, (bx + tx) / 2 + 8, (by + ty) / 2 - 6, "x", size=13)
    area = a * b // 2
    qas = [QA(pick(rng, ["What is the value of x?", "What is the length of the hypotenuse x?"]), str(c),
              _numeric_distractors(c, a + b), "math.hypotenuse"),
           QA("What is the area of the triangle?", str(area), _numeric_distractors(area), "math.area")]
    captions = [f"A right triangle with legs {a} and {b} and a hypotenuse marked x.",
                f"A right triangle diagram with legs labelled {a} and {b}."]
    detailed = (f"A right triangle with the right angle marked by a small square. The horizontal leg is "
                f"labelled {a}, the vertical leg {b}, and the hypotenuse is marked x. By the Pythagorean "
                f"theorem x = {c}.")
    return captions, detailed, qas, "diagram"


# -- triangle with a missing angle -------------------------------------------------------------

def _tri_spec(rng):
    while True:
        A, B = (int(v) * 5 for v in rng.integers(6, 21, size=2))
        if 180 - A - B >= 25:
            return f"tri|{A},{B}", (A, B, 180 - A - B)


def _fit(points: list[tuple[float, float]], box=(14.0, 14.0, 114.0, 100.0)) -> list[tuple[float, float]]:
    """Scale and translate ``points`` (y up) into ``box`` (units, y down), keeping proportions."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    s = min((box[2] - box[0]) / (max(xs) - min(xs)), (box[3] - box[1]) / (max(ys) - min(ys)))
    ox = box[0] + ((box[2] - box[0]) - s * (max(xs) - min(xs))) / 2
    return [(ox + s * (x - min(xs)), box[3] - s * (y - min(ys))) for x, y in points]


def _toward(p, q, d):
    """The point ``d`` units from ``p`` towards ``q``."""
    L = math.hypot(q[0] - p[0], q[1] - p[1])
    return p[0] + (q[0] - p[0]) * d / L, p[1] + (q[1] - p[1]) * d / L


def _tri_render(rng, canvas: Canvas, params) -> Rendered:
    A, B, C = params
    # apex from the base angles: |P0 apex| = sin(B) / sin(C) for a unit base
    d = math.sin(math.radians(B)) / math.sin(math.radians(C))
    pts = _fit([(0.0, 0.0), (1.0, 0.0), (d * math.cos(math.radians(A)), d * math.sin(math.radians(A)))])
    fill = jitter(rng, pick(rng, [(255, 240, 200), (210, 235, 250), (240, 220, 245)]), 6)
    canvas.polygon(pts, fill=fill, outline=INK, width=1.8)
    for i, (angle, text) in enumerate(zip((A, B, C), (f"{A}°", f"{B}°", "x"))):
        p, q, r = pts[i], pts[(i + 1) % 3], pts[(i + 2) % 3]
        # along the bisector, far enough from both sides for the label to sit inside the angle
        u, v = _toward(p, q, 1.0), _toward(p, r, 1.0)
        bisector = (p[0] + (u[0] - p[0]) + (v[0] - p[0]), p[1] + (u[1] - p[1]) + (v[1] - p[1]))
        distance = min(32.0, max(17.0, 10.0 / math.sin(math.radians(angle) / 2)))
        _label(canvas, *_toward(p, bisector, distance), text, size=11)
    qas = [QA(pick(rng, ["What is the value of x?", "What is the measure of the angle marked x, in degrees?"]),
              str(C), _numeric_distractors(C, 180 - C), "math.angle")]
    captions = [f"A triangle with two angles labelled {A}° and {B}° and a third angle x.",
                f"A triangle diagram with angles {A}°, {B}° and an unknown angle x."]
    detailed = (f"A triangle with two of its interior angles labelled {A}° and {B}°; the third angle is marked x. "
                f"Because the angles of a triangle add up to 180°, x = {C}°.")
    return captions, detailed, qas, "diagram"


# -- angle type and angle addition -------------------------------------------------------------

def _angle_spec(rng):
    if rng.random() < 0.5:
        theta = 90 if rng.random() < 0.25 else int(pick(rng, [*range(20, 76, 5), *range(105, 161, 5)]))
        return f"angle|{theta}", ("type", theta, 0)
    a, b = (int(v) * 5 for v in rng.integers(4, 15, size=2))
    return f"anglesum|{a},{b}", ("sum", a, b)


def _angle_render(rng, canvas: Canvas, params) -> Rendered:
    mode, a, b = params
    total = a + b if mode == "sum" else a
    base = float(rng.uniform(-10, 10))
    rays = [base, base + a] + ([base + a + b] if mode == "sum" else [])
    # centre the figure: bounding box of the vertex and the label positions at radius 60
    ends = [(60 * math.cos(math.radians(d)), -60 * math.sin(math.radians(d))) for d in rays] + [(0.0, 0.0)]
    xs, ys = zip(*ends)
    O = (UNITS / 2 - (min(xs) + max(xs)) / 2, UNITS / 2 - (min(ys) + max(ys)) / 2)

    def ray(deg: float, length: float = 52) -> tuple[float, float]:
        return O[0] + length * math.cos(math.radians(deg)), O[1] - length * math.sin(math.radians(deg))

    color = COLORS[pick(rng, ["blue", "red", "green", "purple"])]
    for deg in rays:
        canvas.line([O, ray(deg)], INK, 1.8)
    if mode == "type" and a == 90:
        p1, p2 = ray(base, 9), ray(base + 90, 9)
        canvas.line([p1, (p1[0] + p2[0] - O[0], p1[1] + p2[1] - O[1]), p2], color, 1.5)
    else:
        for i, (lo, hi) in enumerate(zip(rays, rays[1:])):
            canvas.arc(O[0], O[1], 14 + 5 * i, -hi, -lo, color, 1.5)
    if mode == "sum":
        for (lo, hi) in ((rays[0], rays[1]), (rays[1], rays[2])):
            _label(canvas, *ray((lo + hi) / 2, 30), f"{hi - lo:.0f}°", size=10)
        for deg, name in zip(rays, "ABC"):
            _label(canvas, *ray(deg, 60), name, size=11)
        _label(canvas, O[0] - 5, O[1] + 5, "O", size=11)
        qas = [QA(pick(rng, ["What is the measure of angle AOC?", "What is the size of angle AOC in degrees?"]),
                  str(total), _numeric_distractors(total, abs(a - b)), "math.angle_sum")]
        captions = [f"Two adjacent angles of {a}° and {b}° sharing a vertex O.",
                    f"An angle AOC split by a ray OB into parts of {a}° and {b}°."]
        detailed = (f"Three rays OA, OB and OC start from a common point O. The angle between OA and OB is "
                    f"labelled {a}° and the angle between OB and OC is labelled {b}°, so angle AOC is {total}°.")
        return captions, detailed, qas, "diagram"
    kind = "acute" if a < 90 else "right" if a == 90 else "obtuse"
    others = [capitalize(k) for k in ("acute", "right", "obtuse") if k != kind]
    qas = [QA(pick(rng, ["Is the angle shown acute, right or obtuse?", "What type of angle is shown?"]),
              capitalize(kind), others, "math.angle_type")]
    captions = [f"{article(kind)} angle formed by two rays.", f"A diagram of {article(kind)} angle."]
    mark = "a small square" if kind == "right" else "an arc"
    size = {"acute": "less than 90°", "right": "exactly 90°", "obtuse": "more than 90°"}[kind]
    detailed = f"Two rays meet at a common vertex and form {article(kind)} angle, marked with {mark}. It is {size}."
    return captions, detailed, qas, "diagram"


# -- segment addition --------------------------------------------------------------------------

def _segment_spec(rng):
    a, b = (int(v) for v in rng.integers(2, 20, size=2))
    mode = pick(rng, ["sum", "part"])
    return f"seg|{a},{b}|{mode}", (a, b, mode)


def _segment_render(rng, canvas: Canvas, params) -> Rendered:
    a, b, mode = params
    x0, x1, y = 12.0, 116.0, 64.0
    xc = x0 + (x1 - x0) * min(0.8, max(0.2, a / (a + b)))
    color = COLORS[pick(rng, ["blue", "red", "green", "black"])]
    canvas.line([(x0, y), (x1, y)], color, 2.2)
    for x, name in ((x0, "A"), (xc, "C"), (x1, "B")):
        canvas.ellipse(x, y, 2.5, 2.5, fill=INK)
        _label(canvas, x, y + 12, name, size=12)
    _label(canvas, (x0 + xc) / 2, y - 11, str(a))
    if mode == "sum":
        _label(canvas, (xc + x1) / 2, y - 11, str(b))
        question, answer = pick(rng, ["What is the length of AB?", "How long is segment AB?"]), a + b
        given, result = f"AC = {a} and CB = {b}", f"AB = {a + b}"
    else:
        canvas.line([(x0, y + 24), (x1, y + 24)], INK, 0.8)
        _label(canvas, (x0 + x1) / 2, y + 33, f"AB = {a + b}", size=11)
        question, answer = pick(rng, ["What is the length of CB?", "How long is segment CB?"]), b
        given, result = f"AC = {a} and AB = {a + b}", f"CB = {b}"
    qas = [QA(question, str(answer), _numeric_distractors(answer), "math.segment")]
    captions = [f"A line segment AB with a point C between A and B, where {given}.",
                f"A segment diagram showing {given}."]
    detailed = f"A straight segment from A to B with a point C between them. The labels give {given}, so {result}."
    return captions, detailed, qas, "diagram"


# -- dice --------------------------------------------------------------------------------------

PIPS = {1: [(0, 0)], 2: [(-1, -1), (1, 1)], 3: [(-1, -1), (0, 0), (1, 1)],
        4: [(-1, -1), (1, -1), (-1, 1), (1, 1)], 5: [(-1, -1), (1, -1), (0, 0), (-1, 1), (1, 1)],
        6: [(-1, -1), (1, -1), (-1, 0), (1, 0), (-1, 1), (1, 1)]}


def _dice_spec(rng):
    values = tuple(int(v) for v in rng.integers(1, 7, size=int(rng.integers(2, 4))))
    return f"dice|{','.join(map(str, values))}", values


def _dice_render(rng, canvas: Canvas, params) -> Rendered:
    values = params
    n = len(values)
    body_name, body, pip = pick(rng, [("white", (250, 250, 248), INK), ("red", (200, 30, 30), (250, 250, 250)),
                                      ("ivory", (245, 235, 205), INK), ("black", (30, 30, 30), (250, 250, 250))])
    side = 34.0 if n == 3 else 44.0
    gap = (UNITS - n * side) / (n + 1)
    for i, v in enumerate(values):
        x0 = gap + i * (side + gap)
        y0 = 64 - side / 2 + float(rng.uniform(-8, 8))
        canvas.rect(x0, y0, x0 + side, y0 + side, fill=body, outline=(60, 60, 60), width=1.5, radius=side * 0.16)
        for dx, dy in PIPS[v]:
            canvas.ellipse(x0 + side / 2 + dx * side * 0.28, y0 + side / 2 + dy * side * 0.28, side * 0.09,
                           side * 0.09, fill=pip)
    total = sum(values)
    sum_question = pick(rng, ["What is the sum of the numbers on the dice?",
                              "What is the total number of dots on the dice?", "Add up the dice. What is the total?"])
    qas = [QA(sum_question, str(total), _numeric_distractors(total), "math.dice_sum"),
           QA("How many dots are on the leftmost die?", str(values[0]), _other_numbers(rng, range(1, 7), values[0]),
              "math.dice_value"),
           QA("What is the highest number rolled?", str(max(values)), _other_numbers(rng, range(1, 7), max(values)),
              "math.dice_max")]
    if n == 2:
        prod = values[0] * values[1]
        qas.append(QA("What is the product of the two dice?", str(prod), _numeric_distractors(prod, total),
                      "math.dice_product"))
    shown = join_words([str(v) for v in values])
    captions = [f"{capitalize(number_word(n))} {body_name} dice showing {shown}.",
                f"A roll of {number_word(n)} dice with a total of {total}."]
    detailed = (f"{capitalize(number_word(n))} {body_name} dice lie side by side on a plain background. From left to "
                f"right they show {shown}, which adds up to {total}.")
    return captions, detailed, qas, "picture"


# -- written arithmetic ------------------------------------------------------------------------

def _arith_spec(rng):
    op = pick(rng, ["+", "-", "×"])
    if op == "×":
        a, b = (int(v) for v in rng.integers(2, 13, size=2))
    else:
        a, b = (int(v) for v in rng.integers(1, 51, size=2))
        if op == "-" and b > a:
            a, b = b, a
    return f"arith|{a}{op}{b}", (a, op, b)


def _arith_render(rng, canvas: Canvas, params) -> Rendered:
    a, op, b = params
    result = a + b if op == "+" else a - b if op == "-" else a * b
    board = rng.random() < 0.5
    if board:
        canvas.rect(0, 0, UNITS, UNITS, fill=(120, 80, 45))
        canvas.rect(8, 20, 120, 108, fill=jitter(rng, (40, 85, 60), 8))
        ink, font = (245, 245, 240), "sans"
    else:
        canvas.rect(10, 20, 118, 108, fill=(252, 252, 250), outline=(170, 170, 170), width=1)
        for y in range(36, 108, 12):
            canvas.line([(10, y), (118, y)], (190, 210, 235), 0.7)
        ink, font = (30, 40, 120), "sans-bold"
    text = f"{a} {op} {b} = ?"
    size = canvas.fit_font([text], font, 100, 40, lo=14, hi=26)
    canvas.text(64, 64, text, ink, font, size)
    word = {"+": "addition", "-": "subtraction", "×": "multiplication"}[op]
    qas = [QA(pick(rng, ["What is the answer to the problem in the image?", "Solve the problem shown.",
                         "What number should replace the question mark?"]), str(result),
              _numeric_distractors(result), "math.arithmetic")]
    where = "a green chalkboard" if board else "lined paper"
    captions = [f"{article(word)} problem, {a} {op} {b}, written on {where}.",
                f"The math problem {a} {op} {b} = ? on {where}."]
    detailed = (f"The {word} problem {a} {op} {b} = ? is written on {where}. The missing answer is {result}.")
    return captions, detailed, qas, "picture"


Puzzle = tuple[Callable, Callable]
PUZZLES: dict[str, Puzzle] = {
    "clock": (_clock_spec, _clock_render),
    "rectangle": (_rect_spec, _rect_render),
    "right_triangle": (_rtri_spec, _rtri_render),
    "triangle_angles": (_tri_spec, _tri_render),
    "angle": (_angle_spec, _angle_render),
    "segment": (_segment_spec, _segment_render),
    "dice": (_dice_spec, _dice_render),
    "arithmetic": (_arith_spec, _arith_render),
}
PUZZLE_WEIGHTS = {"clock": 3, "rectangle": 2, "right_triangle": 1, "triangle_angles": 1, "angle": 1,
                  "segment": 1, "dice": 2, "arithmetic": 2}


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One ``math`` image; ``meta["puzzle"]`` names the puzzle type."""
    names = list(PUZZLES)
    weights = np.array([PUZZLE_WEIGHTS[n] for n in names], dtype=float)
    puzzle = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    spec, render = PUZZLES[puzzle]
    key, params = draw_for_split(rng, split, spec)
    bg = BACKGROUNDS[pick(rng, list(BACKGROUNDS))]
    canvas = Canvas(size, jitter(rng, bg, 5))
    captions, detailed, qas, subject = render(rng, canvas, params)
    meta = {"key": key, "puzzle": puzzle, "params": list(params)}
    return Content(canvas.finish(), [sentence(c) for c in captions], detailed, qas, subject, meta)
