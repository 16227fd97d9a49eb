"""Prompt lookup's n-gram index against a brute-force reference."""

import random

import pytest

from mmspec.drafters.prompt_lookup import NgramIndex


def brute_force(tokens, max_ngram, min_ngram, k, prefer):
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        starts = [i for i in range(0, length - n) if tokens[i : i + n] == suffix]  # occurrences ending before L-1
        if starts:
            start = starts[-1] if prefer == "recent" else starts[0]
            return tokens[start + n : start + n + k]
    return []


def test_hand_built():
    index = NgramIndex(3)
    index.extend([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6])
    # suffix (5, 6) occurred at 0-1 and 5-6; the most recent copy continues with 7 9 2
    assert index.continuation(3, 1, 3, "recent") == [7, 9, 2]
    assert index.continuation(3, 1, 3, "earliest") == [7, 8, 1]
    assert index.continuation(3, 1, 10, "earliest") == [7, 8, 1, 5, 6, 7, 9, 2, 5, 6]
    fresh = NgramIndex(2)
    fresh.extend([1, 2, 3])
    assert fresh.continuation(2, 1, 4) == []  # 3 never occurred before


@pytest.mark.parametrize("prefer", ["recent", "earliest"])
def test_matches_brute_force_incrementally(prefer):
    rng = random.Random(0)
    for trial in range(40):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]
        index = NgramIndex(3)
        for cut in range(1, len(tokens) + 1):
            index.extend(tokens[len(index.tokens) : cut])
            assert index.continuation(3, 1, 5, prefer) == brute_force(tokens[:cut], 3, 1, 5, prefer)
