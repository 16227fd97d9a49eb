"""The ``Pipeline`` base every task pipeline shares, and the registry of tasks.

A task is a :class:`Pipeline` subclass registered by its ``task`` name (:func:`register_pipeline`,
a class registrar: a taken name is one ValueError line). What the base holds, so each task only
says what is its own:

- :meth:`Pipeline.check_arguments`: the construction arguments checked before any model loads
  (presets and the CLI call it too);
- :meth:`Pipeline.check_call_arguments`: a call's plain arguments (numbers, flags, strings) checked
  against ``__call__``'s annotations, one ValueError line (``temperature="hot"``, ``seed="x"``);
  every subclass's ``__call__`` runs it first, before any model work, and presets check their
  ``[call]`` tables with it;
- :attr:`Pipeline.methods`: the task's :class:`~mmspec.pipelines.methods.MethodRegistry`, and
  :meth:`Pipeline.make_method` (one spec syntax);
- :meth:`Pipeline.with_baseline`: warm-up once, plain decoding, then the method, in one call (the
  same way for every task, so ``stats.speedup`` compares like with like);
- :meth:`Pipeline.chunks` / :meth:`Pipeline.check_batch_size`: inputs decoded ``batch_size`` at a time;
- :meth:`Pipeline.progress_reporter`: progress through one callback type, :data:`ProgressCallback`
  (``progress=True``: a terminal bar);
- :meth:`Pipeline.run_config`: what every result's ``stats.config`` records about how it ran;
- :data:`PIPELINE_LOCK`: a pipeline's construction (with the default dtype float32), calls and
  stream steps hold it (:func:`mmspec.core.exclusive.exclusive`), so calls from several threads
  run one at a time, each giving what it gives alone.

Adding a task is an adapter (its model as the core's target), a components class (its parts,
loaded once), a method registry and one registration::

    @register_pipeline
    class VideoTokensPipeline(Pipeline):
        task = "video-tokens"
        methods = VIDEO_METHODS
        ...

``tests/test_pipeline_base.py`` builds such a task in a few lines.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import numbers
import sys
import warnings
from typing import Any, Callable, ClassVar, Iterator, Sequence, TypeVar

import numpy as np
import torch

from ..api import check_seed
from ..core.arguments import check_argument_types, plain
from ..core.exclusive import LOCK, exclusive, exclusive_steps, exclusively
from ..core.registry import class_registrar
from .methods import Method, MethodRegistry

R = TypeVar("R")

#: held (reentrant) while any pipeline of the process is built, called, or makes a stream's next
#: chunk, and by ``mmspec.generate``: :data:`mmspec.core.exclusive.LOCK` (why: that module)
PIPELINE_LOCK = LOCK

#: progress of a call: called with the units done so far (captions, images, frames)
ProgressCallback = Callable[[int], None]

#: task name -> its pipeline class (registered when its module is imported)
PIPELINES: dict[str, type["Pipeline"]] = {}
#: the built-in tasks -> the module that registers each, imported on first use (so a task's
#: dependencies load only when it is used); "module:Class" for a class registered the older way
TASK_MODULES: dict[str, str] = {
    "image-captioning": "mmspec.pipelines.captioning",
    "text-to-image": "mmspec.pipelines.text_to_image",
    "text-to-speech": "mmspec.pipelines.text_to_speech",
}
#: tasks of the design that have no pipeline yet
PLANNED_TASKS: tuple[str, ...] = ()

_register = class_registrar(PIPELINES, "task pipeline", required=("name", "task"))


def register_pipeline(cls: type["Pipeline"] | str, target: str | None = None) -> type["Pipeline"] | None:
    """Class decorator: register a :class:`Pipeline` subclass as ``cls.task``.

    The older form ``register_pipeline(task, "module:Class")`` still registers a class (taking the
    pipeline's keyword arguments) to import on first use; it is deprecated.

    Raises:
        ValueError: no ``task``, or a task already registered.
    """
    if isinstance(cls, str):
        warnings.warn("register_pipeline(task, 'module:Class') is deprecated; decorate a Pipeline subclass with "
                      "@register_pipeline", DeprecationWarning, stacklevel=2)
        if cls in PIPELINES or cls in TASK_MODULES:
            raise ValueError(f"a task pipeline named {cls!r} is already registered")
        TASK_MODULES[cls] = str(target)
        return None
    return _register(cls)


def known_tasks() -> list[str]:
    """Every task, registered or built in (not imported yet), sorted."""
    return sorted(set(PIPELINES) | set(TASK_MODULES))


def pipeline_class(task: str) -> type["Pipeline"]:
    """The pipeline class registered as ``task`` (a built-in task's module imported now).

    Raises:
        ValueError: an unknown task (the message lists the known ones).
    """
    if task not in PIPELINES and task in TASK_MODULES:
        module, _, name = TASK_MODULES[task].partition(":")
        imported = importlib.import_module(module)
        if name:  # the older "module:Class" registration
            PIPELINES.setdefault(task, getattr(imported, name))
    if task not in PIPELINES:
        planned = f" ({task!r} is planned but not available yet)" if task in PLANNED_TASKS else ""
        raise ValueError(f"unknown task {task!r}{planned}; known tasks: {', '.join(known_tasks())}")
    return PIPELINES[task]


class Pipeline:
    """Base of the task pipelines (see the module doc).

    A subclass sets :attr:`task` (its registry name) and :attr:`methods`, implements
    :meth:`check_arguments` and ``__call__``, and uses the helpers below.
    """

    #: the task's name in :data:`PIPELINES` (``mmspec.pipeline(task)``)
    task: ClassVar[str] = ""
    #: the task's methods (named by a spec in the one syntax)
    methods: ClassVar[MethodRegistry | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.task  # the registry's key
        for name in ("__call__", "stream"):  # the class's own __call__ (and stream): argument types checked first
            function = cls.__dict__.get(name)
            if function is not None:
                setattr(cls, name, _checking_types(function))
        init = cls.__dict__.get("__init__")
        if init is not None:
            setattr(cls, "__init__", exclusively(init, torch.float32))  # (it builds modules: mmspec.core.exclusive)

    def __repr__(self) -> str:
        """The pipeline's class, method, device and dtype (a subclass may say more)."""
        method, components = getattr(self, "method", None), getattr(self, "components", None)
        parts = [] if method is None else [f"method={method.name!r}"]
        for name in ("device", "dtype"):
            value = getattr(components, name, None)
            if value is not None:
                parts.append(f"{name}={str(value).removeprefix('torch.')!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling and copy.copy / copy.deepcopy: refused in one line (a pipeline holds loaded
        models, C kernels' packed weights and ctypes handles; they failed deep inside torch,
        ctypes or transformers, or for one task copied 38 MB)."""
        raise TypeError(f"this {type(self).__name__} holds loaded models and kernels and cannot be pickled or copied; "
                        "build another with mmspec.pipeline(...), or share this one (its calls are thread-safe)")

    # -- before anything loads ---------------------------------------------------------------------
    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound with their defaults) without
        loading anything; raise one ValueError line. Presets and the CLI call it first."""

    @classmethod
    def check_init(cls, kwargs: dict[str, Any]) -> None:
        """``cls(**kwargs)``'s arguments checked without loading anything: bound to ``__init__``
        with its defaults, then :meth:`check_arguments` (presets, ``mmspec serve`` at start).

        Raises:
            ValueError / TypeError / FileNotFoundError: one line saying what to change.
        """
        arguments = inspect.signature(cls.__init__).bind(None, **kwargs)
        arguments.apply_defaults()
        cls.check_arguments(arguments.arguments)

    @classmethod
    def check_call_arguments(cls, values: dict[str, Any], where: str = "") -> None:
        """Check a call's arguments by name against ``__call__``'s annotations (those made of
        int, float, bool, str and None; :func:`mmspec.core.arguments.check_argument_types`):
        ``temperature="hot"`` is one ValueError line naming the argument and the type it takes.
        ``where`` starts the line (a preset's name and file)."""
        check_argument_types(cls.__call__, values, where)

    @classmethod
    def check_call_values(cls, values: dict[str, Any], where: str = "") -> None:
        """A call's values checked without loading anything (a preset's ``[call]``): their types
        (:meth:`check_call_arguments`), then their ranges: ``max_new_tokens`` >= 1,
        ``batch_size``, ``seed`` in 0 .. 2**63 - 1 and the sampling options (with the call's
        defaults for those not given); a task adds its own (:meth:`check_task_values`). Raises
        one ValueError line, ``where`` first."""
        cls.check_call_arguments(values, where)
        try:
            cls._check_ranges(values)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}{error}") from None

    @classmethod
    def _check_ranges(cls, values: dict[str, Any]) -> None:
        full = inspect.signature(cls.__call__).bind_partial(None, **values)
        full.apply_defaults()
        given = full.arguments
        if "max_new_tokens" in values and values["max_new_tokens"] < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {values['max_new_tokens']}")
        if "batch_size" in values:
            cls.check_batch_size(values["batch_size"])
        if "seed" in values:
            check_seed(values["seed"])
        if {"do_sample", "temperature", "top_k", "top_p"} & set(values) and "do_sample" in given:
            from ..core.sampling import SamplingConfig

            temperature = given.get("temperature")
            SamplingConfig(do_sample=given["do_sample"], temperature=1.0 if temperature is None else temperature,
                           top_k=given.get("top_k"), top_p=given.get("top_p"))
        cls.check_task_values(given)

    @classmethod
    def check_task_values(cls, values: dict[str, Any]) -> None:
        """The task's own range checks of a call's values (all of ``__call__``'s, defaults
        included), for :meth:`check_call_values`; none here."""

    @classmethod
    def make_method(cls, spec: str | Method, **settings: Any) -> Method:
        """A spec of the task's methods (``name[:key=value,...]``) -> the method, every setting
        checked; a Method passes through."""
        if isinstance(spec, Method):
            return spec
        if cls.methods is None:
            raise ValueError(f"the {cls.task} pipeline has no methods to name")
        return cls.methods.make(spec, **settings)

    @staticmethod
    def strings(value: Any, name: str) -> list[str]:
        """A call's text input (``str`` or a list / tuple of them) -> the list; anything else
        (None, a number, a list holding one) is one TypeError line naming ``name``."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        if isinstance(value, (list, tuple)):
            first = next(i for i, v in enumerate(value) if not isinstance(v, str))
            got = f"a {type(value).__name__} holding {type(value[first]).__name__} (item {first + 1} of {len(value)})"
        else:
            got = type(value).__name__
        raise TypeError(f"{name} must be a string or a list of strings, got {got}")

    @staticmethod
    @contextlib.contextmanager
    def naming_item(number: int, total: int, noun: str) -> Iterator[None]:
        """Inside it, a ValueError / TypeError / OSError about one item of a call's list starts with
        which ("prompt 2 of 3: empty prompt ..."); the error as is where the call has one item."""
        try:
            yield
        except (ValueError, TypeError, OSError) as error:
            if total == 1:
                raise
            message = f"{noun} {number} of {total}: {error}"
            try:
                named = type(error)(message)
            except TypeError:  # (an error class of other arguments, UnicodeDecodeError: its nearest plain kind)
                named = next(kind for kind in (ValueError, TypeError, OSError) if isinstance(error, kind))(message)
            raise named from None

    @staticmethod
    def check_batch_size(batch_size: Any) -> int:
        """Raise one ValueError line unless ``batch_size`` is a positive integer."""
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return int(batch_size)

    # -- calls -----------------------------------------------------------------------------------
    @staticmethod
    def chunks(items: Sequence[R], batch_size: int) -> Iterator[tuple[int, Sequence[R]]]:
        """(first index, items[first : first + batch_size]) for each chunk, in order."""
        for first in range(0, len(items), batch_size):
            yield first, items[first : first + batch_size]

    def with_baseline(self, method: Callable[[], R], baseline: Callable[[], R] | None,
                      warm_up: Callable[[], Any] | None = None, key: Any = None) -> tuple[R, R | None]:
        """Run ``method`` and, unless ``baseline`` is None, plain decoding on the same inputs in
        the same call: a short ``warm_up`` first (once per pipeline and ``key``, so that neither
        side pays first-call costs), then the baseline, then the method.

        Returns:
            (the method's result, the baseline's or None).
        """
        if baseline is None:
            return method(), None
        warmed = self.__dict__.setdefault("_warmed_up_for", set())
        if warm_up is not None and key not in warmed:
            warm_up()
            warmed.add(key)
        base = baseline()
        return method(), base

    @staticmethod
    def progress_reporter(progress: bool | ProgressCallback | None, total: int, unit: str
                          ) -> tuple[ProgressCallback | None, Callable[[], None]]:
        """``progress`` as (callback or None, close): a callable is used as it is; True is a
        terminal bar of ``total`` ``unit`` s on stderr (tqdm, which comes with transformers;
        nothing without it); False / None report nothing.

        Raises:
            TypeError: anything else.
        """
        if progress is None or progress is False:
            return None, lambda: None
        if progress is True:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # stay silent without tqdm
                return None, lambda: None
            bar = tqdm(total=total, unit=unit, file=sys.stderr)
            return (lambda done: bar.update(done - bar.n)), bar.close
        if callable(progress):
            return progress, lambda: None
        raise TypeError(f"progress must be a callable (done) -> None, True (a terminal bar) or False, got {progress!r}")

    def run_config(self) -> dict[str, Any]:
        """What every result's ``stats.config`` records about how this pipeline runs (kernels,
        dtype, CUDA graphs)."""
        return {}


def _checking_types(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a pipeline's ``__call__`` or ``stream``) preceded by the check of its arguments'
    types and ranges (:meth:`Pipeline.check_call_values`' checks), run inside
    :func:`~mmspec.core.exclusive.exclusive` (a generator it returns: each item made inside it); its
    signature and docs are the original's."""
    signature = inspect.signature(call)
    named = {name for name, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    @functools.wraps(call)
    def checked(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # a wrong argument name or count: the call itself says it (a pipeline's own argument: where it goes)
            built = inspect.signature(type(self).__init__).parameters
            for name in kwargs:
                if name not in signature.parameters and name in built:
                    raise TypeError(f"{name} is an argument of the pipeline, not of each call: pipe = mmspec.pipeline("
                                    f"{self.task!r}, {name}={kwargs[name]!r}), then pipe(...)") from None
            return call(self, *args, **kwargs)
        given = {k: v for k, v in list(bound.arguments.items())[1:]}
        check_argument_types(call, given)
        ranged = inspect.signature(type(self).__call__).parameters  # (stream's names that __call__ shares)
        type(self)._check_ranges({k: v for k, v in given.items() if k in named and k in ranged})  # (seed >= 0, ...)
        for name, value in bound.arguments.items():  # (numpy scalars as Python numbers: seed=np.int64(0))
            bound.arguments[name] = plain(value)
        with exclusive():
            result = call(*bound.args, **bound.kwargs)
        return exclusive_steps(result) if inspect.isgenerator(result) else result

    return checked
