"""Hardware-aware draft sizes: the target's measured verification cost curve decides how many
draft tokens (or tree nodes) are worth verifying.

One step that verifies n draft tokens costs T(n) = C(n + 1) + n_forwards * c_draft, where C(m) is
the measured time of one target forward over m new tokens (on a CPU, C(2..4) ~ C(1) but C(64)
~ 3 C(1); on a GPU the curve stays flat much longer) and c_draft the drafter's forward time. With
a_i the probability that the first i draft tokens are all accepted (for a chain: the product of
acceptance probabilities; for a tree: the sum of the path probabilities of the nodes at depth i
is the expected number of accepted tokens at depth i), the expected tokens per step are
1 + sum_i a_i, and the best size maximises

    speed(n) = (1 + sum_{i <= n} a_i) / T(n).

Drafters estimate a_i from their own confidences (EAGLE-2's cumulative confidence V, exp(score)).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .cache import crop_cache
from .target import max_length

#: curves measured in this process, by (model id, device, dtype, threads)
_CURVES: dict[tuple, dict[int, float]] = {}


def measure_verification_cost(target, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 200, repeats: int = 5,
                              model_inputs: dict | None = None, state=None) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after a cached prompt: ``context``
    random tokens, or ``model_inputs`` (the prompt a generation prefilled, for targets whose
    prompt is not token ids, such as the guided image targets). The sizes take turns, one forward
    each per round (the first round a warm-up), so that a drift of the machine's speed during the
    measurement falls on every n alike rather than on the last ones measured.

    Args:
        target: a :class:`~mmspec.core.target.Target`.
        sizes: the n to measure.
        state: a live sequence of ``target`` (its prompt prefilled, nothing verified yet) to measure
            on instead of prefilling a new one; every measured forward is cropped away again, so the
            sequence goes on unchanged. A target that holds one sequence at a time (captured
            graphs over one static KV cache) can only be measured this way during a generation.
    Returns:
        {n: seconds}.
    """
    high = min(20000, target.vocab_size)  # ordinary tokens of any vocabulary
    device = target.device
    if model_inputs is None:
        model_inputs = {"input_ids": torch.randint(0, high, (1, context), generator=torch.Generator().manual_seed(0)).to(device)}
    curve = {}
    with torch.inference_mode():
        if state is None:
            state, _ = target.prefill(model_inputs)
        context = state.cache_length
        room = max_length(target)  # positions left after the prompt (image grids are short)
        sizes = [n for n in sizes if room is None or context + n <= room] or [1]
        tokens = {n: torch.randint(0, high, (1, n), generator=torch.Generator().manual_seed(n)).to(device) for n in sizes}
        times = {n: [] for n in sizes}
        for _ in range(repeats + 1):  # the sizes in turn: a drift of the machine's speed falls on all of them alike
            for n in sizes:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                target.forward(state, tokens[n])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[n].append(time.perf_counter() - started)
                crop_cache(state.cache, context)  # drop the n appended entries
        for n in sizes:
            curve[n] = statistics.median(times[n][1:])
    return curve


def cached_verification_cost(target, model_inputs: dict | None = None, state=None) -> dict[int, float]:
    """:func:`measure_verification_cost` once per model, device, dtype and thread count (on ``state``,
    the generation's live sequence, where given)."""
    model = target.model
    key = (id(model), str(target.device), str(next(model.parameters()).dtype), torch.get_num_threads())
    if key not in _CURVES:
        _CURVES[key] = measure_verification_cost(target, model_inputs=model_inputs, state=state)
    return _CURVES[key]


@dataclass
class CostModel:
    """T(n) from a measured curve {m new tokens: seconds} (linear between points, linear beyond).

    Attributes:
        curve: {m: seconds of one target forward over m new tokens}.
    """

    curve: dict[int, float]
    _costs: list[float] = field(default_factory=list, init=False, repr=False)

    def forward_cost(self, m: int) -> float:
        points = sorted(self.curve.items())
        if m <= points[0][0]:
            return points[0][1]
        for (m0, t0), (m1, t1) in zip(points, points[1:]):
            if m <= m1:
                return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
        (m0, t0), (m1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (m - m1) / (m1 - m0)

    def best_size(self, expected_gain: torch.Tensor, drafting_time: float = 0.0) -> int:
        """n in 0..len(expected_gain) maximising (1 + sum_{i<=n} gain_i) / (C(n + 1) + drafting_time).

        Args:
            expected_gain: [N] expected accepted tokens contributed by each draft token / node,
                in the order they would be kept (chain: a_1, a_2, ...; tree: nodes by score).
            drafting_time: seconds the drafter spent on this step.
        """
        gains = torch.cat([expected_gain.new_zeros(1), expected_gain.float().cumsum(0)]).cpu() + 1
        while len(self._costs) < len(gains):  # C(1), C(2), ... interpolated once per size
            self._costs.append(self.forward_cost(len(self._costs) + 1))
        costs = torch.tensor(self._costs[: len(gains)]) + drafting_time
        return int(torch.argmax(gains / costs))


class DepthCalibration:
    """Online calibration of a tree drafter's confidences against the acceptance it observes.

    In a deterministic draft tree at most one node per depth is accepted, so the expected accepted
    length satisfies P(accepted >= d) = sum over the depth-d nodes of P(node accepted); a drafter
    predicts it with sum_{depth d} V_i (EAGLE-2's cumulative confidences). A head trained on greedy
    outputs overstates acceptance under sampling, so per depth

        rho_d = EMA(1[accepted >= d]) / EMA(sum_{depth-d nodes} V_i),   gain_i = rho_{d(i)} V_i.

    Both running means start at 1 (rho = 1: the drafter is trusted until evidence arrives).

    Args:
        max_depth: deepest tree layer tracked.
        decay: EMA weight of the past per verified step.
    """

    def __init__(self, max_depth: int, decay: float = 0.7) -> None:
        self.predicted = torch.ones(max_depth + 1)
        self.accepted = torch.ones(max_depth + 1)
        self.decay = decay

    def factors(self) -> torch.Tensor:
        """rho [max_depth + 1] (index = depth; index 0 unused), clamped to [0.05, 2]."""
        return (self.accepted / self.predicted).clamp(0.05, 2.0)

    def update(self, depth_sums: torch.Tensor, accepted_length: int) -> None:
        """depth_sums: [D + 1] sum of V over the verified tree's nodes per depth (D = its depth);
        accepted_length: draft tokens accepted (0..D)."""
        depths = torch.arange(1, len(depth_sums))
        old = 1 - self.decay
        self.predicted[depths] = self.decay * self.predicted[depths] + old * depth_sums[1:].float()
        self.accepted[depths] = self.decay * self.accepted[depths] + old * (depths <= accepted_length).float()


class PathCalibration:
    """Online calibration of a greedy tree drafter's confidences, each depth given the one above.

    In a greedy (deterministic) draft tree a node is accepted iff its parent was and its token is
    the target's choice there; the drafter's confidence in that is the node's conditional
    q_i = V_i / V_parent(i) (EAGLE-2's cumulative confidences V). Per depth

        r_d = EMA(1[accepted >= d]) / EMA(sum of q over the verified children of the accepted node at depth d - 1),
        rho_d = r_1 r_2 ... r_d,     gain_i = rho_{d(i)} V_i,

    each r_d's running means (both starting at 1: trusted until evidence arrives) updated only by
    the steps whose accepted path reached depth d - 1 and verified children there. Against a
    running mean of 1[accepted >= d] over one of sum V per depth (:class:`DepthCalibration`), a
    rejection at depth 1 no longer lowers the depths below it on its own, so a depth the trees
    stop reaching does not stay low: there, two steps rejected at their first token set rho_3 ~ 0.3
    in one caption, and the trees of two nodes that followed, accepted whole, no longer verified
    depth 3 to raise it; here such a step lowers r_1 only, which the accepted steps after it restore.

    Args:
        max_depth: deepest tree layer tracked.
        decay: EMA weight of the past per update of a depth.
    """

    def __init__(self, max_depth: int, decay: float = 0.7) -> None:
        self.predicted = torch.ones(max_depth + 1)
        self.accepted = torch.ones(max_depth + 1)
        self.decay = decay

    def factors(self) -> torch.Tensor:
        """rho [max_depth + 1] (index = depth; index 0 is 1): the products of r_1 .. r_d, each r
        and each product clamped to [0.05, 2]."""
        rates = (self.accepted / self.predicted).clamp(0.05, 2.0)
        rates[0] = 1.0
        return rates.cumprod(0).clamp(0.05, 2.0)

    def update(self, conditional_sums: torch.Tensor, accepted_length: int) -> None:
        """conditional_sums: [D + 1], at d the sum of q over the verified children of the accepted
        path's node at depth d - 1 (the root's at d = 1), 0 where it had none or the path stopped
        above d - 1; accepted_length: draft tokens accepted."""
        old = 1 - self.decay
        for d in range(1, min(len(conditional_sums) - 1, accepted_length + 1, len(self.predicted) - 1) + 1):
            total = float(conditional_sums[d])
            if total <= 0:
                continue
            self.predicted[d] = self.decay * self.predicted[d] + old * total
            self.accepted[d] = self.decay * self.accepted[d] + old * float(accepted_length >= d)

    @staticmethod
    def path_sums(parents: torch.Tensor, log_values: torch.Tensor, path: list[int]) -> torch.Tensor:
        """A verified greedy tree (parents [N], -1 = the root; log V [N]) and its accepted path (node
        indices, depth 1 first) -> the conditional sums :meth:`update` reads, [len(path) + 2]."""
        sums = torch.zeros(len(path) + 2)
        parents, log_values = parents.cpu(), log_values.float().cpu()
        above = [-1] + list(path)
        for d, parent in enumerate(above, start=1):
            children = parents == parent
            base = 0.0 if parent < 0 else float(log_values[parent])
            sums[d] = float((log_values[children] - base).exp().sum())
        return sums


class ChainAcceptance:
    """Online estimate of how far a drafted chain is accepted, P(accepted >= d) for d = 1 .. D.

    It is kept as conditional rates a_d = P(draft d accepted | drafts 1 .. d-1 accepted), each a
    running mean updated only by steps that reached depth d (drafted it with 1 .. d-1 accepted):

        P(accepted >= d) = a_1 a_2 ... a_d.

    Unlike a running mean of P(accepted >= d) per depth, a depth that a shallow plan stops drafting
    keeps a sensible estimate (its conditional rate, not a product frozen at a bad moment), so a
    plan shortened by a run of rejections can grow again.

    Args:
        max_depth: deepest draft position tracked.
        decay: running-mean weight of the past per step that reached the depth.
    """

    def __init__(self, max_depth: int, decay: float = 0.8) -> None:
        self.rates = torch.ones(max_depth + 1)  # index = depth; index 0 unused
        self.decay = decay

    def survival(self) -> torch.Tensor:
        """[max_depth + 1]: entry d = P(accepted >= d) (entry 0 = 1)."""
        return torch.cat([torch.ones(1), self.rates[1:].clamp(0.02, 1.0).cumprod(0)])

    def update(self, drafted_depth: int, accepted_length: int) -> None:
        """One verified chain (or tree) of depth ``drafted_depth`` whose accepted path has length
        ``accepted_length``: depths 1 .. min(drafted, accepted + 1) were reached."""
        for depth in range(1, min(drafted_depth, accepted_length + 1, len(self.rates) - 1) + 1):
            self.rates[depth] = self.decay * self.rates[depth] + (1 - self.decay) * float(accepted_length >= depth)
