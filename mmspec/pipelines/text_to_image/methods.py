"""Text-to-image methods: each a class (its drafter, its acceptance rule, its defaults), registered
by name in :data:`METHODS`.

Every method is a :class:`~mmspec.pipelines.methods.Method` (the base all tasks share), built from
a spec in the one syntax and settings: ``make_method("sjd:init=vertical,window=8")``, or the short
form ``make_method("sjd:vertical", window=8)``; every setting is checked against :data:`SETTINGS` when the method is built, before any model loads.
The pipeline, ``mmspec bench t2i`` and the CLI all go through this registry, so none of them
compares method names.

Exact methods (greedy variants reproduce AR token for token, sampling variants sample AR's
distribution): ``ar``; ``spec`` (speculative sampling with the draft generator); ``sjd``
(speculative Jacobi decoding, ``init`` = random | horizontal | vertical); ``sjd-coupled`` (SJD
whose redrafts are maximally coupled with the previous iterate); ``sjd-pac`` (coupled SJD with a
small candidate tree at the window's start); ``eagle`` / ``eagle2`` (the image EAGLE head's chains /
dynamic trees). Relaxed (lossy, bounded): ``lantern``, ``lantern++`` and ``gsd`` verify the tokens
of another method's drafter (``drafter=`` draft | eagle | eagle2) with the rules of
:mod:`mmspec.core.relaxed`, against neighbour tables of the tokenizer's codebook.

Adding a method is one class and its registration::

    @register_method
    class MyMethod(T2IMethod):
        name = "mine"
        description = "what it does (shown by the CLI)"
        defaults = {"num_draft_tokens": 4}          # the settings it reads (names of SETTINGS)

        def build_drafter(self, components):         # components: T2IComponents
            return MyDrafter(components.target, self.settings["num_draft_tokens"])

(``rule`` and :meth:`T2IMethod.rule_kwargs` choose a lossy acceptance rule; a new setting is one
more :data:`SETTINGS` entry, which also gives ``mmspec t2i`` its option.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ...api import GenerateOutput
from ...core.rules import RULES
from ...drafters import Drafter, JacobiDrafter, MARDrafter, ModelDrafter
from ...drafters.jacobi import INIT_STRATEGIES, ProactiveJacobiDrafter
from ..methods import Method, MethodRegistry, Setting, at_least

if TYPE_CHECKING:
    from .components import T2IComponents

#: who proposes the tokens of a relaxed method (``drafter=``) -> the exact method whose drafter it is
PROPOSERS = {"draft": "spec", "eagle": "eagle", "eagle2": "eagle2"}

#: every setting a method may read; None (or absent) means the method's default
SETTINGS: dict[str, Setting] = {
    "window": Setting(int, "SJD's window L", at_least(1), "an integer >= 1"),
    "init": Setting(str, "SJD's initialisation of new window positions", lambda v: v in INIT_STRATEGIES,
                    f"one of {', '.join(INIT_STRATEGIES)}"),
    "num_draft_tokens": Setting(int, "a chain's draft length K, or EAGLE-2's tree depth", at_least(1), "an integer >= 1"),
    "drafter": Setting(str, "who drafts for the relaxed methods (eagle where the model has an image EAGLE head)",
                       lambda v: v in PROPOSERS, f"one of {', '.join(PROPOSERS)}"),
    "neighbours_k": Setting(int, "codebook neighbours per code, LANTERN's k", at_least(1), "an integer >= 1"),
    "delta": Setting(float, "LANTERN's total-variation bound", rule="lantern"),
    "lam": Setting(float, "LANTERN++'s ratio bound", rule="lantern++"),
    "top_m": Setting(int, "GSD's probability cut", rule="gsd"),
    "pac_branches": Setting(int, "SJD-PAC's candidates per tree position", at_least(1), "an integer >= 1"),
    "pac_depth": Setting(int, "SJD-PAC's tree positions", at_least(0), "an integer >= 0"),
    "prefill_fraction": Setting(float, "CSpD's share of tokens the target generates alone first",
                                lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "num_iter": Setting(int, "MAR's parallel decoding steps", at_least(1), "an integer >= 1"),
    "exponent_temperature": Setting(float, "cspd-tempered's exponent temperature (the released CSpD code's 42)",
                                    rule="cspd-tempered"),
    "draft_mode": Setting(str, "how CSpD's draft MAR proposes K tokens: one at a time (sequential, the paper's) or "
                          "all from the committed tokens in one step (parallel)", lambda v: v in ("sequential", "parallel"),
                          "sequential or parallel"),
}


def check_settings(settings: dict[str, Any]) -> None:
    """Raise one ValueError line for an unknown setting or an invalid value (None = default)."""
    for name, value in settings.items():
        if name not in SETTINGS:
            raise ValueError(f"unknown method setting {name!r}; known: {', '.join(SETTINGS)}")
        if value is not None:
            SETTINGS[name].check(name, value)


#: method name -> its class
METHODS = MethodRegistry("text-to-image method", example="sjd:vertical")

#: class decorator: register ``cls`` under ``cls.name`` (a taken name is one ValueError line)
register_method = METHODS.register


class T2IMethod(Method):
    """A text-to-image method (:class:`~mmspec.pipelines.methods.Method` over
    :class:`~.components.T2IComponents` or :class:`~.mar_components.MARComponents`): a drafter
    (:meth:`build_drafter`) verified by an acceptance rule (:attr:`rule`, :meth:`rule_kwargs`).

    A setting of :data:`SETTINGS` that the method does not read is refused when given (``cspd``
    with ``window=4``); the CLI passes None for the options not given, and a pipeline call or a
    benchmark that names several methods hands each the settings it reads
    (:meth:`~mmspec.pipelines.methods.Method.reads`).
    """

    SETTINGS = SETTINGS
    registry = METHODS
    #: the token kind it works with: False discrete, True continuous (MAR), None either
    continuous: ClassVar[bool | None] = False
    #: whether it decodes several images together (``batch_size`` > 1)
    batches: ClassVar[bool] = True

    def parts(self) -> set[str]:
        """The components' optional parts its drafter reads: "draft" (a draft generator),
        "eagle_head" (an image EAGLE head); ``mmspec t2i`` refuses one given for a method that
        reads none of it."""
        return set()

    def build_drafter(self, components: "T2IComponents") -> Drafter | None:
        """A fresh drafter over ``components`` (None: plain AR decoding)."""
        return None

    def run_settings(self, components: "T2IComponents") -> dict[str, Any]:
        """The settings it runs with over ``components``: the given and default ones (None: unset),
        with any that follow the machine resolved (SJD's window)."""
        return {name: value for name, value in self.settings.items() if value is not None}

    def check_components(self, components) -> None:
        """Refuse a model of the other token kind, or a window wider than the image has tokens
        (one ValueError line)."""
        self.check_kind(components.continuous)
        window, tokens = self.settings.get("window"), getattr(components.target, "num_image_tokens", None)
        if window is not None and tokens is not None and window > tokens:
            raise ValueError(f"window={window} is wider than the image's {tokens} tokens; use at most {tokens}")

    def check_kind(self, continuous: bool) -> None:
        """Refuse a model whose tokens are (``continuous``) or are not continuous, when this
        method is for the other kind (one ValueError line naming the methods that fit)."""
        if self.continuous is not None and self.continuous != continuous:
            fits = [name for name, cls in METHODS.items() if cls.continuous in (None, continuous)]
            kind = "continuous-token (MAR)" if continuous else "discrete-token"
            other = ("a discrete-token model (the default)" if continuous
                     else 'a continuous-token model: model="mar" (mmspec t2i --model mar), the embedded MAR generator')
            raise ValueError(f"method {self.name!r} does not work with a {kind} model; choose one of {', '.join(fits)}, "
                             f"or use it with {other}")

    def generate(self, components: "T2IComponents", model_inputs: dict[str, Any], seed: int,
                 max_new_tokens: int | None = None, **sampling: Any) -> GenerateOutput:
        """One image's tokens through :func:`mmspec.generate` (the components'
        ``generate_tokens``): ``sequences[0, -N:]`` are the N = rows * columns tokens.
        ``model_inputs``: the components' prompt inputs; ``sampling``: do_sample, temperature,
        top_k, top_p, guidance_scale."""
        self.check_components(components)
        return components.generate_tokens(self.build_drafter(components), self.rule, self.rule_kwargs(components),
                                          model_inputs, seed, max_new_tokens, **sampling)

    def generate_batch(self, components: "T2IComponents", model_inputs: list[dict[str, Any]], seeds: list[int],
                       max_new_tokens: int | None = None, **sampling: Any) -> GenerateOutput:
        """Images decoded together (:func:`mmspec.api.generate_rows`), row b from ``model_inputs[b]``
        with ``seeds[b]``: row b equals :meth:`generate`; ``sequences[b, -N:]`` are its tokens."""
        from ...api import generate_rows

        self.check_components(components)
        if components.continuous:  # a MAR draws each image's order and noise from its seed first
            return components.generate_token_rows(self.build_drafter(components), self.rule, self.rule_kwargs(components),
                                                  model_inputs, seeds, max_new_tokens, **sampling)
        guidance = {"guidance_scale": sampling.pop("guidance_scale", None)}
        return generate_rows(components.target, [{**inputs, **guidance} for inputs in model_inputs], drafter=self.build_drafter(components),
                             seed=seeds, max_new_tokens=max_new_tokens or components.target.num_image_tokens,
                             acceptance=self.rule, rule_kwargs=self.rule_kwargs(components), **sampling)


def make_method(spec: str, **settings: Any) -> T2IMethod:
    """``"name[:key=value,...]"`` (or the short form ``"sjd:vertical"``) and settings -> the
    method (every setting checked)."""
    return METHODS.make(spec, **settings)


@register_method
class AutoregressiveMethod(T2IMethod):
    name = "ar"
    description = "plain autoregressive decoding, one token per step (the baseline)"
    continuous = None


@register_method
class DraftModelMethod(T2IMethod):
    name = "spec"
    description = "speculative sampling with the small draft generator"
    defaults = {"num_draft_tokens": 4}

    def parts(self) -> set[str]:
        return {"draft"}

    def build_drafter(self, components):
        return ModelDrafter(components.draft_target(), num_draft_tokens=self.settings["num_draft_tokens"])


@register_method
class JacobiMethod(T2IMethod):
    """SJD's window L where none is given: by the components'
    :attr:`~mmspec.modeling.fast_linear.OptimizesOnLoad.verification_width` (:attr:`windows`).
    L = 8 on a GPU and where the generator's linears run the AVX-512 or AMX kernels: on the
    embedded model with few-row linears (2-core AVX-512 CPU, 1 thread, side by side) a verification
    of 2 (L + 1) rows stays within the kernel's 24 rows at L = 8 and falls back to ``F.linear`` at
    16: coupled SJD 1.46x over AR at 8 against 1.10x at 16, sjd-pac 1.23x against 0.97x
    (docs/benchmarks.md; before the kernel, coupled SJD had been faster at 16). L = 2 where they run
    the AVX2 kernel (no AVX-512), whose rows cost more: coupled SJD on 12 held-out prompts, an AMX
    core run as an AVX2 CPU (stop 84), 1.13x at 2, 1.07x at 3, 1.08x at 4, 0.96x at 8. L = 6 where
    the verification width is "medium" (float32 on the 16-lane AVX-512 kernel, bf16 on the packed
    AVX512-BF16 kernel summing through FMAs): coupled SJD (vertical) on 12 held-out prompts, an AMX
    core run as such CPUs with oneDNN held alike (stop 87), float32 1.61x / 1.61x / 1.57x at 4 / 6 /
    8, bf16 1.22-1.26x / 1.26-1.32x / 1.27x / 1.07x at 2 / 4 / 6 / 8."""

    name = "sjd"
    description = "speculative Jacobi decoding (training-free)"
    argument = "init"
    defaults = {"window": None, "init": "random"}
    #: the window L by the components' verification width, where ``window`` is not given
    windows: ClassVar[dict[str, int]] = {"wide": 8, "medium": 6, "narrow": 2}
    coupled: ClassVar[bool] = False

    def window(self, components) -> int:
        """The window L: the given ``window``, else :attr:`windows` for the components' kernel."""
        return self.settings["window"] or self.windows[components.verification_width]

    def run_settings(self, components) -> dict[str, Any]:
        return {**super().run_settings(components), "window": self.window(components)}

    def build_drafter(self, components):
        return JacobiDrafter(self.window(components), init=self.settings["init"], coupled=self.coupled)


@register_method
class CoupledJacobiMethod(JacobiMethod):
    """Coupled SJD, the text-to-image default; new window positions start as the token one row up
    (``init="vertical"``) unless told otherwise. On the embedded model (stop 83; 12 test-split
    prompts x 2 rounds, one AMX core, float32, window 8, ``mmspec bench t2i``): ``sjd`` 1.18x over
    plain decoding, ``sjd-coupled:random`` 1.35x, ``:vertical`` **1.53x**, ``:horizontal`` 1.52x,
    all exact (docs/benchmarks.md, "stop 83")."""

    name = "sjd-coupled"
    description = "SJD with maximally coupled redrafts, vertical init (training-free; the default)"
    defaults = {**JacobiMethod.defaults, "init": "vertical"}
    coupled = True


@register_method
class ProactiveJacobiMethod(CoupledJacobiMethod):
    """SJD-PAC's tree size default (2 candidates at 1 position): the faster of the measured sizes on
    the embedded model, docs/benchmarks.md. Its window where none is given: 8 on every kernel (its
    tree's room), at most the image's tokens (a model of fewer than 8 image tokens refused the
    default window as if it had been given, where ``sjd`` ran)."""

    name = "sjd-pac"
    description = "coupled SJD + proactive drafting: a small candidate tree at the window's start (training-free)"
    # (random init, as before: sjd-pac:vertical 1.04x in stop 83; window 8 everywhere, its tree's room)
    defaults = {**JacobiMethod.defaults, "pac_branches": 2, "pac_depth": 1}
    windows = {"wide": 8, "medium": 8, "narrow": 8}

    drafts_trees = True
    batches = False

    def __init__(self, arg: str | None = None, **settings: Any) -> None:
        super().__init__(arg, **settings)
        self._check_tree(self.settings["window"] or self.windows["wide"])

    def _check_tree(self, window: int, note: str = "") -> None:
        """Refuse a tree that does not fit ``window`` nodes (the drafter would draw the smaller
        tree, or none, without a word)."""
        s = self.settings
        if s["pac_branches"] == 1 and s["pac_depth"] > 0:  # (was "does not fit window 8: use pac_branches <= 8")
            raise ValueError(f"sjd-pac's pac_branches=1 is one candidate per position: no tree (sjd-coupled's chain); use "
                             "pac_branches >= 2, or pac_depth=0")
        if ProactiveJacobiDrafter.fitting_depth(window, s["pac_branches"], s["pac_depth"]) < s["pac_depth"]:
            most = ProactiveJacobiDrafter.fitting_depth(window, s["pac_branches"], window)
            raise ValueError(f"sjd-pac's tree of pac_depth={s['pac_depth']} positions with pac_branches={s['pac_branches']} "
                             f"candidates does not fit window {window}{note}: "
                             + (f"use pac_depth <= {most}" if most else f"use pac_branches <= {window}")
                             + ("" if note else " or a wider window"))

    def window(self, components) -> int:
        """The given ``window``, else 8 (:attr:`windows`) or the image's tokens where it has fewer."""
        if self.settings["window"]:
            return self.settings["window"]
        tokens = getattr(getattr(components, "target", None), "num_image_tokens", None)
        return min(self.windows[components.verification_width], tokens or self.windows["wide"])

    def check_components(self, components) -> None:
        super().check_components(components)
        if not self.settings["window"]:  # (the default window, cut to a small image's tokens)
            window = self.window(components)
            self._check_tree(window, f" (the default, cut to the image's {window} tokens)")

    def build_drafter(self, components):
        s = self.settings
        return ProactiveJacobiDrafter(self.window(components), init=s["init"], branches=s["pac_branches"],
                                      depth=s["pac_depth"])


@register_method
class EagleMethod(T2IMethod):
    name = "eagle"
    description = "EAGLE chain drafts from the image EAGLE head (exact)"
    defaults = {"num_draft_tokens": 4}

    def parts(self) -> set[str]:
        return {"eagle_head"}

    def build_drafter(self, components):
        from ...drafters.image_eagle import ImageEagleDrafter

        return ImageEagleDrafter(components.target, components.eagle_head_model(),
                                 num_draft_tokens=self.settings["num_draft_tokens"])


@register_method
class Eagle2Method(T2IMethod):
    name = "eagle2"
    description = "EAGLE-2 dynamic trees from the image EAGLE head (exact)"
    defaults = {"num_draft_tokens": 6}  # the tree depth
    drafts_trees = True
    max_nodes: ClassVar[int] = 48

    def parts(self) -> set[str]:
        return {"eagle_head"}

    def build_drafter(self, components):
        from ...drafters.image_eagle import ImageEagle2Drafter

        return ImageEagle2Drafter(components.target, components.eagle_head_model(),
                                  depth=self.settings["num_draft_tokens"], max_nodes=self.max_nodes)


class RelaxedMethod(T2IMethod):
    """A lossy rule of :data:`mmspec.core.rules.RULES` over the drafts of another method's drafter
    (:data:`PROPOSERS`; default: the image EAGLE head's chains when the model has one, else the
    draft generator). The rule reads the codebook's neighbour table (k = ``neighbours_k``; default
    100) and its bound :attr:`bound`, whose default is the rule's (LANTERN's delta = 0.05 at k = 100
    is the recommended setting on the embedded model: the largest relaxation whose Frechet distance
    and prompt score stayed within AR's run-to-run spread; docs/benchmarks.md). A subclass names
    ``rule`` and ``bound``; its :attr:`defaults` follow from them."""

    argument = "drafter"
    #: the rule's bound (a name of SETTINGS and a field of the rule's Params)
    bound: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.defaults = {"drafter": None, "num_draft_tokens": None, "neighbours_k": 100,
                        cls.bound: getattr(RULES[cls.rule].Params, cls.bound)}

    def __init__(self, arg: str | None = None, **settings: Any) -> None:
        super().__init__(arg, **settings)
        kind = self.settings["drafter"]
        if kind is not None and METHODS[PROPOSERS[kind]].drafts_trees and not RULES[self.rule].supports_tree():
            raise ValueError(f"{self.name} verifies linear drafts only; use drafter='eagle' or 'draft'")

    def parts(self) -> set[str]:
        kind = self.settings["drafter"]
        return {"draft", "eagle_head"} if kind is None else METHODS[PROPOSERS[kind]]().parts()

    def proposer(self, components: "T2IComponents") -> T2IMethod:
        """The exact method whose drafter proposes."""
        kind = self.settings["drafter"] or ("eagle" if components.eagle_head is not None else "draft")
        return METHODS[PROPOSERS[kind]](num_draft_tokens=self.settings["num_draft_tokens"])

    def build_drafter(self, components):
        return self.proposer(components).build_drafter(components)

    def rule_kwargs(self, components):
        return {"neighbours": components.neighbours(self.settings["neighbours_k"]), self.bound: self.settings[self.bound]}


@register_method
class LanternMethod(RelaxedMethod):
    name = rule = "lantern"
    description = "LANTERN relaxed acceptance of a drafter's tokens (lossy, TV <= delta)"
    bound = "delta"


@register_method
class LanternPlusMethod(RelaxedMethod):
    name = rule = "lantern++"
    description = "LANTERN++ relaxed acceptance (lossy, p~(x) <= lam p(x))"
    bound = "lam"


@register_method
class GroupedMethod(RelaxedMethod):
    name = rule = "gsd"
    description = "grouped speculative decoding acceptance (lossy)"
    bound = "top_m"


@register_method
class CSpDMethod(T2IMethod):
    name = "cspd"
    description = "continuous speculative decoding with the draft MAR (continuous-token models)"
    rule = "cspd"
    continuous = True
    defaults = {"num_draft_tokens": 4, "prefill_fraction": 0.05, "draft_mode": "sequential"}

    def parts(self) -> set[str]:
        return {"draft"}

    def build_drafter(self, components):
        return MARDrafter(components.draft_target(), self.settings["num_draft_tokens"], self.settings["prefill_fraction"],
                          parallel=self.settings["draft_mode"] == "parallel")


@register_method
class TemperedCSpDMethod(CSpDMethod):
    name = "cspd-tempered"
    description = ("CSpD with the released code's tempered exponent (lossy; continuous-token models)")
    rule = "cspd-tempered"
    defaults = {**CSpDMethod.defaults, "exponent_temperature": 42.0}

    def rule_kwargs(self, components):
        return {"exponent_temperature": self.settings["exponent_temperature"]}


@register_method
class SelfCSpDMethod(T2IMethod):
    name = "cspd-self"
    description = ("continuous speculative decoding drafted by the target's own parallel step, exact, no draft "
                   "model (continuous-token models)")
    rule = "cspd"
    continuous = True
    defaults = {"num_draft_tokens": 4, "prefill_fraction": 0.05}

    def build_drafter(self, components):
        return MARDrafter(components.target, self.settings["num_draft_tokens"], self.settings["prefill_fraction"],
                          parallel=True)


@register_method
class MARParallelMethod(T2IMethod):
    name = "mar-parallel"
    description = "MAR's own decoding: num_iter steps, several independent tokens each (continuous-token models; lossy)"
    argument = "num_iter"
    argument_help = "the number of steps"
    continuous = True
    approximate = True  # several tokens drawn independently per step: not plain decoding's distribution
    defaults = {"num_iter": 16}

    def check_components(self, components) -> None:
        super().check_components(components)
        steps, tokens = self.settings["num_iter"], components.target.num_image_tokens
        if steps > tokens:  # (MAR draws at least one token a step: it would run `tokens` steps and say `steps`)
            raise ValueError(f"mar-parallel:{steps} is more steps than the image's {tokens} tokens; use at most {tokens}")

    def generate(self, components, model_inputs, seed, max_new_tokens=None, **sampling):
        self.check_components(components)
        return components.generate_parallel(self.settings["num_iter"], model_inputs, seed, **sampling)

    def generate_batch(self, components, model_inputs, seeds, max_new_tokens=None, **sampling):
        self.check_components(components)
        return components.generate_parallel_rows(self.settings["num_iter"], model_inputs, seeds, **sampling)
