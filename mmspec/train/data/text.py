"""``text`` family (OCRBench-like): signs, price tags, receipts, plates, notes, street signs.

The answer to every reading question is text rendered in the image and never appears in the
prompt, so a model can only get it right by reading.  Reading questions carry no
multiple-choice distractors for the same reason.

Split rule: every word, price and number is owned by one split (:func:`~.core.split_pool`),
and license plates are gated as a whole, so test images show only words, prices and numbers
that no training image shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .core import QA, Content, article, capitalize, pick, sentence, split_of, split_pool
from .render import UNITS, Canvas, Color, jitter, shade
from .words import GROCERIES, STREET_SUFFIXES, word_list

MIN_FONT = 13.0  # units; keeps glyphs legible at 128 px

WHITE, BLACK = (248, 248, 248), (20, 20, 20)
# (name, board colour, text colour name, text colour)
SIGN_COLORS = (
    ("green", (30, 120, 60), "white", WHITE),
    ("blue", (30, 70, 160), "white", WHITE),
    ("red", (190, 30, 30), "white", WHITE),
    ("white", (245, 245, 245), "black", BLACK),
    ("yellow", (240, 200, 30), "black", BLACK),
    ("black", (25, 25, 25), "yellow", (245, 210, 60)),
    ("brown", (110, 70, 35), "cream", (245, 235, 210)),
)
NOTE_COLORS = (("yellow", (250, 235, 120)), ("pink", (250, 190, 210)), ("green", (190, 235, 170)),
               ("blue", (185, 215, 245)), ("orange", (250, 200, 140)))
INKS = (("black", (25, 25, 25)), ("blue", (30, 50, 160)), ("red", (170, 20, 20)))
BOLD_FONTS = ("sans-bold", "serif-bold", "mono-bold")


@lru_cache(maxsize=None)
def _pools(split: str) -> dict[str, list[str]]:
    """Words, prices and numbers owned by ``split``."""
    prices = [f"{d}.{c:02d}" for d in range(50) for c in range(0, 100, 5) if d or c]
    return {
        "word": split_pool(word_list(), split, "text-word"),
        "price": split_pool(prices, split, "text-price"),
        "number": split_pool([str(n) for n in range(1, 1000)], split, "text-number"),
    }


@dataclass
class Pools:
    """Draws split-owned tokens."""

    split: str
    rng: np.random.Generator

    def word(self, max_len: int = 8) -> str:
        words = _pools(self.split)["word"]
        while True:
            w = pick(self.rng, words)
            if len(w) <= max_len:
                return w

    def price(self) -> str:
        return pick(self.rng, _pools(self.split)["price"])

    def owns_price(self, price: str) -> bool:
        return split_of(f"text-price|{price}") == self.split

    def number(self, max_value: int = 999) -> str:
        pool = [n for n in _pools(self.split)["number"] if int(n) <= max_value]
        return pick(self.rng, pool)


@dataclass
class Rendered:
    """What a layout drew: the exact text lines plus captions and questions."""

    lines: list[str]
    captions: list[str]
    detailed: str
    qas: list[QA]
    subject: str


def _case(rng: np.random.Generator, words: list[str], weights=(0.5, 0.35, 0.15)) -> list[str]:
    style = rng.choice(3, p=np.array(weights) / sum(weights))
    return [w.upper() if style == 0 else w.capitalize() if style == 1 else w.lower() for w in words]


def _outdoor_background(rng: np.random.Generator, canvas: Canvas) -> None:
    canvas.vertical_gradient(jitter(rng, (120, 170, 225), 15), jitter(rng, (205, 225, 245), 10), 0, 100)
    ground = pick(rng, [(90, 150, 70), (140, 140, 140), (170, 150, 110)])
    canvas.rect(0, 100, UNITS, UNITS, fill=jitter(rng, ground, 10))


def _wall_background(rng: np.random.Generator, canvas: Canvas) -> None:
    base = jitter(rng, pick(rng, [(200, 190, 175), (170, 180, 190), (215, 205, 190), (150, 110, 80)]), 10)
    canvas.vertical_gradient(shade(base, 1.08), shade(base, 0.9))


def _layout_lines(canvas: Canvas, words: list[str], font: str, max_w: float, max_h: float,
                  hi: float = 34.0) -> tuple[list[str], float] | None:
    """Put ``words`` on one line if it fits legibly, else one word per line."""
    one = [" ".join(words)]
    size = canvas.fit_font(one, font, max_w, max_h, lo=18.0 if len(words) > 1 else MIN_FONT, hi=hi)
    if size is not None:
        return one, size
    if len(words) > 1:
        size = canvas.fit_font(words, font, max_w, max_h, lo=MIN_FONT, hi=hi)
        if size is not None:
            return words, size
    return None


def _draw_lines(canvas: Canvas, lines: list[str], cx: float, cy: float, size: float, font: str,
                color: Color, spacing: float = 1.15) -> None:
    top = cy - size * spacing * (len(lines) - 1) / 2
    for i, line in enumerate(lines):
        canvas.text(cx, top + i * size * spacing, line, color, font, size)


def _sign(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    color, board, ink_name, ink = SIGN_COLORS[int(rng.integers(len(SIGN_COLORS)))]
    font = pick(rng, BOLD_FONTS)
    outdoor = rng.random() < 0.6
    (_outdoor_background if outdoor else _wall_background)(rng, canvas)
    n_words = int(rng.choice([1, 2, 3], p=[0.45, 0.4, 0.15]))
    w = float(rng.uniform(100, 120))
    while True:
        words = _case(rng, [pools.word() for _ in range(n_words)])
        fitted = _layout_lines(canvas, words, font, w - 14, 80)
        if fitted:
            break
    lines, size = fitted
    h = size * 1.15 * len(lines) + 16
    cx, cy = UNITS / 2 + float(rng.uniform(-3, 3)), UNITS / 2
    if outdoor and h / 2 + 4 < 92 - h / 2:  # leave some of the posts visible above the ground
        cy = float(rng.uniform(h / 2 + 4, 92 - h / 2))
    if outdoor:  # two posts down to the ground
        for px in (cx - w / 3, cx + w / 3):
            canvas.rect(px - 2.5, cy, px + 2.5, 112, fill=(110, 110, 115))
    canvas.rect(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, fill=jitter(rng, board, 8),
                outline=shade(board, 0.6) if color != "black" else (200, 200, 200), width=2, radius=4)
    if rng.random() < 0.5:  # inner border line
        canvas.rect(cx - w / 2 + 4, cy - h / 2 + 4, cx + w / 2 - 4, cy + h / 2 - 4, outline=ink, width=1.2, radius=3)
    _draw_lines(canvas, lines, cx, cy, size, font, ink)
    text = " ".join(lines)
    place = "on two posts outdoors" if outdoor else "on a wall"
    qas = [QA(pick(rng, ["What does the sign say?", "What is written on the sign?", "Read the text on the sign.",
                         "What text is shown in the image?"]), text, tag="text.read"),
           QA("What color is the sign?", capitalize(color),
              [capitalize(c[0]) for c in SIGN_COLORS if c[0] != color], "text.color")]
    captions = [f'A {color} sign that says "{text}".', f'A {color} sign {place} reading "{text}".',
                f'A sign with the words "{text}" in {ink_name} letters.']
    detailed = (f'A rectangular {color} sign {place}. It reads "{text}" in large {ink_name} letters'
                f'{" over " + str(len(lines)) + " lines" if len(lines) > 1 else ""}.')
    return Rendered(lines, captions, detailed, qas, "sign")


def _price_tag(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    _wall_background(rng, canvas)
    tag_name, tag = pick(rng, [("white", (248, 248, 240)), ("yellow", (250, 225, 90)), ("orange", (250, 170, 80))])
    font = pick(rng, BOLD_FONTS)
    while True:
        item, price = pools.word(7).capitalize(), "$" + pools.price()
        s_item = canvas.fit_font([item], font, 76, 30, lo=MIN_FONT, hi=20)
        s_price = canvas.fit_font([price], font, 78, 40, lo=18, hi=30)
        if s_item and s_price:
            break
    x0, y0, x1, y1 = 16, 26, 112, 104
    canvas.polygon([(x0 + 14, y0), (x1, y0), (x1, y1), (x0 + 14, y1), (x0, (y0 + y1) / 2)],
                   fill=jitter(rng, tag, 6), outline=(90, 90, 90), width=1.5)
    canvas.ellipse(x0 + 10, (y0 + y1) / 2, 3.5, 3.5, fill=shade(tag, 0.7))
    cx = (x0 + 14 + x1) / 2
    canvas.text(cx, 46, item, BLACK, font, s_item)
    canvas.text(cx, 80, price, (190, 20, 20) if rng.random() < 0.5 else BLACK, font, s_price)
    qas = [QA(pick(rng, ["What is the price on the tag?", "How much does the item cost?", "What price is shown?"]),
              price, tag="text.read"),
           QA(pick(rng, ["What item is the tag for?", "What product name is on the tag?"]), item, tag="text.read")]
    captions = [f"{article(tag_name)} price tag for {item} marked {price}.", f"A price tag that reads {item}, {price}."]
    detailed = (f"{capitalize(article(tag_name))} price tag with a small hole at its pointed end hangs against "
                f"a plain wall. "
                f'The product name "{item}" is printed at the top and the price {price} below it in larger type.')
    return Rendered([item, price], captions, detailed, qas, "price tag")


def _receipt(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    canvas.vertical_gradient(jitter(rng, (120, 85, 55), 12), jitter(rng, (90, 60, 40), 12))
    store = pools.word(7).upper()
    while True:
        items = [str(s) for s in rng.choice([g for g in GROCERIES if len(g) <= 6], size=2, replace=False)]
        prices = [pools.price() for _ in items]
        total = f"{sum(float(p) for p in prices):.2f}"
        if float(total) < 50 and pools.owns_price(total) and all(float(p) < 20 for p in prices):
            break
    size = 11.0
    x0, x1, top = 16, 112, 6
    canvas.rect(x0, top, x1, UNITS + 5, fill=jitter(rng, (250, 250, 245), 4), outline=(200, 200, 195))
    canvas.text((x0 + x1) / 2, top + 13, store, BLACK, "sans-bold", 14)
    body = [(item, "$" + p) for item, p in zip(items, prices)] + [("TOTAL", "$" + total)]
    for i, (left, right) in enumerate(body):
        y = top + 38 + i * 18 + (8 if left == "TOTAL" else 0)
        name = "mono-bold" if left == "TOTAL" else "mono"
        canvas.text(x0 + 5, y, left, BLACK, name, size, anchor="lm")
        canvas.text(x1 - 5, y, right, BLACK, name, size, anchor="rm")
    y_rule = top + 38 + 2 * 18 - 5
    canvas.line([(x0 + 5, y_rule), (x1 - 5, y_rule)], (90, 90, 90), 1)
    lines = [store] + [f"{left} {right}" for left, right in body]
    k = int(rng.integers(len(items)))
    qas = [QA(pick(rng, ["What is the total on the receipt?", "What is the total amount?",
                         "How much was paid in total?"]), "$" + total, tag="text.read"),
           QA(pick(rng, ["What is the name of the store?", "Which store is this receipt from?"]), store,
              tag="text.read"),
           QA(f"How much did the {items[k].lower()} cost?", "$" + prices[k], tag="text.read")]
    captions = [f"A receipt from {store} with a total of ${total}.",
                f"A store receipt listing {items[0].lower()} and {items[1].lower()}, total ${total}."]
    detailed = (f"A white paper receipt lies on a wooden table. The store name {store} is printed at the top, "
                f"followed by {items[0].lower()} for ${prices[0]} and {items[1].lower()} for ${prices[1]}. "
                f"The total at the bottom is ${total}.")
    return Rendered(lines, captions, detailed, qas, "receipt")


def _draw_plate_text(rng: np.random.Generator, split: str) -> str:
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
    while True:
        text = "".join(pick(rng, letters) for _ in range(3)) + " " + "".join(str(d) for d in rng.integers(0, 10, 3))
        if split_of(f"text-plate|{text}") == split:
            return text


def _plate(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    canvas.vertical_gradient(*(jitter(rng, c, 15) for c in pick(rng, [((60, 70, 90), (30, 35, 45)),
                                                                          ((160, 30, 30), (90, 15, 15)),
                                                                          ((200, 200, 205), (120, 120, 125))])))
    plate_name, plate, ink = pick(rng, [("white", (245, 245, 240), (20, 30, 120)),
                                        ("yellow", (245, 210, 40), BLACK), ("white", (245, 245, 240), BLACK)])
    text = _draw_plate_text(rng, pools.split)
    canvas.rect(8, 38, 120, 90, fill=plate, outline=(40, 40, 40), width=2.5, radius=5)
    size = canvas.fit_font([text], "mono-bold", 100, 40, lo=MIN_FONT, hi=24)
    canvas.text(64, 65, text, ink, "mono-bold", size)
    for bx in (20, 108):  # screws
        canvas.ellipse(bx, 45, 2, 2, fill=(150, 150, 150))
    qas = [QA(pick(rng, ["What is the license plate number?", "What does the license plate say?",
                         "Read the license plate."]), text, tag="text.read"),
           QA("What color is the license plate?", capitalize(plate_name),
              ["Yellow" if plate_name == "white" else "White", "Blue", "Green"], "text.color")]
    captions = [f'A {plate_name} license plate with the number "{text}".', f'A car license plate reading "{text}".']
    detailed = (f'A close-up of a {plate_name} car license plate with a dark border and two screws. '
                f'It shows the registration "{text}" in bold block letters.')
    return Rendered([text], captions, detailed, qas, "license plate")


def _note(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    _wall_background(rng, canvas)
    note_name, note = NOTE_COLORS[int(rng.integers(len(NOTE_COLORS)))]
    ink_name, ink = INKS[int(rng.integers(len(INKS)))]
    font = pick(rng, ["serif-italic", "sans", "serif"])
    layer = canvas.layer()
    layer.rect(16, 16, 112, 112, fill=jitter(rng, note, 6) + (255,))
    layer.rect(16, 16, 112, 26, fill=shade(note, 0.92) + (255,))
    n_words = int(rng.choice([1, 2], p=[0.5, 0.5]))
    while True:
        words = _case(rng, [pools.word() for _ in range(n_words)], weights=(0.2, 0.4, 0.4))
        fitted = _layout_lines(layer, words, font, 86, 78, hi=30)
        if fitted:
            break
    lines, size = fitted
    _draw_lines(layer, lines, 64, 68, size, font, ink + (255,))
    canvas.paste_rotated(layer, float(rng.uniform(-7, 7)))
    text = " ".join(lines)
    qas = [QA(pick(rng, ["What is written on the note?", "What does the note say?",
                         "Read the handwriting on the sticky note."]), text, tag="text.read"),
           QA("What color is the note?", capitalize(note_name),
              [capitalize(c[0]) for c in NOTE_COLORS if c[0] != note_name], "text.color")]
    captions = [f'{article(note_name)} sticky note with "{text}" written on it.',
                f'{article(note_name)} note on a wall that says "{text}" in {ink_name} ink.']
    detailed = (f'A square {note_name} sticky note is stuck slightly crooked on a wall. '
                f'The words "{text}" are written across it in {ink_name} ink.')
    return Rendered(lines, captions, detailed, qas, "note")


def _street_sign(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    _outdoor_background(rng, canvas)
    while True:
        text = f"{pools.word(7).capitalize()} {pick(rng, STREET_SUFFIXES)}"
        size = canvas.fit_font([text], "sans-bold", 104, 30, lo=MIN_FONT + 1, hi=24)
        if size:
            break
    cy = float(rng.uniform(30, 50))
    canvas.rect(61, cy, 67, 112, fill=(120, 120, 125))
    canvas.rect(6, cy - 16, 122, cy + 16, fill=jitter(rng, (20, 110, 60), 8), outline=WHITE, width=1.5, radius=3)
    canvas.text(64, cy, text, WHITE, "sans-bold", size)
    qas = [QA(pick(rng, ["What street is named on the sign?", "What is the name of the street?",
                         "What does the street sign say?"]), text, tag="text.read")]
    captions = [f"A green street sign for {text} on a pole.", f'A street sign that reads "{text}".']
    detailed = (f"A green street name sign is mounted on a gray pole outdoors under a blue sky. "
                f'It reads "{text}" in white letters.')
    return Rendered([text], captions, detailed, qas, "street sign")


def _number_plaque(rng: np.random.Generator, pools: Pools, canvas: Canvas) -> Rendered:
    _wall_background(rng, canvas)
    label, question, max_value = pick(rng, [("ROOM", "What is the room number?", 999),
                                            ("GATE", "What is the gate number?", 99),
                                            ("PLATFORM", "What platform number is shown?", 20),
                                            ("BUS", "What is the bus number?", 199),
                                            ("LOCKER", "What is the locker number?", 999)])
    number = pools.number(max_value)
    led = rng.random() < 0.5
    panel, ink = ((20, 20, 20), (250, 170, 30)) if led else (jitter(rng, (235, 230, 215), 8), BLACK)
    canvas.rect(14, 24, 114, 104, fill=panel, outline=(80, 80, 80), width=2, radius=6)
    canvas.text(64, 44, label, ink, "sans-bold", canvas.fit_font([label], "sans-bold", 88, 20, lo=MIN_FONT, hi=18))
    canvas.text(64, 78, number, ink, "mono-bold", 34)
    kind = "an illuminated display" if led else "a plaque"
    qas = [QA(question, number, tag="text.read")]
    captions = [f"{capitalize(kind)} showing {label.lower()} {number}.", f'A sign that reads "{label} {number}".']
    detailed = (f"{capitalize(kind)} on a wall shows the word {label} in capital letters with the number "
                f"{number} in large digits underneath.")
    return Rendered([label, number], captions, detailed, qas, "sign")


LAYOUTS = {
    "sign": _sign,
    "price_tag": _price_tag,
    "receipt": _receipt,
    "plate": _plate,
    "note": _note,
    "street_sign": _street_sign,
    "number": _number_plaque,
}


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One ``text`` image; ``meta["lines"]`` holds the exact rendered text lines."""
    layout = pick(rng, list(LAYOUTS))
    canvas = Canvas(size, (255, 255, 255))
    r = LAYOUTS[layout](rng, Pools(split, rng), canvas)
    meta = {"key": f"text|{layout}|{'|'.join(r.lines)}", "layout": layout, "lines": r.lines}
    return Content(canvas.finish(), [sentence(c) for c in r.captions], r.detailed, r.qas, r.subject, meta)
