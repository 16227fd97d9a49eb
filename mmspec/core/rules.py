"""Acceptance rules as registered classes: the loop asks a rule, it never compares rule names.

A rule is a class registered by name in :data:`RULES` that declares

- ``Params``: a frozen dataclass of its parameters, with defaults and validation (one ValueError
  line naming the parameter and what is allowed);
- ``sampling``: whether it works under greedy decoding, sampling, or both;
- ``lossless``: whether the output is exactly the target's (greedy tokens or distribution);
- ``verify``: its linear form, and ``verify_tree``: its form on token trees (``supports_tree``).

Both forms are pure: they take the draft, the target's logits [1, K+1, V] (or [1, N+1, V] for a
tree of N nodes), the sampling transform and the uniforms the loop drew (``None`` under greedy
decoding, else [1, K+1]: one per draft position, then one for the corrected / bonus token), and
return a :class:`~mmspec.core.verify.Verification`. The formulas live with the functions they
call (:mod:`mmspec.core.verify`, :mod:`mmspec.core.relaxed`).

Adding a rule::

    @register_rule
    class MyRule(AcceptanceRule):
        name = "mine"
        Params = MyParams          # a frozen dataclass deriving from RuleParams
        sampling = SAMPLING        # GREEDY | SAMPLING | EITHER
        def verify(self, draft, target_logits, sampling, uniforms): ...

after which ``mmspec.generate(..., acceptance="mine", rule_kwargs={...})`` uses it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .continuous import cspd_verify
from .draft import Draft
from .registry import class_registrar
from .relaxed import (TokenGroups, group_greedy_verify, group_verify, gsd_verify, lantern_greedy_verify, lantern_verify,
                      topk_tolerance_verify, tree_gsd_verify, tree_lantern_greedy_verify, tree_lantern_verify,
                      tree_topk_tolerance_verify)
from .sampling import SamplingConfig, logits_to_probs
from .tree import TokenTree
from .verify import (TreeVerification, Verification, block_verify, greedy_verify, speculative_verify,
                     tree_greedy_verify, tree_speculative_verify, tree_typical_verify, typical_verify)

#: the rule works under greedy decoding only / sampling only / both
GREEDY, SAMPLING, EITHER = "greedy", "sampling", "either"
#: ``acceptance="auto"``: the exact rule of the decoding mode
AUTO = "auto"


def _number(rule: str, name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
            integer: bool = False) -> None:
    """Raise one ValueError line unless ``value`` is a finite number in [low, high] ((low, high] with
    ``low_open``), and an integer when ``integer``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high and (not integer or float(value).is_integer())
    if not ok:
        kind = "an integer" if integer else "a finite number"
        bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high != math.inf else "")
        raise ValueError(f"acceptance={rule!r}: {name} must be {kind} {bounds}, got {value!r}")


@dataclass(frozen=True, eq=False)
class RuleParams:
    """A rule's parameters (none). Subclasses add fields with defaults and check their scalar
    values in :meth:`check_values`; ``rule`` is the rule's name for the messages."""

    def validate(self, rule: str) -> None:
        """Check every parameter (raise one ValueError line)."""
        self.check_values(rule)

    def check_values(self, rule: str) -> None:
        """Check the scalar parameters only: what a setting can be checked for before a model
        (and the tables built from it) is loaded."""

    def describe(self) -> dict[str, Any]:
        """JSON-friendly values for the stats' config (a neighbour table by its width k)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                out[f"{field.name}_k"] = int(value.shape[-1])
            else:
                out[field.name] = value
        return out


@dataclass(frozen=True, eq=False)
class TypicalParams(RuleParams):
    """Medusa's typical acceptance: eps (``posterior_threshold``) and delta (``posterior_alpha``),
    the defaults of the Medusa paper (eps = 0.09, delta = sqrt(eps) = 0.3)."""

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def check_values(self, rule: str) -> None:
        _number(rule, "posterior_threshold", self.posterior_threshold, 0.0, 1.0, low_open=True)
        _number(rule, "posterior_alpha", self.posterior_alpha, 0.0)


@dataclass(frozen=True, eq=False)
class NeighbourParams(RuleParams):
    """The relaxed image-token rules' codebook neighbour table: LongTensor [V, k], row v the k codes
    nearest to v (:func:`mmspec.core.relaxed.neighbour_table`)."""

    neighbours: torch.Tensor | None = None

    def validate(self, rule: str) -> None:
        table = self.neighbours
        if not isinstance(table, torch.Tensor):
            raise ValueError(f"acceptance={rule!r} needs rule_kwargs['neighbours'], a LongTensor [V, k] of codebook "
                             "neighbours (mmspec.core.relaxed.neighbour_table(codebook, k))")
        if table.dim() != 2 or table.shape[1] < 1 or table.dtype != torch.long:
            raise ValueError(f"acceptance={rule!r}: neighbours must be a LongTensor [V, k] with k >= 1, "
                             f"got {table.dtype} {tuple(table.shape)}")
        self.check_values(rule)


@dataclass(frozen=True, eq=False)
class LanternParams(NeighbourParams):
    """LANTERN's total-variation bound delta (0: exact speculative sampling). The default 0.05 is
    the largest delta whose images stayed within AR's run-to-run spread on the embedded model at
    k = 100 (docs/benchmarks.md)."""

    delta: float = 0.05

    def check_values(self, rule: str) -> None:
        _number(rule, "delta", self.delta, 0.0, 1.0)

    def bound(self) -> dict[str, float | None]:
        return {"delta": self.delta}


@dataclass(frozen=True, eq=False)
class LanternPlusPlusParams(NeighbourParams):
    """LANTERN++'s ratio bound lambda >= 1: p~(x) <= lambda p(x) (1: exact)."""

    lam: float = 10.0

    def check_values(self, rule: str) -> None:
        _number(rule, "lam", self.lam, 1.0)

    def bound(self) -> dict[str, float | None]:
        return {"delta": None, "lam": self.lam}


@dataclass(frozen=True, eq=False)
class TopKToleranceParams(RuleParams):
    """VADUSA's tolerance: a draft is accepted while it is among the target's ``top_k`` most
    likely tokens."""

    top_k: int = 5

    def check_values(self, rule: str) -> None:
        _number(rule, "top_k", self.top_k, 1.0, integer=True)


@dataclass(frozen=True, eq=False)
class GsdParams(NeighbourParams):
    """GSD's probability cut: a neighbour joins the cluster when it is among the target's ``top_m``
    most likely codes."""

    top_m: int = 50

    def check_values(self, rule: str) -> None:
        _number(rule, "top_m", self.top_m, 1.0, integer=True)


class AcceptanceRule:
    """Base class: a rule instance holds its validated parameters (``self.params``).

    Class attributes: ``name`` (the registry key), ``Params`` (a :class:`RuleParams` dataclass),
    ``sampling`` (GREEDY | SAMPLING | EITHER), ``lossless``, ``sampling_hint`` (what to use instead
    when the decoding mode does not fit).
    """

    name: ClassVar[str]
    Params: ClassVar[type[RuleParams]] = RuleParams
    sampling: ClassVar[str] = EITHER
    lossless: ClassVar[bool] = True
    sampling_hint: ClassVar[str] = ""
    #: verifies continuous tokens (a :class:`~mmspec.core.continuous.ContinuousOutput`) instead of logits
    continuous: ClassVar[bool] = False

    def __init__(self, params: RuleParams | None = None) -> None:
        self.params = params if params is not None else self.Params()
        self.params.validate(self.name)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "AcceptanceRule":
        """Build the rule from keyword parameters; an unknown keyword is one clear ValueError."""
        known = {field.name for field in dataclasses.fields(cls.Params)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none"
            raise ValueError(f"acceptance={cls.name!r} takes no parameter {', '.join(map(repr, unknown))} "
                             f"(its parameters: {allowed})")
        return cls(cls.Params(**kwargs))

    @classmethod
    def supports_tree(cls) -> bool:
        """Whether the rule has a token-tree form."""
        return cls.verify_tree is not AcceptanceRule.verify_tree

    @classmethod
    def check_mode(cls, sampling: SamplingConfig) -> None:
        """Refuse a decoding mode the rule is not defined for (the class's own: checkable before
        any model loads)."""
        if cls.sampling == SAMPLING and not sampling.do_sample:
            raise ValueError(f"acceptance={cls.name!r} needs do_sample=True; {cls.sampling_hint}")
        if cls.sampling == GREEDY and sampling.do_sample:
            raise ValueError(f"acceptance={cls.name!r} with do_sample=True would not sample; {cls.sampling_hint}")

    def describe(self) -> dict[str, Any]:
        """The rule and its parameters, for the stats' config."""
        return {"acceptance": self.name, **self.params.describe()}

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               uniforms: torch.Tensor | None) -> Verification:
        """Linear form. target_logits: [1, K+1, V]; uniforms: [1, K+1] under sampling, else None."""
        raise NotImplementedError

    def verify_output(self, draft: Draft, target_output: Any, sampling: SamplingConfig, uniforms: torch.Tensor | None,
                      generator: torch.Generator) -> Verification:
        """What the loop calls: the linear form on the target's output (its logits for a discrete
        rule; a continuous rule reads the final steps and may draw from ``generator``)."""
        return self.verify(draft, target_output.logits, sampling, uniforms)

    def verify_tree(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig,
                    uniforms: torch.Tensor | None) -> TreeVerification:
        """Tree form. target_logits: [1, N+1, V] for [root, node_0 .. node_{N-1}]; uniforms: [1, N+1]
        under sampling, else None."""
        raise ValueError(f"acceptance={self.name!r} is not implemented for token trees; use one of "
                         f"{', '.join(name for name, rule in RULES.items() if rule.supports_tree())}, or a linear drafter")


#: rule name -> rule class
RULES: dict[str, type[AcceptanceRule]] = {}


#: class decorator: make ``cls`` available as ``acceptance=cls.name``
register_rule = class_registrar(RULES, "acceptance rule", reserved=(AUTO,))


@register_rule
class GreedyRule(AcceptanceRule):
    """Accept while the draft equals the target's argmax (exact for greedy decoding)."""

    name = "greedy"
    sampling = GREEDY
    sampling_hint = "use 'speculative'"

    def verify(self, draft, target_logits, sampling, uniforms):
        return greedy_verify(draft.tokens, target_logits)

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        return tree_greedy_verify(tree, target_logits)


@register_rule
class SpeculativeRule(AcceptanceRule):
    """Speculative sampling, and SpecInfer's multi-draft form on trees (exact in distribution)."""

    name = "speculative"
    sampling = SAMPLING
    sampling_hint = "greedy decoding uses acceptance='greedy'"
    #: the chain form: a function of (draft tokens, q, p, accept uniforms, sample uniforms)
    chain_verify = staticmethod(speculative_verify)

    def verify(self, draft, target_logits, sampling, uniforms):
        k = draft.length
        return self.chain_verify(draft.tokens, draft.probs, logits_to_probs(target_logits, sampling), uniforms[:, :k],
                                 uniforms[:, k])

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        n = tree.size
        return tree_speculative_verify(tree, logits_to_probs(target_logits, sampling), uniforms[:, :n], uniforms[:, n])


@register_rule
class BlockRule(SpeculativeRule):
    """Block verification on chains (Sun et al., ICLR 2025: the drafts judged jointly, exact in
    distribution, never fewer accepted drafts on average than speculative sampling; what ``"auto"``
    uses under sampling); on trees, SpecInfer's multi-draft form, as ``"speculative"``."""

    name = "block"
    chain_verify = staticmethod(block_verify)


@register_rule
class TypicalRule(AcceptanceRule):
    """Medusa's typical acceptance (lossy): linear, and on trees the longest passing path."""

    name = "typical"
    Params = TypicalParams
    sampling = SAMPLING
    lossless = False
    sampling_hint = "greedy decoding uses acceptance='greedy'"

    def verify(self, draft, target_logits, sampling, uniforms):
        return typical_verify(draft.tokens, logits_to_probs(target_logits, sampling), uniforms[:, draft.length],
                              posterior_threshold=self.params.posterior_threshold,
                              posterior_alpha=self.params.posterior_alpha)

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        return tree_typical_verify(tree, logits_to_probs(target_logits, sampling), uniforms[:, tree.size],
                                   posterior_threshold=self.params.posterior_threshold,
                                   posterior_alpha=self.params.posterior_alpha)


@register_rule
class LanternRule(AcceptanceRule):
    """LANTERN (lossy, TV <= delta per token); greedy: accept when p(x) + c_|A| >= max p."""

    name = "lantern"
    Params = LanternParams
    lossless = False

    def verify(self, draft, target_logits, sampling, uniforms):
        neighbours, bound = self.params.neighbours, self.params.bound()
        if uniforms is None:  # greedy: the un-truncated target distribution
            return lantern_greedy_verify(draft.tokens, target_logits.float().softmax(-1), neighbours, **bound)
        k = draft.length
        return lantern_verify(draft.tokens, draft.probs, logits_to_probs(target_logits, sampling), neighbours,
                              uniforms[:, :k], uniforms[:, k], **bound)

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        neighbours, bound = self.params.neighbours, self.params.bound()
        if uniforms is None:
            return tree_lantern_greedy_verify(tree, target_logits.float().softmax(-1), neighbours, **bound)
        n = tree.size
        return tree_lantern_verify(tree, logits_to_probs(target_logits, sampling), neighbours, uniforms[:, :n],
                                   uniforms[:, n], **bound)


@register_rule
class LanternPlusPlusRule(LanternRule):
    """LANTERN++ (lossy, p~(x) <= lam p(x)); the forms of :class:`LanternRule` with the ratio bound."""

    name = "lantern++"
    Params = LanternPlusPlusParams


@register_rule
class GsdRule(AcceptanceRule):
    """Grouped speculative decoding (lossy): the draft's cluster mass decides; a sampling rule."""

    name = "gsd"
    Params = GsdParams
    sampling = SAMPLING
    lossless = False
    sampling_hint = "for greedy decoding use 'lantern'"

    def verify(self, draft, target_logits, sampling, uniforms):
        k = draft.length
        return gsd_verify(draft.tokens, draft.probs, logits_to_probs(target_logits, sampling), self.params.neighbours,
                          uniforms[:, :k], uniforms[:, k], top_m=self.params.top_m)

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        n = tree.size
        return tree_gsd_verify(tree, logits_to_probs(target_logits, sampling), self.params.neighbours, uniforms[:, :n],
                               uniforms[:, n], top_m=self.params.top_m)


@register_rule
class TopKToleranceRule(AcceptanceRule):
    """VADUSA's top-k tolerance (lossy): accept drafts among the target's top k; on trees the
    deepest path of such tokens."""

    name = "topk-tolerance"
    Params = TopKToleranceParams
    lossless = False

    @staticmethod
    def _probs(target_logits, sampling, uniforms):
        return target_logits.float().softmax(-1) if uniforms is None else logits_to_probs(target_logits, sampling)

    def verify(self, draft, target_logits, sampling, uniforms):
        return topk_tolerance_verify(draft.tokens, self._probs(target_logits, sampling, uniforms), top_k=self.params.top_k,
                                     sample_uniforms=None if uniforms is None else uniforms[:, draft.length])

    def verify_tree(self, tree, target_logits, sampling, uniforms):
        return tree_topk_tolerance_verify(tree, self._probs(target_logits, sampling, uniforms), top_k=self.params.top_k,
                                          sample_uniforms=None if uniforms is None else uniforms[:, tree.size])


@register_rule
class GroupRule(AcceptanceRule):
    """PCG group acceptance (lossy at token level, exact over overlapping acoustic-similarity
    groups built from ``neighbours``: :func:`~mmspec.core.relaxed.group_verify`); greedy: accept a
    draft sharing a group with the argmax. Chains only: a tree form (a multi-draft walk over
    overlapping groups) is not derived."""

    name = "group"
    Params = NeighbourParams
    lossless = False

    def __init__(self, params: RuleParams | None = None) -> None:
        super().__init__(params)
        self.groups = TokenGroups(self.params.neighbours)

    def verify(self, draft, target_logits, sampling, uniforms):
        if uniforms is None:
            return group_greedy_verify(draft.tokens, target_logits, self.groups)
        k = draft.length
        return group_verify(draft.tokens, draft.probs, logits_to_probs(target_logits, sampling), self.groups,
                            uniforms[:, :k], uniforms[:, k])


@dataclass(frozen=True, eq=False)
class CSpDParams(RuleParams):
    """Continuous speculative decoding: ``trajectory_jacobian`` multiplies the exact ratio by the
    paper's prod_t sqrt|Sigma_t^q| / sqrt|Sigma_t^p| (not exact when the heads learn their variances);
    ``max_tries``: residual proposals per rejection before the last proposal (a draw from the
    target's final step) stands in."""

    trajectory_jacobian: bool = False
    max_tries: int = 4096

    def check_values(self, rule: str) -> None:
        if not isinstance(self.trajectory_jacobian, bool):
            raise ValueError(f"acceptance={rule!r}: trajectory_jacobian must be True or False, got {self.trajectory_jacobian!r}")
        _number(rule, "max_tries", self.max_tries, 1.0, integer=True)


@register_rule
class CSpDRule(AcceptanceRule):
    """Continuous speculative decoding (Wang et al. 2024): accept a drafted continuous token with
    probability min(1, p(x | E) / q(x | E)) of the two final-step Gaussians under shared chain noise
    E; on rejection draw from norm(max(0, p - q)) by acceptance-rejection with p as proposal
    (:func:`mmspec.core.continuous.cspd_verify`)."""

    name = "cspd"
    Params = CSpDParams
    sampling = SAMPLING
    continuous = True
    sampling_hint = "continuous tokens are drawn by a diffusion chain, which always samples"

    def verify(self, draft, target_logits, sampling, uniforms):
        raise ValueError("acceptance='cspd' verifies continuous tokens; use it with a continuous-token target (MAR)")

    def verify_output(self, draft, target_output, sampling, uniforms, generator):
        return cspd_verify(draft.trajectory, target_output.steps, uniforms, generator, self.params.trajectory_jacobian,
                           self.params.max_tries, getattr(self.params, "exponent_temperature", 1.0))


@dataclass(frozen=True, eq=False)
class TemperedCSpDParams(CSpDParams):
    """The released CSpD code's relaxation: the ratio's exponent divided by ``exponent_temperature``^2
    (42 there). Lossy, with no stated bound: the benchmark measures what it costs in quality."""

    exponent_temperature: float = 42.0

    def check_values(self, rule: str) -> None:
        super().check_values(rule)
        _number(rule, "exponent_temperature", self.exponent_temperature, 1.0)


@register_rule
class TemperedCSpDRule(CSpDRule):
    """CSpD with a tempered exponent, as the released code runs it (lossy)."""

    name = "cspd-tempered"
    Params = TemperedCSpDParams
    lossless = False


def resolve_rule(acceptance: str | AcceptanceRule | None, sampling: SamplingConfig,
                 rule_kwargs: dict[str, Any] | None = None, continuous: bool = False) -> AcceptanceRule:
    """The rule instance for ``acceptance`` under ``sampling``.

    Args:
        acceptance: a rule name of :data:`RULES`, "auto"/None (greedy without sampling, block
            verification with it: speculative sampling's exact output, never fewer drafts kept on
            average), or a rule instance.
        rule_kwargs: the rule's parameters (its ``Params`` fields); not allowed with an instance.
        continuous: the target emits continuous tokens ("auto" is then "cspd").
    Raises:
        ValueError: an unknown name, a bad parameter, a decoding mode the rule does not support, or
            a rule for the other kind of token.
    """
    if isinstance(acceptance, AcceptanceRule):
        if rule_kwargs:
            raise ValueError("pass rule_kwargs only with a rule name; a rule instance already holds its parameters")
        rule = acceptance
    else:
        name = acceptance or AUTO
        if name == AUTO:
            name = CSpDRule.name if continuous else BlockRule.name if sampling.do_sample else GreedyRule.name
        if name not in RULES:
            raise ValueError(f"unknown acceptance rule {name!r}; choose one of {(AUTO, *RULES)}")
        rule = RULES[name].from_kwargs(**(rule_kwargs or {}))
    if rule.continuous != continuous:
        kind = "continuous" if continuous else "discrete"
        allowed = [name for name, cls in RULES.items() if cls.continuous == continuous]
        raise ValueError(f"acceptance={rule.name!r} does not verify {kind} tokens; choose one of {allowed}")
    rule.check_mode(sampling)
    return rule
