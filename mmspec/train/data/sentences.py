"""The embedded voice's text domain: short English sentences about a small world of coloured
shapes, counts, places, times and the weather, from a fixed vocabulary of about 150 words.

Examples: "The small red circle is above the green star.", "There are seven blue squares.",
"Put the yellow heart next to the box.", "It is half past four and it is raining.".

The domain is deliberately narrow: a small codec LM trained on a few hours of one synthetic
voice can learn to say it intelligibly on a CPU, and held-out sentences are new combinations of
known words. Each sentence belongs to one split by a hash of its text
(:func:`mmspec.train.data.core.split_of`), so no test sentence is ever drawn for training.
"""

from __future__ import annotations

import numpy as np

from .core import check_split, draw_for_split, number_word, pick, sample_rng
from .render import COLORS, SHAPES

SIZES = ("small", "big", "tiny", "large")
PLACES = ("box", "table", "door", "window", "chair", "basket", "shelf", "lamp")
RELATIONS = ("above", "below", "next to", "behind", "in front of", "to the left of", "to the right of", "near")
VERBS = ("Put", "Move", "Place", "Bring", "Take")
WEATHER = ("raining", "sunny", "windy", "cold", "warm", "snowing", "cloudy")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_PLURAL = {"cross": "crosses"}


def _plural(shape: str) -> str:
    return _PLURAL.get(shape, shape + "s")


def _thing(rng: np.random.Generator) -> str:
    size = f"{pick(rng, SIZES)} " if rng.random() < 0.5 else ""
    return f"the {size}{pick(rng, list(COLORS))} {pick(rng, SHAPES)}"


def _relation(rng):
    return f"{_thing(rng).capitalize()} is {pick(rng, RELATIONS)} {_thing(rng) if rng.random() < 0.6 else 'the ' + pick(rng, PLACES)}."


def _count(rng):
    n = int(rng.integers(2, 13))
    return f"There are {number_word(n)} {pick(rng, list(COLORS))} {_plural(pick(rng, SHAPES))}."


def _command(rng):
    return f"{pick(rng, VERBS)} {_thing(rng)} {pick(rng, RELATIONS)} the {pick(rng, PLACES)}."


def _time(rng):
    hour = number_word(int(rng.integers(1, 13)))
    when = pick(rng, (f"{hour} o'clock", f"half past {hour}", f"quarter past {hour}", f"quarter to {hour}"))
    tail = pick(rng, (f" and it is {pick(rng, WEATHER)}", f" on {pick(rng, DAYS)}", ""))
    return f"It is {when}{tail}."


def _question(rng):
    return f"Is {_thing(rng)} {pick(rng, RELATIONS)} the {pick(rng, PLACES)}?"


FORMS = (_relation, _relation, _count, _command, _time, _question)


def sentence(split: str, index: int) -> str:
    """Sentence ``index`` of ``split`` (train / validation / test), deterministic."""
    check_split(split)
    rng = sample_rng("speech", split, index)

    def draw(rng):
        text = pick(rng, FORMS)(rng)
        return text.lower(), text

    return draw_for_split(rng, split, draw)[1]


def vocabulary() -> set[str]:
    """Every word the grammar can produce (lower case, punctuation stripped)."""
    words = {"the", "is", "there", "are", "it", "o'clock", "half", "past", "quarter", "to", "and", "on"}
    words |= set(SIZES) | set(COLORS) | set(SHAPES) | {_plural(s) for s in SHAPES} | set(WEATHER)
    words |= {w.lower() for w in DAYS + VERBS} | set(PLACES)
    words |= {w for r in RELATIONS for w in r.split()}
    words |= {number_word(n) for n in range(1, 13)}
    return words
