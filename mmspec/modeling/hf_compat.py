"""transformers 5.x renamed its models' ``past_key_values`` argument to ``cache`` (the old name
warns until it goes, in 5.40): every call of mmspec into a transformers model passes its cache by
the name the installed version's ``forward`` takes (the tests turn the warning into an error)."""

from __future__ import annotations

import inspect
from functools import lru_cache

from torch import nn


@lru_cache(maxsize=None)
def _cache_name(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model: nn.Module, cache) -> dict:
    """{name: cache} for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {_cache_name(type(model)): cache}
