"""One ``Method`` base for every task: a drafter verified by an acceptance rule, named by a spec.

A task (captioning, text-to-image, text-to-speech, ...) subclasses :class:`Method` once, giving
its table of :class:`Setting` s and its :class:`MethodRegistry`; each method is then one class
registered by name::

    METHODS = MethodRegistry("text-to-image method", example="sjd:vertical")

    class T2IMethod(Method):
        SETTINGS = {"window": Setting(int, "SJD's window L", at_least(1), "an integer >= 1"), ...}
        registry = METHODS

    @METHODS.register
    class JacobiMethod(T2IMethod):
        name = "sjd"
        description = "speculative Jacobi decoding (training-free)"
        argument = "init"                    # "sjd:vertical" is "sjd:init=vertical"
        defaults = {"window": 8, "init": "random"}

        def build_drafter(self, components):
            return JacobiDrafter(self.settings["window"], init=self.settings["init"])

**One spec syntax** everywhere (pipelines, presets, the CLI, the benchmarks):
``name[:key=value,key=value...]``. A method with an :attr:`Method.argument` also takes the short
form ``name:value`` (``sjd:vertical``, ``mar-parallel:16``, ``prompt-lookup:10``,
``layer-skip:8``, ``eagle2:DIR``), which may lead the pairs (``sjd:vertical,window=4``); a spec
whose part after the colon holds no ``=`` is that one value, kept whole (a path may hold ``,`` or
``:``). ``:`` also separates pairs (``vadusa:top_k=5:num_draft_tokens=3``, the older form). Values
are parsed with their setting's type, checked by its rule, and an unknown key or bad value is one
ValueError line naming the method's keys -- all before any model loads.

The table drives the checks, the error messages and the CLI (one option per setting); the
acceptance rule (:attr:`Method.rule`, a name of :data:`mmspec.core.rules.RULES`) gives
:attr:`Method.exact`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Callable, ClassVar

from ..core.registry import class_registrar
from ..core.rules import RULES
from ..core.spec import MethodSpec, parse_spec  # noqa: F401  (re-exported: the one spec syntax's parser)


@dataclass(frozen=True)
class Setting:
    """A setting that methods read.

    Attributes:
        kind: int | float | str (a spec's or the command line's text is parsed with it).
        help: what the setting does (the CLI's help, the error lines).
        valid: value -> whether it is allowed; needs: what a valid value is, for the error line.
        rule: the acceptance rule (of :data:`mmspec.core.rules.RULES`) whose parameter this is:
            the rule's ``Params`` check it (and may give a method its default).
    """

    kind: type
    help: str
    valid: Callable[[Any], bool] | None = None
    needs: str = ""
    rule: str | None = None

    def check(self, name: str, value: Any) -> None:
        """Raise one ValueError line unless ``value`` is a valid value of setting ``name``."""
        if self.rule is not None:
            RULES[self.rule].Params(**{name: value}).check_values(self.rule)
            return
        typed = {int: isinstance(value, Integral) and not isinstance(value, bool), float: isinstance(value, Real),
                 str: isinstance(value, str)}[self.kind]
        if not (typed and (self.valid is None or self.valid(value))):
            raise ValueError(f"{name} must be {self.needs or f'a {self.kind.__name__}'} ({self.help}), got {value!r}")

    def parse(self, text: str) -> Any:
        """A spec's text -> the typed value (ValueError when it is not one)."""
        return self.kind(text)

    @property
    def describes(self) -> str:
        """What a value is, for the error lines: 'an integer >= 1', 'one of random, ...'."""
        return self.needs or {int: "an integer", float: "a number", str: "a string"}[self.kind]


def at_least(low: int) -> Callable[[Any], bool]:
    """A ``valid`` predicate: value >= low."""
    return lambda value: value >= low


def split_specs(text: str) -> list[str]:
    """A comma list of method specs -> the specs, where a spec's own ``key=value`` pairs follow it
    after commas too: ``"ar,vadusa:top_k=5,num_draft_tokens=3,sjd"`` -> ``["ar",
    "vadusa:top_k=5,num_draft_tokens=3", "sjd"]`` (an item ``key=value`` continues the spec before
    it; a benchmark's own ``cspd/num_draft_tokens=4`` is a spec of its own)."""
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if specs and re.fullmatch(r"[A-Za-z_]\w*=.*", item):  # key=value: the previous spec's
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


class Method:
    """A task's method: a drafter (:meth:`build_drafter`) verified by an acceptance rule
    (:attr:`rule`, :meth:`rule_kwargs`), with its settings (:attr:`defaults`) checked against the
    task's :attr:`SETTINGS` table.

    Args:
        arg: the short form's value ("sjd:vertical" -> "vertical"): the value of :attr:`argument`
            unless that setting is given by keyword (text is parsed with the setting's type).
        **settings: settings of the task's table; the method keeps those in :attr:`defaults`
            (None meaning the default, or unset). A setting the method does not read is refused
            when it is given (not None), for every method: ``window`` for ``cspd`` is an error, not
            a setting silently ignored; out-of-range values are refused by the table's rules.
    Attributes:
        settings: the method's settings (its :attr:`defaults`, updated by the given values).
    Raises:
        ValueError: an unknown or invalid setting, an argument the method does not take.
    """

    #: registry name, other names it answers to, and what it is (shown by the CLI)
    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    #: the setting the short form ``name:value`` gives (None: no short form), and what its value
    #: is for the error line ("the number of steps"; default: the setting's own words)
    argument: ClassVar[str | None] = None
    argument_help: ClassVar[str] = ""
    #: the acceptance rule of mmspec.generate (None: "auto", exact: greedy / block verification)
    rule: ClassVar[str | None] = None
    #: the decoding itself departs from plain decoding, whatever the rule (e.g. MAR's parallel steps)
    approximate: ClassVar[bool] = False
    #: whether the output is plain decoding's (token for token greedily, in distribution when
    #: sampling): derived from :attr:`rule` (its ``lossless``) and :attr:`approximate`
    exact: ClassVar[bool] = True
    #: whether the drafter proposes token trees
    drafts_trees: ClassVar[bool] = False
    #: the settings this method reads, with their defaults
    defaults: ClassVar[dict[str, Any]] = {}
    #: the task's settings table (set once on the task's base class)
    SETTINGS: ClassVar[dict[str, Setting]] = {}
    #: the task's registry (set once on the task's base class)
    registry: ClassVar["MethodRegistry | None"] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.exact = (cls.rule is None or RULES[cls.rule].lossless) and not cls.approximate

    def __init__(self, arg: str | None = None, **settings: Any) -> None:
        if arg is not None and arg != "":
            if self.argument is None:
                raise ValueError(f"method {self.name!r} takes no ':{arg}' argument; {self.settings_help()}")
            short = self._parse_argument(arg)
            given = settings.get(self.argument)
            if given is not None and given != short:
                raise ValueError(f"method '{self.name}:{arg}' sets {self.argument}={short!r} and {self.argument}={given!r} "
                                 f"is given as well; give {self.argument} once")
            settings = {**settings, self.argument: short}
        self.check_settings(settings)
        self.settings = {name: default if settings.get(name) is None else settings[name]
                         for name, default in self.defaults.items()}

    # -- specs and settings --------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: MethodSpec | str, **settings: Any) -> "Method":
        """The method of a parsed spec (its pairs checked against this method's own settings),
        with keyword ``settings`` (None: not given). A setting given both ways with two values is
        one ValueError line (a command-line option beside a spec that sets it too, for example)."""
        spec = parse_spec(spec) if isinstance(spec, str) else spec
        parts = ([spec.argument] if spec.argument else []) + [k if v is None else f"{k}={v}" for k, v in spec.pairs]
        text = spec.name + (":" + ",".join(parts) if parts else "")
        given: dict[str, Any] = {}
        for key, value in spec.pairs:
            if value is None:
                raise ValueError(f"method {text!r}: {key!r} is not key=value; {cls.settings_help()}")
            if key not in cls.defaults:
                raise ValueError(f"method {cls.name!r} takes no setting {key!r}; {cls.settings_help()}")
            parsed = cls._parse(key, value, text)
            if key in given and given[key] != parsed:
                raise ValueError(f"method {text!r} sets {key} twice, to {given[key]!r} and {parsed!r}; give {key} once")
            given[key] = parsed
            if settings.get(key) is not None and settings[key] != given[key]:
                raise ValueError(f"method {text!r} sets {key}={given[key]!r} and {key}={settings[key]!r} is given as "
                                 f"well; give {key} once")
        return cls(spec.argument, **{**given, **{k: v for k, v in settings.items() if v is not None or k not in given}})

    @classmethod
    def _parse(cls, key: str, text: str, spec: str) -> Any:
        setting = cls.SETTINGS[key]
        try:
            return setting.parse(text)
        except ValueError:
            raise ValueError(f"method {spec!r}: {key}={text!r} is not {setting.describes} ({setting.help}); "
                             f"{cls.settings_help()}") from None

    @classmethod
    def _parse_argument(cls, text: str) -> Any:
        setting = cls.SETTINGS[cls.argument]
        try:
            return setting.parse(text)
        except ValueError:
            what = cls.argument_help or f"{setting.describes} ({setting.help})"
            raise ValueError(f"{cls.name} takes {what}, e.g. '{cls.name}:{cls._example(cls.argument)}', got {text!r}; "
                             f"{cls.settings_help()}") from None

    @classmethod
    def _example(cls, key: str) -> Any:
        """A value of setting ``key`` for the error lines: the method's default, else a typical one."""
        default = cls.defaults.get(key)
        return default if default is not None else {int: 4, float: 0.1, str: "..."}[cls.SETTINGS[key].kind]

    @classmethod
    def settings_help(cls) -> str:
        """The line's tail naming this method's keys: "its settings are key=number: window, init (e.g. ...)"."""
        keys = list(cls.defaults)
        if not keys:
            return f"method {cls.name!r} has no settings"
        value = "number" if all(cls.SETTINGS[k].kind in (int, float) for k in keys) else "value"
        key = keys[-1]
        return f"its settings are key={value}: {', '.join(keys)} (e.g. '{cls.name}:{key}={cls._example(key)}')"

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """Raise one ValueError line for a setting that is not in the task's table, a setting the
        method does not read given a value (None = unset: the callers that hold one set of options
        for every method, the CLI and the pipelines, pass None for the options not given), or a
        value out of its setting's range."""
        for name, value in settings.items():
            if name not in cls.SETTINGS:
                raise ValueError(f"method {cls.name!r} takes no setting {name!r} (known settings: "
                                 f"{', '.join(cls.SETTINGS)}); {cls.settings_help()}")
            if name not in cls.defaults:
                if value is None:
                    continue
                raise ValueError(f"method {cls.name!r} takes no setting {name!r} ({cls.SETTINGS[name].help}), got "
                                 f"{name}={value!r}; drop it or choose a method that reads it; {cls.settings_help()}")
            if value is not None:
                cls.SETTINGS[name].check(name, value)

    @classmethod
    def reads(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """The given (not None) ``settings`` that this method reads: a run that applies one set of
        options to several methods (a pipeline call naming another method, a benchmark) hands
        each method its own, after checking that every option is read by some method."""
        return {name: value for name, value in settings.items() if name in cls.defaults and value is not None}

    def spec(self) -> str:
        """This method as a spec in the one syntax: "sjd:window=8,init=random"."""
        pairs = ",".join(f"{k}={v}" for k, v in self.settings.items() if v is not None)
        return f"{self.name}:{pairs}" if pairs else self.name

    # -- what a method does ----------------------------------------------------------------------------
    def build_drafter(self, components: Any) -> Any:
        """A fresh drafter over the task's ``components`` (None: plain decoding)."""
        return None

    def rule_kwargs(self, components: Any) -> dict[str, Any] | None:
        """The acceptance rule's parameters (None for the exact rules)."""
        return None

    def check_components(self, components: Any) -> None:
        """Refuse components the method cannot run on (one ValueError line; the default: any)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


class MethodRegistry(dict):
    """One task's methods: name -> class (aliases resolved by :meth:`resolve`, not listed).

    Args:
        kind: what a method is, for the messages ("text-to-image method").
        example: a spec shown when a name is unknown ("sjd:vertical").
    """

    def __init__(self, kind: str, example: str) -> None:
        super().__init__()
        self.kind, self.example = kind, example
        self._register = class_registrar(self, kind, required=("name", "description"))

    def register(self, cls: type[Method]) -> type[Method]:
        """Class decorator: register ``cls`` under ``cls.name`` and its aliases (a taken name or
        alias is one ValueError line)."""
        taken = self.aliases()
        for name in (cls.name, *cls.aliases):
            if name in taken or (name != cls.name and name in self):
                raise ValueError(f"a {self.kind} named {name!r} is already registered")
        return self._register(cls)

    def aliases(self) -> dict[str, type[Method]]:
        """alias -> class."""
        return {alias: cls for cls in self.values() for alias in cls.aliases}

    def resolve(self, name: str) -> type[Method]:
        """The class registered as ``name`` (or with that alias)."""
        found = self.get(name) or self.aliases().get(name)
        if found is None:
            raise ValueError(f"unknown method {name!r}; choose one of {', '.join(self)} (e.g. {self.example!r})")
        return found

    def make(self, spec: str, **settings: Any) -> Method:
        """``"name[:key=value,...]"`` (or a short form) and keyword settings -> the method, every
        setting checked."""
        parsed = parse_spec(spec)
        try:
            cls = self.resolve(parsed.name)
        except ValueError:
            raise ValueError(f"unknown method {spec!r}; choose one of {', '.join(self)} (e.g. {self.example!r})") from None
        return cls.from_spec(parsed, **settings)

    def help(self) -> str:
        """Every method with its description, for the CLI."""
        return " | ".join(f"{name} ({cls.description})" for name, cls in self.items())
