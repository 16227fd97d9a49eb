"""Argument types checked against a function's annotations, one ValueError line each.

The pipelines' calls, the presets' ``[call]`` tables and :func:`mmspec.generate` take plain values
(numbers, flags, strings). A value of the wrong type (``temperature="hot"``, ``seed="x"``) used
to reach the model code and fail there with a TypeError deep in a stack; here it is refused before
any model work, with the parameter's name and the type it takes::

    check_argument_types(pipeline_call, {"temperature": "hot"})
    # ValueError: temperature must be a number or None, got 'hot' (str)

Only parameters whose annotation is made of ``int``, ``float``, ``bool``, ``str`` and ``None``
(``float | None``, ``int``, ...) are checked; anything else (``str | Sequence[str]``, a callable, a
class) is left to the function's own checks. ``float`` takes integers too (PEP 484's numeric
tower); ``int`` takes any integral number (``numpy.int64``) but not a bool, and no type takes a
bool but ``bool`` itself.
"""

from __future__ import annotations

import inspect
import numbers
import types
import typing
from typing import Any, Callable

import numpy as np

#: annotation name -> (whether a value is of that type, how the error line names it)
SIMPLE_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "None": (lambda v: v is None, "None"),
}


def simple_type_names(annotation: Any) -> tuple[str, ...] | None:
    """An annotation (a string under ``from __future__ import annotations``, or a type) -> the
    names of its members when every one is in :data:`SIMPLE_TYPES` (``"float | None"`` ->
    ("float", "None")), else None (not checked here)."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        names = tuple(part.strip() for part in annotation.split("|"))
    else:
        members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
        names = tuple("None" if m is type(None) or m is None else getattr(m, "__name__", repr(m)) for m in members)
    return names if all(name in SIMPLE_TYPES for name in names) else None


def check_argument_types(function: Callable[..., Any], values: dict[str, Any], where: str = "") -> None:
    """Refuse a value whose type its parameter's annotation does not allow (see the module doc).

    Args:
        function: whose signature's annotations are checked (a decorated function's original
            signature, through ``__wrapped__``).
        values: parameter name -> value; names that are not parameters, or whose annotation is not
            simple, are skipped.
        where: what the line starts with, e.g. "preset tts (pipelines/tts.toml): [call] ".
    Raises:
        ValueError: ``{where}{name} must be {types}, got {value!r} ({type})``.
    """
    parameters = inspect.signature(function).parameters
    for name, value in values.items():
        parameter = parameters.get(name)
        names = simple_type_names(parameter.annotation) if parameter is not None else None
        if names is None or any(SIMPLE_TYPES[n][0](value) for n in names):
            continue
        expected = " or ".join(SIMPLE_TYPES[n][1] for n in names)
        raise ValueError(f"{where}{name} must be {expected}, got {value!r} ({type(value).__name__})")


def plain(value: Any) -> Any:
    """A numpy scalar (``np.int64(3)``, ``np.bool_(True)``, ``np.float32(0.5)``) as the Python
    number it holds (torch's generators and JSON take no numpy integers); anything else as is."""
    return value.item() if isinstance(value, np.generic) else value
