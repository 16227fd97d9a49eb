"""The one spec syntax's parser: ``name[:key=value,key=value...]`` with a short form ``name:value``
(module doc of :mod:`mmspec.pipelines.methods`). Pure text; the methods and the drafter registry
check the keys and values."""

from __future__ import annotations

import re
from typing import NamedTuple


class MethodSpec(NamedTuple):
    """A parsed ``name[:argument][,key=value...]`` (values still text).

    Attributes:
        name: the method's name (or an alias).
        argument: the short form's value ("sjd:vertical" -> "vertical"), or None.
        pairs: (key, value) in order; a malformed item is (item, None).
    """

    name: str
    argument: str | None
    pairs: tuple[tuple[str, str | None], ...]


def parse_spec(spec: str) -> MethodSpec:
    """Split a method spec (see the module doc); the method's class checks the keys and values.

    Raises:
        ValueError: an empty spec or name.
    """
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"a method spec is a string, got {spec!r} ({type(spec).__name__}); write name[:key=value,...], "
                         "e.g. 'sjd:vertical'")
    if not isinstance(spec, str) or not spec.strip() or not spec.partition(":")[0].strip():
        raise ValueError(f"empty method spec {spec!r}; write name[:key=value,...], e.g. 'sjd:vertical'")
    name, colon, rest = spec.strip().partition(":")
    if not colon or not rest:
        return MethodSpec(name, None, ())
    if "=" not in rest:  # the short form: one value, kept whole
        return MethodSpec(name, rest, ())
    items = [item.strip() for item in re.split(r"[,:]", rest)]
    argument = items.pop(0) if "=" not in items[0] else None
    pairs = []
    for item in items:
        key, equals, value = item.partition("=")
        pairs.append((key.strip(), value.strip()) if key.strip() and equals else (item, None))
    return MethodSpec(name, argument or None, tuple(pairs))


def positive_int(text: str, what: str) -> int:
    """A spec's text -> an integer >= 1 (ValueError naming ``what`` otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {text!r}")
    return value
