"""Shared machinery of the caption / VQA generator: samples, seeding, splits, prompts.

Every family module turns a seeded :class:`numpy.random.Generator` into a :class:`Content`
(one image plus everything true about it: captions, a detailed description, question/answer
pairs and metadata).  :func:`compose_sample` then picks *one* prompt/answer pair from it, so
the prompt wording and the task kind vary per sample while the family code stays free of
prompt logic.

Split hygiene has two layers:

1. The per-sample seed is a hash of ``(family, split, index)``, so the three splits draw
   different random streams.
2. The *content* of templated items is assigned to a split by a hash of a canonical content
   key (:func:`split_of`).  A family draws candidate contents until one lands in the requested
   split (:func:`draw_for_split`), so e.g. a clock time, a chart's data or a sign's words that
   occur in the test split never occur in the training split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
from PIL import Image

SPLITS = ("train", "validation", "test")
KINDS = ("caption", "short", "detailed")

# Fraction of the content space given to each split by :func:`split_of`.
SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}

# How often each kind of task is drawn (per family, unless the content lacks that kind).
KIND_WEIGHTS = {"caption": 0.3, "short": 0.55, "detailed": 0.15}

# Probability that a question with distractors is shown as multiple choice (SEED/MMT/ScienceQA
# style, answered with the option letter).
MULTIPLE_CHOICE_RATE = 0.3

CAPTION_PROMPTS = (
    "Describe the image.",
    "What is in this picture?",
    "Write a short caption for this image.",
    "Caption this image.",
    "What does this image show?",
    "Give a brief description of the picture.",
    "Describe this image in one sentence.",
    "What do you see in this image?",
    "Provide a short caption.",
    "Summarize the image in one sentence.",
)
# Used when the content names its subject ("chart", "clock", "sign", ...).
SUBJECT_CAPTION_PROMPTS = (
    "Describe this {subject}.",
    "What does this {subject} show?",
    "Write a one-sentence description of the {subject}.",
)
DETAILED_PROMPTS = (
    "Describe the image in detail.",
    "Give a detailed description of this picture.",
    "Describe everything you can see in this image.",
    "Write a detailed description of the image.",
    "Explain what this image shows in detail.",
    "Can you describe this picture thoroughly?",
)
# Appended to open questions whose answer is a word or short phrase.
PHRASE_SUFFIXES = (" Answer with a single word or phrase.", " Answer briefly.")
NUMBER_SUFFIXES = (" Answer with a number.", " Give just the number.")
MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."


@dataclass
class Sample:
    """One training example.

    Attributes:
        image: RGB image, ``size x size``.
        prompt: the user turn (question or instruction).
        answer: the target assistant turn.
        family: one of :data:`mmspec.train.data.FAMILIES`.
        kind: ``"caption"``, ``"short"`` (question answering) or ``"detailed"``.
        meta: JSON-serialisable facts about the image (drawn objects, chart data, rendered
            text, the content key that decided the split, ...), for tests and analysis.
    """

    image: Image.Image
    prompt: str
    answer: str
    family: str
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class QA:
    """A question about an image with its answer.

    Attributes:
        question: the question, ending with "?" (or an imperative ending with ".").
        answer: the short answer ("Red", "3", "The blue square", "OPEN").
        distractors: plausible wrong answers; when given, the question may be shown as
            multiple choice.  Leave empty when the options would leak the answer (OCR).
        tag: a machine-readable question type, e.g. ``"chart.max"``, used by tests.
    """

    question: str
    answer: str
    distractors: Sequence[str] = ()
    tag: str = ""


@dataclass
class Content:
    """Everything a family generator knows about one image.

    Attributes:
        image: the rendered RGB image.
        captions: one-sentence captions (5-25 words), any of which is a correct answer to a
            caption prompt.
        detailed: a longer multi-sentence description.
        qas: question/answer pairs that are all true for the image.
        subject: optional noun for subject-specific caption prompts ("chart", "clock").
        meta: JSON-serialisable facts for tests; ``meta["key"]`` is the content key.
    """

    image: Image.Image
    captions: list[str]
    detailed: str
    qas: list[QA]
    subject: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same on every machine and Python run."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def sample_rng(family: str, split: str, index: int) -> np.random.Generator:
    """The random stream of sample ``index`` of ``family`` in ``split`` (no global state)."""
    return np.random.default_rng(stable_hash(f"mmspec-caption-data|{family}|{split}|{index}"))


def split_of(key: str) -> str:
    """The split that owns the content described by ``key`` (a canonical string).

    Deterministic: the same content always belongs to the same split, so contents owned by
    ``"test"`` can never be generated for ``"train"``.
    """
    u = stable_hash(f"mmspec-split|{key}") / 2.0**64
    edge = 0.0
    for split in SPLITS:
        edge += SPLIT_FRACTIONS[split]
        if u < edge:
            return split
    return SPLITS[-1]


def check_split(split: str) -> None:
    """Raise ``ValueError`` for an unknown split name."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


T = TypeVar("T")


def parse_names(text: str | None, known: Sequence[str], option: str) -> tuple[str, ...]:
    """``--OPTION a,b`` (None: all of ``known``) -> the names, each checked against ``known``."""
    if text is None:
        return tuple(known)
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{option}: unknown {unknown or text!r}; choose from {', '.join(known)}")
    return names


def check_request(name: str, known, what: str, split: str, size: int) -> None:
    """Refuse an unknown ``name`` (of ``known``; ``what``: "family", "render kind"), an unknown
    split or an image side below 16 pixels, in one line each."""
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    check_split(split)
    if size < 16:
        raise ValueError(f"size must be at least 16 pixels, got {size}")


def draw_for_split(
    rng: np.random.Generator,
    split: str,
    draw: Callable[[np.random.Generator], tuple[str, T]],
    max_tries: int = 2000,
) -> tuple[str, T]:
    """Draw ``(key, spec)`` pairs with ``draw`` until ``split_of(key) == split``.

    ``draw`` must be cheap (no rendering): the expected number of calls is
    ``1 / SPLIT_FRACTIONS[split]`` (10 for validation and test).
    """
    for _ in range(max_tries):
        key, spec = draw(rng)
        if split_of(key) == split:
            return key, spec
    raise RuntimeError(f"no content for split {split!r} after {max_tries} draws")


def split_pool(items: Sequence[str], split: str, namespace: str) -> list[str]:
    """The members of ``items`` that belong to ``split`` (e.g. words reserved for test)."""
    pool = [item for item in items if split_of(f"{namespace}|{item}") == split]
    if not pool:
        raise ValueError(f"split {split!r} owns no item of {namespace!r}")
    return pool


def pick(rng: np.random.Generator, items: Sequence[T]) -> T:
    """A uniformly random element of ``items``."""
    return items[int(rng.integers(len(items)))]


def is_number(text: str) -> bool:
    """True for answers such as "3", "-2" or "12.5"."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _question_prompt(rng: np.random.Generator, qa: QA) -> tuple[str, str]:
    """Render ``qa`` as an open question or, if it has distractors, sometimes as multiple choice."""
    distractors = list(dict.fromkeys(d for d in qa.distractors if d != qa.answer))
    if distractors and rng.random() < MULTIPLE_CHOICE_RATE:
        n_wrong = min(len(distractors), int(rng.integers(1, 4)))
        wrong = [distractors[i] for i in rng.permutation(len(distractors))[:n_wrong]]
        options = wrong + [qa.answer]
        order = rng.permutation(len(options))
        letters = "ABCD"
        lines = [f"{letters[i]}. {options[j]}" for i, j in enumerate(order)]
        answer_letter = letters[int(np.flatnonzero(order == len(options) - 1)[0])]
        return "\n".join([qa.question, *lines, MC_INSTRUCTION]), answer_letter
    suffix = ""
    if rng.random() < 0.3:
        if is_number(qa.answer):
            suffix = pick(rng, NUMBER_SUFFIXES)
        elif len(qa.answer.split()) <= 4:
            suffix = pick(rng, PHRASE_SUFFIXES)
    return qa.question + suffix, qa.answer


def compose_sample(rng: np.random.Generator, family: str, content: Content) -> Sample:
    """Choose a task kind, a prompt and its answer for ``content``."""
    available = {
        "caption": bool(content.captions),
        "short": bool(content.qas),
        "detailed": bool(content.detailed),
    }
    kinds = [k for k in KINDS if available[k]]
    weights = np.array([KIND_WEIGHTS[k] for k in kinds])
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    meta = dict(content.meta)
    if kind == "caption":
        prompts = list(CAPTION_PROMPTS)
        if content.subject:
            prompts += [p.format(subject=content.subject) for p in SUBJECT_CAPTION_PROMPTS]
        prompt, answer = pick(rng, prompts), pick(rng, content.captions)
    elif kind == "detailed":
        prompt, answer = pick(rng, DETAILED_PROMPTS), content.detailed
    else:
        qa = pick(rng, content.qas)
        prompt, answer = _question_prompt(rng, qa)
        meta["qa"] = {"question": qa.question, "answer": qa.answer, "tag": qa.tag}
    return Sample(content.image, prompt, answer, family, kind, meta)


def yes_no(question: str, truth: bool, tag: str = "") -> QA:
    """A yes/no question whose distractor is the opposite answer."""
    return QA(question, "Yes" if truth else "No", ("No" if truth else "Yes",), tag)


# -- small English helpers shared by the families -------------------------------------------

NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen"
).split()


def number_word(n: int) -> str:
    """``3 -> "three"`` for small numbers, digits otherwise."""
    return NUMBER_WORDS[n] if 0 <= n < len(NUMBER_WORDS) else str(n)


def article(phrase: str) -> str:
    """``"apple" -> "an apple"``, ``"red circle" -> "a red circle"``."""
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase


def join_words(items: Sequence[str]) -> str:
    """``["a", "b", "c"] -> "a, b and c"``."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def sentence(text: str) -> str:
    """Capitalise the first letter and make sure the text ends with a full stop."""
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def capitalize(text: str) -> str:
    """Capitalise only the first letter (unlike ``str.capitalize``)."""
    return text[:1].upper() + text[1:]
