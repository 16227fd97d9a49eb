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

Rows also join and leave between steps (continuous batching, what a server needs): ``admit``
hands over new prompts, which are prefilled and joined to the running batch
(:meth:`BatchState.join`); ``cancelled`` takes a row out before the next step, as a row that
stopped leaves. Neither changes what the other rows compute: a row's tokens depend on its own
prompt, drafter and generator only. ``on_tokens`` sees each row's committed tokens as they come.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch

from .cache import PreallocatedLayer, RowStateLayer, SequenceState, batch_layers, row_state_layers, slot_count, stack_caches
from .draft import Draft
from .drafter import DraftContext, Drafter
from .rules import resolve_rule
from .sampling import SamplingConfig
from .stats import SpecStats
from .step import append_tokens, empty_draft, finish_stats, first_token, settle, start_drafter, verify_chain
from .target import RowTarget, TargetOutput, batch_size_one_reason, is_continuous


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
        if valid.shape != (len(rows) * rows_per_item, slot_count(cache)):
            raise ValueError(f"valid {tuple(valid.shape)} does not match {len(rows) * rows_per_item} cache rows x "
                             f"{slot_count(cache)} slots")
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
        """LongTensor [B R, num_tokens]: each cache row's next positions (its valid entries so far
        onward, plus its row's ``position_offset``: a Qwen-VL row's M-RoPE delta depends on its image)."""
        offsets = torch.tensor([row.position_offset for row in self.rows], device=self.valid.device)
        start = self.valid.sum(dim=1, keepdim=True) + offsets.repeat_interleave(self.rows_per_item)[:, None]
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
        n new slots, the first m_b (its pending token and its m_b - 1 accepted drafts). A
        :class:`~mmspec.core.cache.RowStateLayer` (a recurrent state) becomes each row's state
        after its own m_b positions."""
        n = slot_count(self.cache) - self.valid.shape[1]
        kept = torch.tensor([c.shape[1] for c in committed], device=self.valid.device).repeat_interleave(self.rows_per_item)
        for layer in row_state_layers(self.cache):
            layer.keep_rows(kept.tolist())
        self.valid = torch.cat([self.valid, torch.arange(n, device=self.valid.device)[None, :] < kept[:, None]], dim=1)
        for row, tokens in zip(self.rows, committed):
            row.tokens = append_tokens(row.tokens, tokens)
        self._squeeze()

    def _squeeze(self) -> None:
        """Crop slots no row holds at the end; left-align every row's valid slots once more than
        ``slack`` invalid slots sit beyond the longest row."""
        if not self.size:
            return
        used = self.valid.any(dim=0).nonzero()
        end = int(used[-1]) + 1 if used.numel() else 0
        if end < self.valid.shape[1]:
            for layer in batch_layers(self.cache):  # (a row-state layer has no slots to crop)
                layer.crop(end - layer.get_seq_length())
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
        for layer in (*batch_layers(self.cache), *row_state_layers(self.cache)):
            layer.select_rows(index)
        self.valid = self.valid[index.to(self.valid.device)]
        self.rows = [self.rows[i] for i in positions]
        self.ids = [self.ids[i] for i in positions]
        self._squeeze()

    def join(self, other: "BatchState") -> None:
        """Append the rows of ``other`` (a batch just prefilled, same target) after this batch's:
        both caches are left-padded to the wider one, the padding invalid, so every row keeps its
        entries, positions and mask; ``other.ids`` come along as they are."""
        if other.rows_per_item != self.rows_per_item:
            raise ValueError(f"cannot join a batch of {other.rows_per_item} cache rows per item to one of {self.rows_per_item}")
        if not self.size:
            self.rows, self.cache, self.valid, self.ids = list(other.rows), other.cache, other.valid, list(other.ids)
            return
        mine, theirs = self.valid.shape[1], other.valid.shape[1]
        width = max(mine, theirs)
        batch_layers(self.cache)  # (any other kind of layer is refused, as at stacking)
        shared: dict = {}
        layers = []
        for a, b in zip(self.cache.layers, other.cache.layers):
            if isinstance(a, PreallocatedLayer):
                parts = []
                for tensors in ((a.keys, b.keys), (a.values, b.values)):
                    joined = tensors[0].new_zeros((tensors[0].shape[0] + tensors[1].shape[0], *tensors[0].shape[1:-2], width,
                                                   tensors[0].shape[-1]))
                    joined[: tensors[0].shape[0], ..., width - mine :, :] = tensors[0]
                    joined[tensors[0].shape[0] :, ..., width - theirs :, :] = tensors[1]
                    parts.append(joined)
                a = PreallocatedLayer.from_tensors(*parts)
            elif isinstance(a, RowStateLayer):
                a.join_rows(b, shared)
            layers.append(a)  # (a KV-shared layer holds nothing)
        self.cache.layers = layers
        pad = lambda valid, n: torch.cat([valid.new_zeros(valid.shape[0], width - n), valid], dim=1)  # noqa: E731
        self.valid = torch.cat([pad(self.valid, mine), pad(other.valid.to(self.valid.device), theirs)])
        self.rows = self.rows + list(other.rows)
        self.ids = self.ids + list(other.ids)


#: what batched decoding needs of a target (:class:`~mmspec.core.target.RowTarget`; the name it had here)
BatchTarget = RowTarget


class BatchDrafting:
    """The batch-drafting protocol: a mixin giving a :class:`~mmspec.core.drafter.Drafter` what
    batched decoding asks of the drafters of its rows (every drafter of :mod:`mmspec.drafters`
    has it; a drafter without it drafts each row on its own, as this mixin does by default).

    Attributes:
        batch_size_one_reason: why this drafter cannot draft for one row of a batch (None: it can),
            see :meth:`for_batch`.
    """

    name: ClassVar[str]  # (the drafter's, read in messages; declared only)
    batch_size_one_reason: ClassVar[str | None] = None

    def for_batch(self) -> Drafter:
        """A drafter for one row of batched decoding, which reads only its row's tokens
        (``state.tokens``, no target cache) and proposes chains: this one, or a chain-drafting
        variant. Call it on a copy per row. Raises ValueError where it cannot."""
        if self.batch_size_one_reason:
            raise ValueError(f"the {self.name} drafter {self.batch_size_one_reason}, so it runs at batch size 1; "
                             "for batches use eagle, medusa, hydra, a draft model or prompt-lookup")
        return self

    @classmethod
    def propose_rows(cls, drafters: list[Drafter], state: BatchState, positions: list[int],
                     budgets: list[int]) -> list[Draft]:
        """Drafts for rows ``positions`` of a batch (``drafters[i]`` is row ``positions[i]``'s, each
        proposing at most ``budgets[i]`` tokens). Default: each row on its own
        (:func:`propose_each_row`); a drafter that reads the target's cache overrides this to draft
        every row in one batched forward per draft token."""
        return propose_each_row(drafters, state, positions, budgets)


def propose_each_row(drafters: Sequence[Drafter], state: BatchState, positions: Sequence[int],
                     budgets: Sequence[int]) -> list[Draft]:
    """Each drafter's :meth:`~mmspec.core.drafter.Drafter.propose` on its row's tokens
    (``state.rows[p]``): a list of drafts, one per position."""
    return [d.propose(state.rows[p], budget) for d, p, budget in zip(drafters, positions, budgets)]


def row_drafter(drafter: Drafter) -> Drafter:
    """The drafter for one row of a batch made from ``drafter`` (call it on a copy per row): its
    :meth:`BatchDrafting.for_batch`, or ``drafter`` itself for a drafter without the batch protocol."""
    return drafter.for_batch() if isinstance(drafter, BatchDrafting) else drafter


def propose_rows(drafters: list[Drafter], state: BatchState, positions: list[int], budgets: list[int]) -> list[Draft]:
    """Drafts for rows ``positions`` of a batch, whose drafters are all of one kind: that kind's
    :meth:`BatchDrafting.propose_rows`, or each row on its own."""
    kind = type(drafters[0])
    if issubclass(kind, BatchDrafting):
        return kind.propose_rows(drafters, state, positions, budgets)
    return propose_each_row(drafters, state, positions, budgets)


@dataclass
class RowResult:
    """One row of a batched generation: tokens [1, L_b] (its prompt_length prompt tokens, then the
    new ones), its stats (wall time: from the batch's start, or its joining, until this row
    finished), its index in the batch, and whether ``cancelled`` took it out before its end."""

    index: int
    tokens: torch.Tensor
    stats: SpecStats
    prompt_length: int
    cancelled: bool = False


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


#: a row joining a running batch (``admit``): its prompt (as the target's batch-1 prefill takes it),
#: its own drafter instance (or None: plain AR) and its own generator
NewRow = tuple[dict[str, Any], "Drafter | None", torch.Generator]


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
    *,
    on_tokens: Callable[[int, torch.Tensor], None] | None = None,
    cancelled: Callable[[int], bool] | None = None,
    admit: Callable[[], Sequence[NewRow]] | None = None,
) -> tuple[list[RowResult], int]:
    """Generate up to ``max_new_tokens`` for each of B prompts, verifying all rows in one forward.

    Args:
        target: a :class:`BatchTarget` (``TransformersTarget``, a guided image target).
        rows_inputs: B prompts, each as the target's batch-1 prefill takes it (B >= 1; may be 0
            with ``admit``).
        drafters: one drafter per row (separate instances: each keeps its row's state, see
            :func:`row_drafter`), or None for plain AR rows.
        sampling, max_new_tokens, eos_token_ids, acceptance, rule_kwargs: as in
            :func:`~mmspec.core.loop.speculative_decode`, for every row.
        generators: one per row; row b draws exactly the random numbers a batch-1 generation
            with ``generators[b]`` would.
        on_row_done: called with each row's result as soon as it stops.
        on_tokens: called with (row index, the tokens [1, m] it committed) after its first token
            and after every verification step (streaming).
        cancelled: called with a row's index before every step; True takes the row out of the
            batch now (its result so far, ``cancelled=True``; the other rows go on unchanged).
        admit: called before every step (and once at the start); the rows it returns join the
            batch now, indexed after every row so far (prefilled with the target's batch-1
            prefill, then :meth:`BatchState.join`). Decoding ends when no row is left and ``admit``
            gives none.
    Returns:
        The rows' results in index order (joined rows after the first B), and the number of
        batched target forwards (prefills counted one per row).
    """
    if len(drafters) != len(rows_inputs) or len(generators) != len(rows_inputs):
        raise ValueError(f"{len(rows_inputs)} rows need as many drafters and generators "
                         f"(got {len(drafters)} and {len(generators)})")
    if not rows_inputs and admit is None:
        raise ValueError("no prompts given")
    reason = batch_size_one_reason(target)
    if reason:
        raise ValueError(f"{type(target).__name__} {reason}, so it decodes one sequence at a time; use batch size 1")
    if not isinstance(target, RowTarget):
        raise ValueError(f"{type(target).__name__} decodes one sequence at a time; use batch size 1")
    rule = resolve_rule(acceptance, sampling, rule_kwargs, continuous=is_continuous(target))
    eos = frozenset(int(t) for t in eos_token_ids)
    inputs, drafters, generators = list(rows_inputs), list(drafters), list(generators)
    stats: list[SpecStats] = []
    starts: list[float] = []
    results: list[RowResult | None] = []
    hidden: list[int | None] = []  # the target layer the rows' drafters read (one for the batch)
    forwards = 0

    def check_rows(first: int) -> None:
        """The rows from ``first`` on: own drafter instances of the batch's one kind and layer."""
        ours = [d for d in drafters if d is not None]
        if len({id(d) for d in ours}) != len(ours):
            raise ValueError("each row needs its own drafter instance (copy.copy one per row)")
        if len({type(d) for d in ours}) > 1:
            raise ValueError("the rows' drafters are of different kinds; use one kind of drafter per batch")
        layers = {d.target_hidden_layer for d in ours if d.requires_target_hidden}
        if len(layers) > 1 or (hidden and layers and layers != {hidden[0]}):
            raise ValueError("the rows' drafters read different target layers; use one kind of drafter per batch")
        if not hidden:
            hidden.append(layers.pop() if layers else None)
        for d in drafters[first:]:
            stats.append(SpecStats(method=d.name if d else "ar", config=rule.describe()))
            starts.append(time.perf_counter())
            results.append(None)

    check_rows(0)
    hidden_layer = hidden[0]

    with torch.inference_mode():
        state: BatchState | None = None
        generated: list[int] = []

        def start(first: int) -> list[int]:
            """Prefill rows ``first`` on (each with the batch-1 prefill) and join them to the batch;
            each row's first token as at batch 1. -> the positions of rows already done."""
            nonlocal state, forwards
            new, outputs = target.prefill_rows(inputs[first:], hidden_layer=hidden_layer)
            forwards += len(inputs) - first
            new.ids = [first + i for i in range(new.size)]
            offset = 0 if state is None else state.size
            if state is None:
                state = new
            else:
                state.join(new)
            done = []
            for i, (row, out) in enumerate(zip(new.rows, outputs)):
                b = first + i
                stats[b].target_forwards = 1
                first_ = first_token(rule, out, row.tokens, sampling, generators[b], eos, max_new_tokens)
                first_.record(stats[b], None)
                row.tokens = append_tokens(row.tokens, first_.committed)
                generated.append(1)
                if on_tokens is not None:
                    on_tokens(b, first_.committed)
                if drafters[b] is not None:
                    start_drafter(drafters[b], DraftContext(target, sampling, generators[b], inputs[b], rule), row, out, stats[b])
                if first_.done:
                    done.append(offset + i)
            return done

        def retire(positions: list[int], stopped: bool = False) -> None:
            for p in positions:
                b = state.ids[p]
                finish_stats(stats[b], drafters[b], generated[p], starts[b])
                stats[b].config["batch_size"] = len(inputs)
                if stopped:
                    stats[b].config["cancelled"] = True
                results[b] = RowResult(b, state.rows[p].tokens, stats[b], state.rows[p].prompt_length, cancelled=stopped)
                if on_row_done is not None:
                    on_row_done(results[b])
            positions = set(positions)
            keep = [p for p in range(state.size) if p not in positions]
            generated[:] = [generated[p] for p in keep]
            state.keep(keep)

        def admit_rows() -> None:
            """The rows ``admit`` hands over now, prefilled and joined (those done at once retired)."""
            joining = list(admit()) if admit is not None else []
            if not joining:
                return
            first = len(inputs)
            for row_inputs, drafter, generator in joining:
                inputs.append(row_inputs)
                drafters.append(drafter)
                generators.append(generator)
            check_rows(first)
            retire(start(first))

        # 1. prefill every row (each with the batch-1 prefill); each row's first token as at batch 1
        if inputs:
            retire(start(0))
        admit_rows()
        while state is not None and state.size:
            if cancelled is not None:
                gone = [p for p in range(state.size) if cancelled(state.ids[p])]
                if gone:
                    retire(gone, stopped=True)
                    if not state.size:
                        admit_rows()
                        continue
            # 2. every row drafts what its budget can still use
            drafts = [empty_draft(row.tokens) for row in state.rows]
            drafting = [p for p in range(state.size) if drafters[state.ids[p]] is not None and max_new_tokens - generated[p] > 1]
            if drafting:
                started_drafting = time.perf_counter()
                proposed = propose_rows([drafters[state.ids[p]] for p in drafting], state, drafting,
                                        [max_new_tokens - generated[p] - 1 for p in drafting])
                share = (time.perf_counter() - started_drafting) / len(drafting)
                for p, draft in zip(drafting, proposed):
                    drafts[p] = _linear(draft)
                    stats[state.ids[p]].draft_time_s += share
            # 3. one forward verifies every row; each row's step as at batch 1
            out = target.forward_rows(state, state.verification_inputs([d.tokens for d in drafts]), hidden_layer=hidden_layer)
            forwards += 1
            committed_rows, done_rows = [], []
            for p, draft in enumerate(drafts):
                b, k = state.ids[p], draft.length
                row_out = out.row(p, k + 1, state.rows_per_item)
                step = settle(verify_chain(rule, draft, row_out, sampling, generators[b]), eos, max_new_tokens - generated[p])
                generated[p] += step.length
                step.record(stats[b], k)
                if drafters[b] is not None:
                    drafting_started = time.perf_counter()
                    drafters[b].on_verified(k, step.num_accepted, row_out)
                    stats[b].draft_time_s += time.perf_counter() - drafting_started
                committed_rows.append(step.committed)
                if step.done:
                    done_rows.append(p)
            # 4. commit every row, then let the finished ones go and the waiting ones in
            state.commit(committed_rows)
            if on_tokens is not None:
                for p, committed in enumerate(committed_rows):
                    on_tokens(state.ids[p], committed)
            retire(done_rows)
            admit_rows()
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
    if any(s.prefill_tokens is not None for s in rows):
        total.prefill_tokens = sum(s.rows if s.prefill_tokens is None else s.prefill_tokens for s in rows)
    return total
