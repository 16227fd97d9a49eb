"""Speculative Jacobi decoding (SJD, Teng et al., ICLR 2025) and its coupled variant, as drafters.

SJD needs no draft model: the target's own previous forward is the draft. Each step the target
runs on [pending token, d_1 .. d_K] (K = the window L, 16 by default); the loop verifies d_i with
the speculative-sampling rule against q_i, the distribution d_i was sampled from one iteration
earlier (P_{t-1}), i.e. accept iff r < min(1, P_t(d_i) / P_{t-1}(d_i)), and on the first rejection
resamples from norm(max(0, P_t - P_{t-1})) — exactly :func:`~mmspec.core.verify.speculative_verify`.
Afterwards (:meth:`on_verified`) the forward's outputs past the accepted prefix become the next
iteration's drafts: d'_j ~ P_t(. | position j), with q'_j = P_t. New positions at the end of the
window are initialised without a model (q = 1 on the chosen token, so they are accepted with
probability P_t(x)):

* ``random``: a uniformly random code;
* ``horizontal``: a copy of the token to the left;
* ``vertical``: a copy of the token one row up (needs the grid width; the target's ``grid``).

Coupled SJD (``coupled=True``; maximal coupling of consecutive iterates, as in SCD / MC-SJD): the
redraft at a position that already held a draft x ~ q keeps x with probability
min(1, P_t(x) / q(x)) and otherwise draws from norm(max(0, P_t - q)). Its marginal is still P_t,
so verification stays exact, but drafts stop churning once the iterates agree.

With ``do_sample=False`` drafts are the argmaxes (Jacobi decoding) and greedy verification makes
the output identical to AR decoding.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.sampling import logits_to_probs, sample_from_probs
from ..core.target import TargetOutput, image_grid
from ..core.tree import TokenTree
from ..core.verify import exact_argmax
from ..modeling.fast_linear import coupled_rows

INIT_STRATEGIES = ("random", "horizontal", "vertical")


def coupled_redraft(old_tokens: torch.Tensor, old_probs: torch.Tensor, new_probs: torch.Tensor,
                    uniforms: torch.Tensor) -> torch.Tensor:
    """Maximal coupling of q (old) and p (new): keep x ~ q with probability min(1, p(x)/q(x)), else
    draw from norm(max(0, p - q)). The result is distributed as p.

    Args:
        old_tokens: LongTensor [m] tokens drawn from old_probs.
        old_probs, new_probs: [m, V] the distributions q and p.
        uniforms: [m, 2] uniforms (keep test, residual draw).
    Returns:
        LongTensor [m].
    """
    p_x = new_probs.gather(-1, old_tokens[:, None])[:, 0]
    q_x = old_probs.gather(-1, old_tokens[:, None])[:, 0]
    keep = uniforms[:, 0] * q_x < p_x  # r < p(x) / q(x), without dividing by q(x) = 0
    residual = (new_probs - old_probs).clamp_min(0)
    empty = residual.sum(-1) <= 0  # p == q: nothing to correct, any draw from p is exact
    residual = torch.where(empty[:, None], new_probs, residual)
    redrawn = sample_from_probs(residual, uniforms[:, 1])
    return torch.where(keep, old_tokens, redrawn)


@register_drafter("sjd")
class JacobiDrafter(BatchDrafting, Drafter):
    """Args:
        num_draft_tokens: the window L (tokens verified per forward).
        init: how new window positions are initialised, one of :data:`INIT_STRATEGIES`.
        coupled: redraft with the maximal coupling of consecutive iterates.
        grid_width: tokens per image row (``vertical`` init); default: the target's ``grid``.
    """

    spec_argument = "init"

    def __init__(self, num_draft_tokens: int = 16, init: str = "random", coupled: bool = False,
                 grid_width: int | None = None) -> None:
        super().__init__(num_draft_tokens)
        self.check_spec_argument(init)
        self.init, self.coupled, self.grid_width = init, coupled, grid_width
        self.carried_tokens: torch.Tensor | None = None
        self.carried_probs: torch.Tensor | None = None
        self.last_draft: Draft | None = None

    @classmethod
    def check_spec_argument(cls, argument: str | None) -> None:
        if argument is not None and argument not in INIT_STRATEGIES:
            raise ValueError(f"unknown SJD init {argument!r}; choose one of {INIT_STRATEGIES}")

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "JacobiDrafter":
        """``"sjd"``, ``"sjd:vertical"``, ``"sjd:horizontal"``, ``"sjd:random"``."""
        return cls(num_draft_tokens or 16, init=arg or "random")

    def start(self, context: DraftContext, state: SequenceState) -> None:
        super().start(context, state)
        self.carried_tokens = state.tokens.new_empty(0)
        self.carried_probs = None
        self.carried_logits = None
        self.last_draft = None
        if self.grid_width is None and self.init == "vertical":
            grid = image_grid(context.target)
            if grid is None:
                raise ValueError("SJD's vertical init needs the image grid width: pass grid_width=... "
                                 "or use a target with a `grid` (an image-token model)")
            self._width = grid[1]
        else:
            self._width = self.grid_width

    def _fresh(self, known: torch.Tensor, count: int, vocab_size: int, device) -> torch.Tensor:
        """``count`` initial tokens to follow the generated tokens ``known`` [m] (1-D)."""
        if self.init == "random":
            u = torch.rand(count, dtype=torch.float32, generator=self.context.generator, device=self.context.generator.device)
            return (u * vocab_size).long().clamp_(max=vocab_size - 1).to(device)
        sequence = known.tolist()
        for _ in range(count):
            if self.init == "vertical" and len(sequence) >= self._width:
                sequence.append(sequence[-self._width])
            else:
                sequence.append(sequence[-1] if sequence else 0)
        return torch.tensor(sequence[len(known):], dtype=torch.long, device=device)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        carried = self.carried_tokens[:k]
        # (a random init reads nothing of the sequence: no copy of its tokens each step)
        known = carried if self.init == "random" else torch.cat([state.new_tokens[0], carried.to(state.tokens.device)])
        vocab = self.context.target.vocab_size
        fresh = self._fresh(known, k - carried.shape[0], vocab, state.tokens.device)
        tokens = torch.cat([carried.to(state.tokens.device), fresh]).unsqueeze(0)
        probs = None
        if self.context.sampling.do_sample:
            fresh_probs = torch.nn.functional.one_hot(fresh, vocab).float()
            parts = [fresh_probs] if self.carried_probs is None else [self.carried_probs[:k].to(fresh_probs.device), fresh_probs]
            probs = torch.cat(parts).unsqueeze(0)
        self.last_draft = Draft(tokens=tokens, probs=probs)
        return self.last_draft

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        # rows num_accepted + 1 .. K of the forward predict the positions after the committed token
        draft, self.last_draft = self.last_draft, None
        if draft is None:  # a step the loop verified without a draft (the budget's last token): nothing carries
            self.carried_tokens, self.carried_probs, self.carried_logits = self.carried_tokens[:0], None, None
            return
        self._carry(target_output.logits[0, num_accepted + 1 : num_drafted + 1], draft.tokens[0, num_accepted + 1 :],
                    None if draft.probs is None else draft.probs[0, num_accepted + 1 :])

    def _carry(self, logits: torch.Tensor, old_tokens: torch.Tensor, old_probs: torch.Tensor | None) -> None:
        """Next iteration's drafts from this forward's rows past the committed token.

        Args:
            logits: [m, V] the rows predicting positions c + 1 .. c + m (c = the last committed).
            old_tokens, old_probs: [m - 1] and [m - 1, V] the drafts this window held at positions
                c + 1 .. c + m - 1 and their q (the coupling keeps them when it can).
        """
        sampling = self.context.sampling
        if not sampling.do_sample:
            self.carried_tokens, self.carried_probs = exact_argmax(logits), None
            self.carried_logits = logits
            return
        new_probs = logits_to_probs(logits, sampling)
        m = new_probs.shape[0]
        gen = self.context.generator
        if self.coupled and m:
            old = m - 1  # the last row predicts a position the window did not reach
            uniforms = torch.rand(m, 2, dtype=torch.float32, generator=gen, device=gen.device).to(new_probs.device)
            old_tokens, old_probs = old_tokens.to(new_probs.device), old_probs.to(new_probs.device)
            tokens = coupled_rows(new_probs, old_probs, old_tokens, uniforms)  # (one C call where the kernels run)
            if tokens is None:
                tokens = torch.empty(m, dtype=torch.long, device=new_probs.device)
                tokens[:old] = coupled_redraft(old_tokens, old_probs, new_probs[:old], uniforms[:old])
                tokens[old:] = sample_from_probs(new_probs[old:], uniforms[old:, 1])
        else:
            uniforms = torch.rand(m, dtype=torch.float32, generator=gen, device=gen.device).to(new_probs.device)
            tokens = sample_from_probs(new_probs, uniforms)
        self.carried_tokens, self.carried_probs = tokens, new_probs

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "window": self.num_draft_tokens, "init": self.init, "coupled": self.coupled}


@register_drafter("sjd-coupled")
class CoupledJacobiDrafter(JacobiDrafter):
    """Coupled SJD by name: ``"sjd-coupled[:init]"``."""

    def __init__(self, num_draft_tokens: int = 16, init: str = "random", grid_width: int | None = None) -> None:
        super().__init__(num_draft_tokens, init=init, coupled=True, grid_width=grid_width)


@register_drafter("sjd-pac")
class ProactiveJacobiDrafter(CoupledJacobiDrafter):
    """SJD-PAC (Kang et al., 2026): coupled SJD whose continuation past a rejection is the coupling
    above (adaptive continuation: a carried draft is kept with probability min(1, P_t / P_{t-1})),
    plus proactive drafting: the first ``depth`` positions of the window become a small tree with
    ``branches`` candidates per position (defaults 2 and 1).

    At window position d <= depth the candidates are the carried draft x_0 (q = its P_t) and
    ``branches - 1`` more drawn without replacement from the same P_t: x_j ~ q_j = P_t with
    x_0 .. x_{j-1} zeroed, renormalised (greedy: the next argmaxes). Every node of depth d - 1
    gets these children; the carried chain continues below the first candidates. The tree has at
    most the window's L nodes (the chain shortens by the extra nodes) and is verified in one
    forward by the multi-draft rule (:func:`~mmspec.core.verify.tree_speculative_verify`): each
    sibling's q is the distribution it was drawn from given the earlier siblings, so the output is
    exactly the target's. Positions without a carried distribution (fresh inits) get no extras.

    After verification the next drafts come from the rows of the line of first candidates below the
    last accepted node, continued by the main line's deeper nodes when that line ends inside the
    tree (their rows were computed after other candidates, but a draft only needs q = the
    distribution it was drawn from), coupled as in SJD.

    Args:
        num_draft_tokens: the window L (nodes per forward).
        branches: candidates per tree position (K); depth: tree positions (D).
    """

    drafts_trees = True

    batch_size_one_reason = "drafts token trees (its proactive branches); sjd-coupled is its chain form"

    def __init__(self, num_draft_tokens: int = 16, init: str = "random", grid_width: int | None = None,
                 branches: int = 2, depth: int = 1) -> None:
        super().__init__(num_draft_tokens, init=init, grid_width=grid_width)
        if branches < 1 or depth < 0:
            raise ValueError(f"need branches >= 1 and depth >= 0 (got {branches}, {depth})")
        self.branches, self.depth = branches, depth
        self.first_child: list[int] = []  # per tree row (parent + 1): its candidate-0 child, or -1
        self.tree_logits: torch.Tensor | None = None
        self.accepted_path: list[int] = []
        self.tree_steps = 0

    def start(self, context: DraftContext, state: SequenceState) -> None:
        super().start(context, state)
        self.first_child, self.tree_logits, self.accepted_path, self.tree_steps = [], None, [], 0

    def _candidates(self, position: int, first: torch.Tensor, first_q: torch.Tensor | None):
        """(tokens [b], q rows [b, V] or None) at a carried window position: the carried token,
        then more without replacement from its distribution."""
        tokens, rows = [first], [first_q]
        if self.carried_probs is None:  # greedy: the next argmaxes of the carried row
            for token in self.carried_logits[position].topk(self.branches).indices:
                if len(tokens) < self.branches and int(token) not in [int(t) for t in tokens]:
                    tokens.append(token)
            return torch.stack(tokens), None
        base = self.carried_probs[position]
        gen = self.context.generator
        left = base.clone()
        for _ in range(self.branches - 1):
            left[tokens[-1]] = 0.0
            if float(left.sum()) <= 0:
                break
            q = left / left.sum()
            u = torch.rand(1, dtype=torch.float32, generator=gen, device=gen.device).to(q.device)
            tokens.append(sample_from_probs(q, u[0]))
            rows.append(q)
        return torch.stack(tokens), torch.stack(rows)

    @staticmethod
    def extra_nodes(branches: int, depth: int) -> int:
        """Nodes a tree of ``depth`` positions with ``branches`` candidates each has beyond a chain."""
        return sum(branches ** d - 1 for d in range(1, depth + 1))

    @classmethod
    def fitting_depth(cls, window: int, branches: int, limit: int) -> int:
        """The most tree positions (at most ``limit``) whose tree still leaves its main line room in
        a window of ``window`` nodes: 0 where no tree fits (or ``branches`` is 1: a chain)."""
        depth = 0
        while branches > 1 and depth < limit and window - cls.extra_nodes(branches, depth + 1) >= depth + 1:
            depth += 1
        return depth

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        chain = super().propose(state, max_tokens)
        k, carried = chain.length, self.carried_tokens.shape[0]
        window = self.num_draft_tokens
        # tree positions: carried ones, while the tree's main line still fits in the window
        depth = self.fitting_depth(window, self.branches, min(self.depth, carried, k))
        if depth == 0:
            return chain
        length = min(k, window - self.extra_nodes(self.branches, depth))  # the main line; with the extra nodes at most L nodes
        tokens, parents, rows, first_child = [], [], [], []
        chain_probs = None if chain.probs is None else chain.probs[0]
        level = [-1]  # nodes of the previous depth; level[0] is on the main line
        for d in range(depth):
            options, q = self._candidates(d, chain.tokens[0, d], None if chain_probs is None else chain_probs[d])
            next_level = []
            for parent in level:
                for j in range(options.shape[0]):
                    next_level.append(len(tokens))
                    tokens.append(options[j])
                    parents.append(parent)
                    rows.append(None if q is None else q[j])
            level = next_level
        main = level[0]
        for d in range(depth, length):  # the chain continues below the main line
            tokens.append(chain.tokens[0, d])
            parents.append(main)
            rows.append(None if chain_probs is None else chain_probs[d])
            main = len(tokens) - 1
        parents_t = torch.tensor(parents)
        first_child = [-1] * (len(tokens) + 1)  # index parent + 1 (0 = the root)
        for node in range(len(tokens) - 1, -1, -1):
            first_child[parents[node] + 1] = node  # the lowest-index child: candidate 0
        self.first_child = first_child
        tree = TokenTree(torch.stack(tokens), parents_t, None if rows[0] is None else torch.stack(rows))
        self.last_draft = Draft.from_tree(tree)
        self.tree_steps += 1
        return self.last_draft

    def on_tree_verified(self, path: torch.Tensor, tree_output: TargetOutput) -> None:
        self.tree_logits, self.accepted_path = tree_output.logits[0], path.tolist()

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        draft = self.last_draft
        if draft is None or draft.tree is None:
            return super().on_verified(num_drafted, num_accepted, target_output)
        tree = draft.tree
        last = self.accepted_path[num_accepted - 1] if num_accepted else -1
        line = self._first_children(last)
        # below a side branch the tree stops at its depth: the main line's deeper drafts still serve
        deepest = int(tree.depth[line[-1]]) if line else (int(tree.depth[last]) if last >= 0 else 0)
        line += [n for n in self._first_children(-1) if int(tree.depth[n]) > deepest]
        logits = self.tree_logits[[n + 1 for n in line]]
        old = line[1:]
        self._carry(logits, tree.tokens[old], None if tree.probs is None else tree.probs[old])

    def _first_children(self, node: int) -> list[int]:
        """The line of candidate-0 children below ``node`` (-1 = the root)."""
        line = []
        node = self.first_child[node + 1]
        while node >= 0:
            line.append(node)
            node = self.first_child[node + 1]
        return line

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "branches": self.branches, "tree_depth": self.depth, "tree_steps": self.tree_steps}
