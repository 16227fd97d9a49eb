"""Rollback of recurrent state (linear attention, short convolutions): the history since the last commit.

A KV cache rolls back by forgetting entries; a recurrent layer cannot: its state after t positions
is a function of every earlier position, overwritten in place as the sequence grows. Speculative
decoding needs the state after any accepted prefix of a verified chain, so a recurrent layer keeps
a :class:`StateHistory`: for every forward since the last commit, a :class:`Segment` with the
layer's states *before* it (references to tensors the forward replaced anyway, never copies), how
many positions it appended and what a replay of part of it needs. Rewinding to length t

- at the start of a segment (the committed length after drafting, a rejected verification's
  pending token... any forward boundary): that segment's states, no arithmetic;
- inside a segment (a verification of [pending, d_1 .. d_K] of which n drafts are accepted: the
  cache keeps 1 + n of its K + 1 positions): ``replay(segment, m)``, the segment's states
  advanced over its first m = t - start positions. The layer's owner gives ``replay``: for a
  Gated DeltaNet layer the delta rule over the m positions' kept q / k / v / gates
  (:mod:`mmspec.adapters.recurrent`), the projections are not run again.

Every rewind and every commit *settles* the history: the state at the new length becomes the base
and the segments are dropped, so what is held between two commits is bounded by the forwards of
one decoding step (a drafter's k one-token forwards on the shared layers and the target's
verification), each holding its start states and its inputs:

    held <= (forwards per step) x (state bytes) + (positions per step) x (replay bytes a position)

The rows of a batch (states [B, ...]) each keep their own number of a verification's positions:
:meth:`StateHistory.rewind_rows` gives every row its own state, from one replay of per-row lengths.

This module knows no model: states are tuples of tensors, inputs a dict the owner fills.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: ``replay(segment, m) -> states``: a layer's states after the first m positions of a segment
#: (from its start ``states``, with its kept ``inputs``, as its owner filled them); m is an int, or
#: a tuple of one length per batch row (:meth:`StateHistory.rewind_rows`)
Replay = Callable[["Segment", "int | tuple[int, ...]"], tuple]


@dataclass
class Segment:
    """One forward over ``count`` positions after ``start`` of a recurrent layer.

    Attributes:
        start: the layer's length before the forward.
        count: positions it appended.
        states: the layer's states at ``start`` (tensors the forward replaced, kept by reference).
        inputs: what a replay of its first m positions needs (its owner's; e.g. the conv inputs
            [B, C, count] and the layer's input hidden states [B, count, H]).
    """

    start: int
    count: int
    states: tuple
    inputs: dict[str, Any] = field(default_factory=dict)


class StateHistory:
    """The states a recurrent layer can be rewound to: its forwards since the last settle.

    Args:
        replay: how to advance a segment's start states by its first m positions, or None for a
            layer whose state needs no arithmetic to rewind (the owner's ``replay`` then never runs:
            see :meth:`rewind`).
    """

    def __init__(self, replay: Replay | None = None) -> None:
        self.replay = replay
        self.length = 0
        self.segments: list[Segment] = []

    def record(self, count: int, states: tuple, **inputs: Any) -> Segment:
        """A forward over ``count`` positions is about to replace ``states`` (the states at the
        current length); -> its segment, whose ``inputs`` the owner may complete later."""
        segment = Segment(self.length, count, states, dict(inputs))
        self.segments.append(segment)
        self.length += count
        return segment

    def rewind(self, length: int) -> tuple | None:
        """The states at ``length`` (None: the current ones, nothing to restore); settles there.

        Raises:
            ValueError: ``length`` before the last settle (those states are gone) or past the end,
                or inside a segment that has no replay or whose owner left out its inputs.
        """
        if length == self.length:
            self.settle()
            return None
        base = self.segments[0].start if self.segments else self.length
        if not base <= length < self.length:
            raise ValueError(f"a recurrent layer rolls back only within the positions since its last commit "
                             f"({base} to {self.length}), not to {length}")
        segment = next(s for s in reversed(self.segments) if s.start <= length)
        m = length - segment.start
        if m == 0:
            states = segment.states
        elif self.replay is None:
            raise ValueError(f"cannot roll a recurrent layer back inside a forward (to {m} of its {segment.count} positions): "
                             "its states are not replayable")
        else:
            states = self.replay(segment, m)
        self.length = length
        self.settle()
        return states

    def rewind_rows(self, kept: list[int], current: tuple) -> tuple | None:
        """The states of a batch's rows (B = len(kept)) after the last forward of which row b keeps
        its first ``kept[b]`` positions (each row its own accepted length); settles. None: the
        current ones (every row keeps everything).

        Per row: the forward's start states (kept 0), ``current`` (the states after the whole
        forward: kept = its count) or the replay of its first kept[b] positions (one replay for all
        rows, ``replay(segment, tuple(kept))``). Where every row keeps the same number this is
        :meth:`rewind` to that length, as at batch size 1.

        Raises:
            ValueError: no forward since the last settle, or a length outside [0, its count].
        """
        if not self.segments:
            raise ValueError("a recurrent layer's rows roll back only within a forward since the last commit")
        segment = self.segments[-1]
        if not all(0 <= k <= segment.count for k in kept):
            raise ValueError(f"rows keep between 0 and {segment.count} positions of the last forward, not {list(kept)}")
        if len(set(kept)) == 1:
            return self.rewind(segment.start + kept[0])
        replayed = (None,) * len(current)  # (every row keeps all or nothing: no replay)
        if any(0 < k < segment.count for k in kept):
            if self.replay is None:
                raise ValueError("cannot roll a recurrent layer's rows back inside a forward: its states are not replayable")
            replayed = self.replay(segment, tuple(kept))
        states = []
        for start, end, inside in zip(segment.states, current, replayed):
            if end is None:
                states.append(None)
                continue
            if start is None and 0 in kept:
                raise ValueError("cannot roll a recurrent layer's row back before its first forward")
            states.append(torch.stack([(start if k == 0 else end if k == segment.count else inside)[b] for b, k in enumerate(kept)]))
        self.settle()
        return tuple(states)

    def settle(self) -> None:
        """Everything up to the current length is committed: forget the segments."""
        self.segments = []

    def held_bytes(self) -> int:
        """Bytes of tensors the history keeps alive (start states and inputs; a tensor shared by two
        entries counted once): the memory a rollback costs until the next commit."""
        seen: dict[int, int] = {}
        for segment in self.segments:
            for value in (*segment.states, *segment.inputs.values()):
                if isinstance(value, torch.Tensor):
                    seen[id(value)] = value.numel() * value.element_size()
        return sum(seen.values())


class Settling:
    """Base of a cache layer with a :class:`StateHistory` (a plain class, so that the check in
    :func:`mmspec.core.cache.crop_cache`, run on every layer at every commit, costs nanoseconds):
    it settles after every crop (the kept positions are committed; its history can go)."""

    history: StateHistory

    def settle(self) -> None:
        self.history.settle()
