"""Registries of classes by name: rules, codecs, methods, ... each a dict ``name -> class`` filled
by a class decorator made here, so every registry refuses the same mistakes the same way."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T", bound=type)


def class_registrar(registry: dict[str, type], kind: str, required: Iterable[str] = ("name",),
                    reserved: Iterable[str] = ()) -> Callable[[T], T]:
    """A class decorator registering ``cls`` as ``registry[cls.name]``.

    Args:
        registry: the dict to fill.
        kind: what a class is, for the messages ("acceptance rule", "codec", ...).
        required: class attributes that must be set (non-empty) to register.
        reserved: names no class may take (e.g. "auto").
    Raises:
        ValueError: a required attribute is missing, or the name is taken or reserved.
    """
    required, reserved = tuple(required), tuple(reserved)

    def register(cls: T) -> T:
        missing = [name for name in required if not getattr(cls, name, None)]
        if missing:
            raise ValueError(f"{cls.__name__} needs {' and '.join(missing)} to be registered as a {kind}")
        if cls.name in registry or cls.name in reserved:
            raise ValueError(f"a {kind} named {cls.name!r} is already registered")
        registry[cls.name] = cls
        return cls

    return register
