"""What an automatically sized draft tree may cost: the inputs of EAGLE-2's ``num_nodes="auto"``.

A tree step that drafts for time t and verifies n nodes is worth

    speed(n) = (1 + sum_{i <= n} gain_i) / (C(n + 1) + t)

(:mod:`mmspec.core.cost`), and another tree layer is worth drafting while the token it may add,
worth one target forward C(1), repays its cost c_layer. A :class:`TreeBudget` supplies C, c_layer
and t; the drafter asks it, never the clock:

- :class:`TimedBudget` (``"timed"``): C measured on this device before the generation
  (:func:`~mmspec.core.cost.cached_verification_cost`), c_layer and t timed as the drafter runs.
  The most hardware-aware, but wall-clock noise changes the tree from run to run.
- :class:`NominalBudget` (``"nominal"``): a deterministic cost model in units of C(1): a fixed
  curve shape C(m) / C(1) per device type, c_layer = (parameters one draft layer reads) /
  (parameters one target forward reads) (decoding at batch 1 is bound by reading the weights), and
  t = c_layer per head forward of the step. The same inputs always give the same tree.

Under sampling the tree's shape decides which random numbers are drawn, and under a lossy rule
(LANTERN, GSD) which relaxed tokens are accepted, so such a generation is reproducible only when
the size does not depend on the clock: EAGLE-2's default ``budget="auto"`` takes the nominal
budget whenever the generation samples or its rule is lossy, and the timed one for exact greedy
decoding (whose output is the target's whatever the tree). Budgets are registered by name (:data:`BUDGETS`).
"""

from __future__ import annotations

import math
import time
from typing import Callable, ClassVar

import torch
from torch import nn

from ..core.cost import ChainAcceptance, CostModel, DepthCalibration, PathCalibration, cached_verification_cost
from ..core.registry import class_registrar
from ..core.tree import TokenTree

#: name -> budget class (:func:`register_budget`)
BUDGETS: dict[str, type["TreeBudget"]] = {}

#: C(m) / C(1) of the nominal budget by device type: on CPUs the AVX-512 BF16 machine's measured
#: curve (docs/drafters.md); a GPU's verification cost stays flat much longer.
NOMINAL_CURVES = {
    "cpu": {1: 1.0, 2: 1.13, 4: 1.19, 8: 1.27, 16: 1.44, 32: 1.81, 64: 2.67},
    "cuda": {1: 1.0, 32: 1.0, 64: 1.1, 128: 1.4, 256: 2.0},
}


_register = class_registrar(BUDGETS, "tree budget", reserved=("auto",))


def register_budget(name: str) -> Callable[[type["TreeBudget"]], type["TreeBudget"]]:
    """Class decorator: the budget ``cls`` under ``name`` (a name taken, or "auto", is refused)."""

    def register(cls: type[TreeBudget]) -> type[TreeBudget]:
        cls.name = name
        return _register(cls)

    return register


def forward_parameters(module: nn.Module) -> int:
    """Parameters a forward of ``module`` reads per token: all but embedding tables (a forward
    gathers a few of their rows)."""
    gathered = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in gathered)


class TreeBudget:
    """C(m), c_layer and the drafting time t of one generation's auto-sized trees.

    Per tree step: :meth:`begin_step` when drafting starts, :meth:`layer_done` at every layer
    expansion, then :meth:`spent` / :meth:`best_size` while deciding.

    Attributes:
        cost: C(m), seconds (timed) or units of C(1) (nominal) of one target forward over m tokens.
        layer_cost: c_layer in the same unit, None until known.
    """

    name: ClassVar[str] = "budget"

    def __init__(self, cost: CostModel, layer_cost: float | None = None) -> None:
        self.cost = cost
        self.layer_cost = layer_cost
        self.layers = 0  # layer expansions in the current step

    @classmethod
    def for_generation(cls, context, relative_layer_cost: float, state) -> "TreeBudget":
        """The budget of a generation (``context``: the drafter's DraftContext; ``state``: its live
        sequence, just prefilled), given c_layer / C(1) estimated from the parameter counts (used by
        the nominal budget)."""
        raise NotImplementedError

    def begin_step(self) -> None:
        self.layers = 0

    def layer_done(self) -> int:
        """Count a layer expansion; returns the expansions of this step so far (1 at the first)."""
        self.layers += 1
        return self.layers

    def spent(self) -> float:
        """t: the drafting time of this step so far."""
        raise NotImplementedError

    def forward_cost(self, m: int) -> float:
        return self.cost.forward_cost(m)

    def best_size(self, gains) -> int:
        """:meth:`~mmspec.core.cost.CostModel.best_size` with the drafting time so far."""
        return self.cost.best_size(gains, self.spent())

    def describe(self) -> dict:
        return {"tree_budget": self.name}


@register_budget("timed")
class TimedBudget(TreeBudget):
    """C measured on this device (once per process and model); c_layer a running mean of the time
    between two layer expansions (head forward + tree bookkeeping), t the time since
    :meth:`begin_step`, all read from ``clock``."""

    def __init__(self, cost: CostModel, clock: Callable[[], float] | None = None) -> None:
        super().__init__(cost)
        self.clock = clock or time.perf_counter
        self.started = 0.0
        self.last_layer: float | None = None

    @classmethod
    def for_generation(cls, context, relative_layer_cost: float, state) -> "TimedBudget":
        return cls(CostModel(cached_verification_cost(context.target, context.model_inputs, state)))

    def begin_step(self) -> None:
        super().begin_step()
        self.started, self.last_layer = self.clock(), None

    def layer_done(self) -> int:
        now = self.clock()
        if self.last_layer is not None:
            seconds = now - self.last_layer
            self.layer_cost = seconds if self.layer_cost is None else 0.8 * self.layer_cost + 0.2 * seconds
        self.last_layer = now
        return super().layer_done()

    def spent(self) -> float:
        return self.clock() - self.started


@register_budget("nominal")
class NominalBudget(TreeBudget):
    """A deterministic cost model in units of C(1) (see the module doc): t = c_layer x (the step's
    catch-up forward + its layer expansions so far)."""

    @classmethod
    def for_generation(cls, context, relative_layer_cost: float, state) -> "NominalBudget":
        curve = NOMINAL_CURVES.get(context.target.device.type, NOMINAL_CURVES["cpu"])
        return cls(CostModel(dict(curve)), relative_layer_cost)

    def spent(self) -> float:
        return self.layer_cost * (1 + self.layers)

    def describe(self) -> dict:
        return {**super().describe(), "layer_cost_c1": round(self.layer_cost, 4)}


def budget_class(name: str, output_follows_draft: bool) -> type[TreeBudget]:
    """The budget called ``name``; ``"auto"``: nominal when the tree's shape can change the output
    (:attr:`mmspec.core.drafter.DraftContext.output_follows_draft`: sampling, or a lossy rule), so
    that a seed reproduces it; else (exact greedy decoding) timed.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        name = "nominal" if output_follows_draft else "timed"
    if name not in BUDGETS:
        raise ValueError(f"unknown tree budget {name!r}; use 'auto' or one of {sorted(BUDGETS)}")
    return BUDGETS[name]


class TreeBudgetPolicy:
    """EAGLE-2's ``num_nodes="auto"`` for one generation: how deep each tree grows and which of its
    nodes are verified, from the expected tokens per unit of cost (costs from a :class:`TreeBudget`).

    Top-k trees (greedy decisions, q = 1 per node):

    - depth: another layer is drafted while rho_d V_max T_tok > c_layer + dC, V_max the cumulative
      confidence of the best node to expand: the rho_d V_max tokens it may add are worth what a
      token costs now, T_tok (a running mean of each step's (C(n + 1) + t) / tokens committed,
      C(1) before the first step: a step that commits tau tokens for cost S takes S / tau a token,
      so one more expected token per step saves S / tau, not one target forward), and cost the
      layer's drafting time c_layer plus the verification of one more node, dC = C(n + 2) - C(n + 1)
      at the last verified tree's n nodes (the marginal cost: on a CPU whose FMAs bind from a few
      rows the curve is convex, flat to ~4 rows, then ~0.2 C(1) a row, and the tree's mean per node
      understates what one more costs). On a flat cost curve dC ~ 0; on a steep one it stops the
      growth where a node costs more than it brings.
      Layers 2 and 3 are always drafted, so a timed c_layer keeps being measured;
    - size: of the grown candidates, the n most confident that maximise
      (1 + sum_{i <= n} rho_{d(i)} V_i) / (C(n + 1) + t) are kept.

    rho_d calibrates the confidences per depth against the acceptance observed so far, each depth
    given the one above (:class:`~mmspec.core.cost.PathCalibration`).

    Sampled trees (children drawn from q; whether a slot opens may not depend on its token):

    - the first-child chain's depth D is planned before anything is drawn (:meth:`chain_depth`);
    - any other slot opens only while it raises the planned tree's tokens per unit of cost
      (:meth:`sibling_rule`).

    Args:
        budget: C(m), c_layer and t.
        max_depth: the deepest tree layer.
        calibration: the top-k trees' rho to start from and update (default: a new one, rho = 1).
    """

    def __init__(self, budget: TreeBudget, max_depth: int, calibration: PathCalibration | None = None) -> None:
        self.budget = budget
        self.calibration = PathCalibration(max_depth) if calibration is None else calibration
        self.chain_acceptance = ChainAcceptance(max_depth)  # sampled trees: how far the first-child chain is accepted
        self.sibling_calibration = DepthCalibration(1)  # sampled trees: siblings apart from the chain
        self.verified_tree: TokenTree | None = None  # the top-k tree in verification
        self.path_sums: torch.Tensor | None = None  # its PathCalibration sums, once its accepted path is known
        self.verified_siblings: tuple[set[int], float] | None = None  # (sibling nodes, sum of their V)
        self.sibling_accepted = False
        self.token_cost: float | None = None  # T_tok: running mean of a step's cost per committed token
        self.node_cost = 0.0  # dC: what one more node adds to the last verified tree's forward
        self.step_cost: float | None = None  # C(n + 1) + t of the tree in verification

    # ---- one tree step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.budget.begin_step()

    def expand_while(self, sampled: bool) -> Callable[[float], bool]:
        """``expand_while`` for the tree builders: the depth rule of top-k trees; for sampled trees
        (whose depth :meth:`chain_depth` planned) it only counts the layers."""
        if sampled:
            return lambda best_log_value: self.budget.layer_done() > 0

        def worth_another_layer(best_log_value: float) -> bool:
            layers = self.budget.layer_done()
            if layers <= 2:
                return True
            rho = float(self.calibration.factors()[layers + 1])  # the layer about to be drafted
            value = self.budget.forward_cost(1) if self.token_cost is None else self.token_cost
            return rho * math.exp(best_log_value) * value > self.budget.layer_cost + self.node_cost

        return worth_another_layer

    def chain_depth(self, max_depth: int) -> int:
        """Sampled trees: the depth D of the first-child chain, fixed before anything is drawn.

        The chain's expected accepted tokens are s_1 + ... + s_D with s_d = P(accepted >= d) as
        observed so far (:class:`~mmspec.core.cost.ChainAcceptance`); D maximises
        (1 + sum_{d <= D} s_d) / (C(D + 1) + (D - 1) c_layer + t). At least 1, so the estimate
        keeps seeing evidence."""
        rho = self.chain_acceptance.survival()
        layer, spent = self.budget.layer_cost or 0.0, self.budget.spent()
        best, best_speed, gain = 1, 0.0, 1.0
        for d in range(1, max_depth + 1):
            gain += float(rho[d])
            speed = gain / (self.budget.forward_cost(d + 1) + (d - 1) * layer + spent)
            if speed > best_speed:
                best, best_speed = d, speed
        return best

    def sibling_rule(self, chain_depth: int) -> Callable[[float, int], bool]:
        """``open_slot`` for :func:`~mmspec.core.tree.sampled_dynamic_tree`: the chain's first
        children (V = 1) are opened as planned; any other slot only while it raises the expected
        tokens per unit of cost of the whole planned tree, (1 + G + g) / (C(n + 2) + t) >
        (1 + G) / (C(n + 1) + t), with n and G the nodes and calibrated gains opened or still
        planned, g = rho V and t the drafting time so far. Off-chain slots (siblings and their
        subtrees) have their own calibration: how often the accepted path left the chain through a
        sibling, per unit of sibling V drafted."""
        rho = self.chain_acceptance.survival()
        rho_sibling = float(self.sibling_calibration.factors()[1])
        planned = {"nodes": chain_depth, "gain": float(rho[1 : chain_depth + 1].sum())}
        cost = self.budget.forward_cost

        def open_slot(log_value: float, node_depth: int) -> bool:
            if log_value == 0.0:  # the chain (V = 1 only there)
                return node_depth <= chain_depth
            gain = rho_sibling * math.exp(log_value)
            n, total, spent = planned["nodes"], 1 + planned["gain"], self.budget.spent()
            if (total + gain) * (cost(n + 1) + spent) <= total * (cost(n + 2) + spent):
                return False
            planned["nodes"], planned["gain"] = n + 1, planned["gain"] + gain
            return True

        return open_slot

    def settle(self, tree: TokenTree, sampled: bool) -> TokenTree:
        """The tree to verify: for top-k trees the n most confident nodes (ancestor-closed
        prefixes) that pay; sampled trees are kept whole. Remembers what calibration needs."""
        if not sampled:
            order = torch.argsort(-tree.scores, stable=True)
            gains = tree.scores[order].exp().cpu() * self.calibration.factors()[tree.depth[order.cpu()]]
            tree = tree.select(order[: self.budget.best_size(gains)].cpu())
        cost = self.budget.forward_cost
        self.step_cost = cost(tree.size + 1) + self.budget.spent()
        self.node_cost = max(0.0, cost(tree.size + 2) - cost(tree.size + 1))
        if sampled:  # the chain of first children (ChainAcceptance); the siblings apart
            siblings = sorted(kid for parent in range(-1, tree.size) for kid in tree.children(parent)[1:])
            self.verified_siblings = (set(siblings), float(tree.scores.exp().float().cpu()[siblings].sum()))
        else:
            self.verified_tree = tree
        return tree

    # ---- feedback -------------------------------------------------------------------------------
    def on_tree_verified(self, path: torch.Tensor) -> None:
        """path: LongTensor [n] accepted node indices of the verified tree."""
        if self.verified_tree is not None:
            self.path_sums = PathCalibration.path_sums(self.verified_tree.parents, self.verified_tree.scores, path.tolist())
        self.sibling_accepted = self.verified_siblings is not None and any(int(n) in self.verified_siblings[0] for n in path)

    def on_verified(self, drafted_depth: int, num_drafted: int, num_accepted: int) -> None:
        """Update the calibrations with a verified tree of depth ``drafted_depth``."""
        if self.path_sums is not None and num_drafted:
            self.calibration.update(self.path_sums, num_accepted)
        if self.verified_siblings is not None:
            self.chain_acceptance.update(drafted_depth, num_accepted)
            if self.verified_siblings[1] > 0:
                self.sibling_calibration.update(torch.tensor([0.0, self.verified_siblings[1]]), int(self.sibling_accepted))
        self.verified_tree, self.path_sums, self.verified_siblings = None, None, None
        if self.step_cost is not None:
            per_token = self.step_cost / (num_accepted + 1)
            self.token_cost = per_token if self.token_cost is None else 0.7 * self.token_cost + 0.3 * per_token
            self.step_cost = None

    def describe(self) -> dict:
        return self.budget.describe()
