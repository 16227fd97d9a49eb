"""Counts in printed messages: ``count(1, "row")`` is "1 row", ``count(3, "row")`` "3 rows".

One helper for every message that prints a number of things (rows skipped, sentences written,
files done), so that none says "1 rows"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1.

    Args:
        n: how many.
        noun: the singular ("row", "image", "data file").
        plural: the plural where it is not ``noun + "s"`` ("entries", "prompts x").

    Example:
        >>> count(1, "row"), count(0, "row"), count(2, "match", "matches")
        ('1 row', '0 rows', '2 matches')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
