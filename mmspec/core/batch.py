"""Batched speculative decoding: B prompts through one verification forward per step.

Every row keeps its own everything — draft length, acceptance, committed tokens, generator,
drafter — and shares only the target's forward. A step:

1. each active row's drafter proposes k_b tokens after the row's committed sequence;
2. one target forward over [B, 1 + K] (K = max k_b; a shorter row is padded with its pending
   token, whose rows of the output are ignored) with a 2-D attention mask over the cache slots
   and per-row position ids;
3. each row's rule verifies its own k_b drafts against its own logits, with its own uniforms;
4. the cache keeps, per row, the entries of the row's pending token and accepted drafts: the
   :class:`BatchState` marks the others invalid (masked out of every later attention) and squeezes
   them out when enough have gathered; rows that stop leave the batch.

A row draws exactly the random numbers of a batch-1 generation of its prompt with the same seed,
and nothing of another row enters its attention, its rule or its generator, so its tokens are the
batch-1 tokens whenever its logits are. Its logits equal the batch-1 logits up to floating-point
summation order (a wider forward; the tests' tiny models give identical rows): in bf16, or where a
sampled draw sits on a rounding-level difference, a row can part from batch 1
(docs/benchmarks.md measures how often).

Prompts are prefilled one row at a time (the batch-1 prefill; images of different sizes need no
padding) and their caches stacked, left-padded.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from .cache import SequenceState, batch_layers, crop_cache, stack_caches
from .drafter import Draft, DraftContext, Drafter
from .loop import _truncate_at_stop, _uniforms
from .rules import resolve_rule
from .sampling import SamplingConfig
from .stats import SpecStats
from .target import TargetOutput


class BatchState:
    """The rows of a batch between target forwards.

    Invariant between steps: ``rows[b].tokens`` [1, L_b] holds row b's prompt and committed tokens;
    the shared cache holds C slots per cache row, of which ``valid`` marks, for each of row b's
    cache rows, exactly the entries of its tokens but the last (its pending token), in order (less
    the row's own prompt padding: a guided sequence's unconditional prompt may be shorter).

    Attributes:
        rows: one :class:`SequenceState` per active row (a copy of its batch-1 state without the
            cache: tokens, prompt length and the rest, what the row's drafter reads).
        cache: the target's KV cache, batch dimension = active rows x ``rows_per_item`` (a guided
            image sequence has two cache rows, conditional and unconditional).
        valid: BoolTensor [B R, C] on the cache's device (R = ``rows_per_item``).
        ids: the active rows' indices in the caller's batch.
        slack: invalid slots (beyond the longest row) tolerated before they are squeezed out.
    """

    slack = 32

    def __init__(self, rows: list[SequenceState], cache, valid: torch.Tensor, rows_per_item: int = 1) -> None:
        if valid.shape != (len(rows) * rows_per_item, cache.get_seq_length()):
            raise ValueError(f"valid {tuple(valid.shape)} does not match {len(rows) * rows_per_item} cache rows x "
                             f"{cache.get_seq_length()} slots")
        self.rows = rows
        self.cache = cache
        self.valid = valid
        self.rows_per_item = rows_per_item
        self.ids = list(range(len(rows)))

    @classmethod
    def prefill(cls, target, rows: Sequence[dict[str, Any]], hidden_layer: int | None = None) -> tuple["BatchState", list[TargetOutput]]:
        """Prefill each prompt with the target's own batch-1 ``prefill`` and stack the states: the
        batch and each row's TargetOutput ([1, 1, V])."""
        states, outputs = zip(*(target.prefill(inputs, hidden_layer=hidden_layer) for inputs in rows))
        return cls.stack(states, target.device), list(outputs)

    @classmethod
    def stack(cls, states: Sequence[SequenceState], device: torch.device) -> "BatchState":
        """B one-row states (each after its own prefill) -> one batch (their caches left-padded)."""
        cache, valid = stack_caches([s.cache for s in states], [s.row_padding for s in states])
        rows = []
        for s in states:
            row = copy.copy(s)
            row.cache = None
            rows.append(row)
        return cls(rows, cache, valid.to(device), rows_per_item=batch_layers(states[0].cache)[0].keys.shape[0])

    def cache_rows(self, items: torch.Tensor) -> torch.Tensor:
        """LongTensor [B'] item positions -> their cache rows [B' R] (each item's R rows in order)."""
        r = self.rows_per_item
        return (items[:, None] * r + torch.arange(r, device=items.device)[None, :]).flatten()

    @property
    def size(self) -> int:
        return len(self.rows)

    def position_ids(self, num_tokens: int) -> torch.Tensor:
        """LongTensor [B R, num_tokens]: each cache row's next positions (its valid entries so far onward)."""
        start = self.valid.sum(dim=1, keepdim=True) + self.rows[0].position_offset
        return start + torch.arange(num_tokens, device=self.valid.device)[None, :]

    def attention_mask(self, num_tokens: int) -> torch.Tensor:
        """LongTensor [B R, C + num_tokens]: each cache row's valid slots, then the new inputs."""
        return torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], num_tokens)], dim=1).long()

    def verification_inputs(self, drafts: Sequence[torch.Tensor]) -> torch.Tensor:
        """[B, 1 + K]: each row's pending token and drafts [1, k_b], padded with the pending token."""
        width = 1 + max(d.shape[1] for d in drafts)
        inputs = torch.empty(self.size, width, dtype=torch.long, device=self.valid.device)
        for b, (row, draft) in enumerate(zip(self.rows, drafts)):
            inputs[b] = row.tokens[0, -1]
            inputs[b, 1 : 1 + draft.shape[1]] = draft[0]
        return inputs

    def commit(self, committed: Sequence[torch.Tensor]) -> None:
        """After a forward over [B, n]: append each row's committed tokens [1, m_b] and keep, of the
        n new slots, the first m_b (its pending token and its m_b - 1 accepted drafts)."""
        n = self.cache.get_seq_length() - self.valid.shape[1]
        kept = torch.tensor([c.shape[1] for c in committed], device=self.valid.device).repeat_interleave(self.rows_per_item)
        self.valid = torch.cat([self.valid, torch.arange(n, device=self.valid.device)[None, :] < kept[:, None]], dim=1)
        for row, tokens in zip(self.rows, committed):
            row.tokens = torch.cat([row.tokens, tokens.to(row.tokens)], dim=1)
        self._squeeze()

    def _squeeze(self) -> None:
        """Crop slots no row holds at the end; left-align every row's valid slots once more than
        ``slack`` invalid slots sit beyond the longest row."""
        if not self.size:
            return
        used = self.valid.any(dim=0).nonzero()
        end = int(used[-1]) + 1 if used.numel() else 0
        if end < self.valid.shape[1]:
            crop_cache(self.cache, end)
            self.valid = self.valid[:, :end]
        counts = self.valid.sum(dim=1)
        width = int(counts.max())
        if self.valid.shape[1] - width <= self.slack:
            return
        # each cache row's valid slots, in order, right-aligned in [0, width); pad slots point at slot 0
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)  # valid slots first, in order
        pads = width - counts
        j = torch.arange(width, device=self.valid.device)[None, :]
        index = torch.where(j >= pads[:, None], order.gather(1, (j - pads[:, None]).clamp(min=0)), 0)
        for layer in batch_layers(self.cache):
            layer.gather_slots(index)
        self.valid = j >= pads[:, None]

    def keep(self, positions: Sequence[int]) -> None:
        """Keep the active rows at ``positions`` (of ``range(size)``), dropping the others."""
        if len(positions) == self.size:
            return
        index = self.cache_rows(torch.tensor(positions, dtype=torch.long))
        for layer in batch_layers(self.cache):
            layer.select_rows(index)
        self.valid = self.valid[index.to(self.valid.device)]
        self.rows = [self.rows[i] for i in positions]
        self.ids = [self.ids[i] for i in positions]
        self._squeeze()


class BatchTarget(Protocol):
    """What batched decoding needs of a target, besides the core's Target interface.

    ``prefill_rows`` prefills each prompt (one dict of model inputs per row) and returns the
    stacked :class:`BatchState` and each row's TargetOutput ([1, 1, V]); ``forward_rows`` appends
    ``tokens`` [B, n] to every row and returns logits [B, n, V] (and hidden states [B R, n, H], R
    cache rows per sequence). A target that cannot names why in ``batch_size_one_reason``.

    Other states fit the same loop when they offer ``rows``, ``ids``, ``size``, ``rows_per_item``,
    ``verification_inputs``, ``commit`` and ``keep`` (a delay-pattern codec LM's
    ``DelayBatchState``; :class:`~mmspec.core.continuous.MaskedARBatch` for continuous tokens, whose
    ``forward_rows`` takes each row's drafts and returns a ``ContinuousOutput``); the loop reads
    row b of an output with its ``row(b, n, rows_per_item)``.
    """

    device: torch.device

    def prefill_rows(self, rows: Sequence[dict[str, Any]], hidden_layer: int | None = None) -> tuple[BatchState, list[TargetOutput]]: ...

    def forward_rows(self, state: BatchState, tokens: torch.Tensor, hidden_layer: int | None = None) -> TargetOutput: ...


@dataclass
class RowResult:
    """One row of a batched generation: tokens [1, L_b] (its prompt_length prompt tokens, then the
    new ones), its stats (wall time: from the batch's start until this row finished), and its
    index in the batch."""

    index: int
    tokens: torch.Tensor
    stats: SpecStats
    prompt_length: int


def _linear(draft: Draft) -> Draft:
    """A draft as a linear chain: a chain-shaped tree (each node the child of the one before) is
    verified exactly like the linear draft of its tokens; any other tree needs batch size 1."""
    if draft.tree is None:
        return draft
    parents = draft.tree.parents.tolist()
    if parents != list(range(-1, len(parents) - 1)):
        raise ValueError("token-tree drafts need batch size 1; for batches use a chain drafter "
                         "(eagle, medusa/hydra chains, draft model, prompt-lookup)")
    return Draft(tokens=draft.tokens, probs=draft.probs)


def batched_decode(
    target: BatchTarget,
    rows_inputs: Sequence[dict[str, Any]],
    drafters: Sequence[Drafter | None],
    sampling: SamplingConfig,
    max_new_tokens: int,
    generators: Sequence[torch.Generator],
    eos_token_ids: Sequence[int] = (),
    acceptance: str | None = None,
    rule_kwargs: dict[str, Any] | None = None,
    on_row_done: Callable[[RowResult], None] | None = None,
) -> tuple[list[RowResult], int]:
    """Generate up to ``max_new_tokens`` for each of B prompts, verifying all rows in one forward.

    Args:
        target: a :class:`BatchTarget` (``TransformersTarget``, a guided image target).
        rows_inputs: B prompts, each as the target's batch-1 prefill takes it.
        drafters: one drafter per row (separate instances: each keeps its row's state, see
            :meth:`Drafter.for_batch`), or None for plain AR rows.
        sampling, max_new_tokens, eos_token_ids, acceptance, rule_kwargs: as in
            :func:`~mmspec.core.loop.speculative_decode`, for every row.
        generators: one per row; row b draws exactly the random numbers a batch-1 generation
            with ``generators[b]`` would.
        on_row_done: called with each row's result as soon as it stops.
    Returns:
        The rows' results in input order, and the number of batched target forwards.
    """
    if len(drafters) != len(rows_inputs) or len(generators) != len(rows_inputs):
        raise ValueError(f"{len(rows_inputs)} rows need as many drafters and generators "
                         f"(got {len(drafters)} and {len(generators)})")
    if getattr(target, "batch_size_one_reason", None):
        raise ValueError(f"{type(target).__name__} {target.batch_size_one_reason}, so it decodes one sequence at a time; "
                         "use batch size 1")
    if not hasattr(target, "forward_rows"):
        raise ValueError(f"{type(target).__name__} decodes one sequence at a time; use batch size 1")
    if len({id(d) for d in drafters if d is not None}) != sum(d is not None for d in drafters):
        raise ValueError("each row needs its own drafter instance (copy.copy one per row)")
    if len({type(d) for d in drafters if d is not None}) > 1:
        raise ValueError("the rows' drafters are of different kinds; use one kind of drafter per batch")
    rule = resolve_rule(acceptance, sampling, rule_kwargs, continuous=getattr(target, "continuous", False))
    eos = frozenset(int(t) for t in eos_token_ids)
    started = time.perf_counter()
    stats = [SpecStats(method=d.name if d else "ar", config=rule.describe()) for d in drafters]
    hidden_layers = {d.target_hidden_layer for d in drafters if d is not None and d.requires_target_hidden}
    if len(hidden_layers) > 1:
        raise ValueError("the rows' drafters read different target layers; use one kind of drafter per batch")
    hidden_layer = hidden_layers.pop() if hidden_layers else None
    results: list[RowResult | None] = [None] * len(rows_inputs)
    forwards = 0

    with torch.inference_mode():
        state, first_outputs = target.prefill_rows(rows_inputs, hidden_layer=hidden_layer)
        forwards += len(rows_inputs)
        generated = [1] * state.size
        finished = []
        rows_per_item = state.rows_per_item
        for b, (row, out) in enumerate(zip(state.rows, first_outputs)):
            stats[b].target_forwards = 1
            empty = Draft(tokens=row.tokens[:, :0])
            first = rule.verify_output(empty, out, sampling, _uniforms(generators[b], sampling, 0, out.device), generators[b])
            first.record(stats[b])
            _, done = _truncate_at_stop(first.tokens[:, :1], eos, max_new_tokens)
            row.tokens = torch.cat([row.tokens, first.tokens[:, :1].to(row.tokens)], dim=1)
            if drafters[b] is not None:
                drafters[b].start(DraftContext(target, sampling, generators[b], rows_inputs[b], rule), row)
                stats[b].config.update(drafters[b].describe())
                if drafters[b].requires_target_hidden:
                    drafters[b].on_verified(0, 0, out)
            if done:
                finished.append(b)

        def retire(positions: list[int]) -> None:
            for p in positions:
                b = state.ids[p]
                if drafters[b] is not None:
                    stats[b].draft_forwards = drafters[b].forwards
                    stats[b].config.update(drafters[b].describe())
                stats[b].new_tokens = generated[p]
                stats[b].config["batch_size"] = len(rows_inputs)
                stats[b].wall_time_s = time.perf_counter() - started
                results[b] = RowResult(b, state.rows[p].tokens, stats[b], state.rows[p].prompt_length)
                if on_row_done is not None:
                    on_row_done(results[b])
            positions = set(positions)
            keep = [p for p in range(state.size) if p not in positions]
            generated[:] = [generated[p] for p in keep]
            state.keep(keep)

        retire(finished)
        while state.size:
            # 1. every row drafts what its budget can still use
            drafts = [Draft(tokens=row.tokens[:, :0]) for row in state.rows]
            drafting = [p for p in range(state.size) if drafters[state.ids[p]] is not None and max_new_tokens - generated[p] > 1]
            if drafting:
                started_drafting = time.perf_counter()
                row_drafters = [drafters[state.ids[p]] for p in drafting]
                proposed = type(row_drafters[0]).propose_rows(row_drafters, state, drafting,
                                                              [max_new_tokens - generated[p] - 1 for p in drafting])
                share = (time.perf_counter() - started_drafting) / len(drafting)
                for p, draft in zip(drafting, proposed):
                    drafts[p] = _linear(draft)
                    stats[state.ids[p]].draft_time_s += share
            # 2. one forward verifies every row
            out = target.forward_rows(state, state.verification_inputs([d.tokens for d in drafts]), hidden_layer=hidden_layer)
            forwards += 1
            committed_rows, done_rows = [], []
            for p, draft in enumerate(drafts):
                b, k = state.ids[p], draft.length
                row_out = out.row(p, k + 1, rows_per_item)
                verification = rule.verify_output(draft, row_out, sampling, _uniforms(generators[b], sampling, k, out.device), generators[b])
                num_accepted = int(verification.num_accepted[0])
                committed, done = _truncate_at_stop(verification.tokens[:, : num_accepted + 1], eos, max_new_tokens - generated[p])
                generated[p] += committed.shape[1]
                verification.record(stats[b])
                stats[b].record_step(k, num_accepted, committed.shape[1])
                if drafters[b] is not None:
                    drafting = time.perf_counter()
                    drafters[b].on_verified(k, num_accepted, row_out)
                    stats[b].draft_time_s += time.perf_counter() - drafting
                committed_rows.append(committed)
                if done:
                    done_rows.append(p)
            # 3. commit every row, then let the finished ones go
            state.commit(committed_rows)
            retire(done_rows)
    return results, forwards


def batch_stats(rows: Sequence[SpecStats], wall_time_s: float, forwards: int) -> SpecStats:
    """One SpecStats for a whole batch: counts summed over rows, tau = tokens per row-step, the
    batch's wall time (so tokens_per_second is the throughput), ``target_forwards`` = batched
    forwards run."""
    total = SpecStats(method=rows[0].method, config=dict(rows[0].config))
    for s in rows:
        total.new_tokens += s.new_tokens
        total.verify_steps += s.verify_steps
        total.draft_forwards += s.draft_forwards
        total.drafted += s.drafted
        total.accepted += s.accepted
        total.draft_time_s += s.draft_time_s
        for name in ("drafted_per_position", "accepted_per_position"):
            mine, theirs = getattr(total, name), getattr(s, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
    total.target_forwards = forwards
    total.wall_time_s = wall_time_s
    total.rows = len(rows)
    return total
