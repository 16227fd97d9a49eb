"""Issue 47: the voice's hand-written held-out sentences and the check that keeps them out of training text."""

import re

from mmspec.adapters.audio.normalize import make_normalizer
from mmspec.train.data import held_out
from mmspec.train.data.sentences import sentence, vocabulary


def test_the_split_is_hand_written_varied_and_sayable():
    sentences = held_out.test_sentences()
    assert held_out.SOURCE.read_text(encoding="utf-8").startswith("# source: hand-written\n")
    assert len(sentences) >= 220
    assert len({held_out.sentence_key(s) for s in sentences}) == len(sentences)  # no sentence twice
    words = [len(s.split()) for s in sentences]
    assert min(words) <= 4 and max(words) >= 20 and max(words) <= 25
    assert sum(s.endswith("?") for s in sentences) >= 20 and sum(s.endswith("!") for s in sentences) >= 15
    assert sum(bool(re.search(r"\d", s)) for s in sentences) >= 30  # numbers, dates, money, times
    known = vocabulary()
    normalizer = make_normalizer("english")
    for s in sentences:
        assert not set(held_out.sentence_key(s).split()) <= known, s  # never inside the shapes-and-counts grammar
        said = normalizer(s)
        assert said.dropped == () and said.text and not re.search(r"\d", said.text), s


def test_held_out_sentences_never_come_from_the_training_text():
    assert held_out.is_held_out("IS THIS SEAT TAKEN") and held_out.is_held_out("  is this seat taken?! ")
    assert not held_out.is_held_out("Is this seat free?")
    assert not any(held_out.is_held_out(sentence("train", i)) for i in range(2000))
    first = held_out.test_sentences()
    first.clear()
    assert len(held_out.test_sentences()) >= 220  # a new list each call
