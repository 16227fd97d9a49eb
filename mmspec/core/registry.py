"""Registries of classes by name: rules, codecs, methods, ... each a dict ``name -> class`` filled
by a class decorator made here, so every registry refuses the same mistakes the same way."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T", bound=type)
F = TypeVar("F", bound=Callable)


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


def factory_registrar(registry: dict[str, Callable], kind: str) -> Callable[[str], Callable[[F], F]]:
    """``register(name)``: a decorator registering a factory as ``registry[name]``, refusing a taken
    name as :func:`class_registrar` does (for registries of functions rather than classes)."""
    def register(name: str) -> Callable[[F], F]:
        def wrap(factory: F) -> F:
            if name in registry:
                raise ValueError(f"a {kind} named {name!r} is already registered")
            registry[name] = factory
            return factory

        return wrap

    return register


def build_named(registry: dict[str, Callable], kind: str, name: str):
    """``registry[name]()``, or one ValueError line naming the known entries."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(registry)}")
    return registry[name]()
