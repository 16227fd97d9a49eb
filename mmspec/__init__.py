"""mmspec: fast autoregressive multimodal generation with one speculative draft/verify core.

The names below load on first use (PEP 562), so that ``import mmspec.cli`` -- the ``mmspec``
command's entry -- is quick and a Ctrl-C while PyTorch and transformers load is the command's
one line, not a traceback from inside the import."""

import importlib
import os

__version__ = "0.1.0"
__all__ = ["GenerateOutput", "SamplingConfig", "SpecStats", "generate", "optimize", "pipeline", "__version__"]

#: public name -> the module that defines it
_HOMES = {"GenerateOutput": ".api", "generate": ".api", "SamplingConfig": ".core.sampling", "SpecStats": ".core.stats",
          "optimize": ".modeling.fast_linear", "pipeline": ".pipelines"}


#: subpackages reached as attributes (``mmspec.hub.load_causal_lm(...)`` on a fresh ``import mmspec``)
_SUBMODULES = {"adapters", "api", "bench", "cli", "core", "cpu", "drafters", "hub", "metrics", "modeling", "pipelines",
               "serve", "train"}


#: the package's folder: a frame or a warning from a file under it is mmspec's own
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def in_package(filename: str) -> bool:
    """Whether the file ``filename`` lies under :data:`PACKAGE_DIR` (a warning's or a frame's)."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)  # (the import binds it in this module)
    if name not in _HOMES:
        raise AttributeError(f"module 'mmspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES, *_SUBMODULES})
