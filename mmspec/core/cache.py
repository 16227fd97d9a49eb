"""Sequence state and its rollback.

:class:`SequenceState` is the one object that holds everything a target's sequence carries from
step to step — committed tokens, the KV cache of every layer, the position offset of models whose
position ids are not the token index — and :meth:`SequenceState.rollback` /
:meth:`SequenceState.commit` restore all of it together after a partial acceptance.

The KV cache is a transformers ``DynamicCache`` whose full-attention layers are replaced by
:class:`PreallocatedLayer`: keys and values live in a buffer that grows by doubling, appending
writes in place and rollback only moves the length (gpt-fast's "write the next tokens at the right
positions"), so a rejected draft costs no copy. Sliding-window layers become :class:`SlidingLayer`:
transformers' window semantics (the model sees exactly the keys transformers' own
``DynamicSlidingWindowLayer`` would give it) with :data:`SLIDING_SLACK` older positions kept, so a
rollback past the window restores the positions the window had dropped. Recurrent layers of hybrid decoders (linear attention,
short convolutions) are cache layers with a :class:`~mmspec.core.recurrent.StateHistory`
(``mmspec.adapters.recurrent``): the same ``crop`` rewinds their states to the kept length, and
:func:`crop_cache` settles them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from .recurrent import Settling


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV layer with in-place appends and rollback by bookkeeping.

    ``keys`` / ``values`` are views [B, H, length, D] of buffers [B, H, capacity, D].
    """

    min_capacity = 256

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, self.min_capacity)
        key_buffer = key_states.new_empty((*key_states.shape[:-2], new_capacity, key_states.shape[-1]))
        value_buffer = value_states.new_empty((*value_states.shape[:-2], new_capacity, value_states.shape[-1]))
        if self._length:
            key_buffer[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            value_buffer[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[..., : self._length, :]
        self.values = self._value_buffer[..., : self._length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._length = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens (transformers' convention: a non-positive count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)
        self._refresh_views()

    def reset(self) -> None:
        self._length = 0
        if self._key_buffer is not None:
            self._refresh_views()

    def open_slots(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Reserve ``count`` positions after the cached ones for a writer that fills the buffers in
        place (the fused layer kernel, :mod:`mmspec.modeling.fused`): -> (key buffer, value buffer
        [B, heads, capacity, head_dim], the first new position). :meth:`close_slots` commits them."""
        if self._key_buffer is None or self._length + count > self._key_buffer.shape[-2]:  # (else room already)
            like = torch.empty(batch, heads, 0, head_dim, dtype=dtype)
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            self._reserve(like, like, self._length + count)
        return self._key_buffer, self._value_buffer, self._length

    def buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """(key buffer, value buffer [B, H, capacity, D], the cached length): for a native writer
        that moves entries in place and then sets the length with :meth:`crop`."""
        return self._key_buffer, self._value_buffer, self._length

    def close_slots(self, count: int) -> None:
        """The ``count`` positions :meth:`open_slots` reserved now hold keys and values."""
        self._length += count
        self._refresh_views()

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor) -> "PreallocatedLayer":
        """A layer holding ``keys`` / ``values`` [B, H, length, D] (copied into its buffers)."""
        layer = cls()
        layer.update(keys, values)
        return layer

    def gather_slots(self, index: torch.Tensor) -> None:
        """Row b keeps its entries ``index[b]`` (LongTensor [B, m]), moved to slots [0, m) in place;
        the length becomes m (batched decoding: drop the slots of rejected drafts, per row)."""
        if not self.is_initialized or self._length == 0:
            return
        m = index.shape[1]
        full = index.to(self._key_buffer.device)[:, None, :, None].expand(-1, self._key_buffer.shape[1], -1, self._key_buffer.shape[-1])
        # gather copies first, so overlapping source and destination ranges are safe
        self._key_buffer[..., :m, :] = self._key_buffer[..., : self._length, :].gather(-2, full)
        self._value_buffer[..., :m, :] = self._value_buffer[..., : self._length, :].gather(-2, full)
        self._length = m
        self._refresh_views()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` (LongTensor [B']), in this order."""
        if not self.is_initialized or self._key_buffer is None:
            return
        rows = rows.to(self._key_buffer.device)
        self._key_buffer = self._key_buffer.index_select(0, rows)
        self._value_buffer = self._value_buffer.index_select(0, rows)
        self._refresh_views()

    def compact(self, start: int, indices: torch.Tensor) -> None:
        """Keep positions [0, start) and then ``start + indices`` (LongTensor [m]), moved to
        [start, start + m) in place; the length becomes start + m. See :func:`compact_cache`."""
        if not self.is_initialized or self._length == 0:
            return
        m = indices.shape[0]
        # index_select copies first, so overlapping source and destination ranges are safe
        self._key_buffer[..., start : start + m, :] = self._key_buffer.index_select(-2, start + indices)
        self._value_buffer[..., start : start + m, :] = self._value_buffer.index_select(-2, start + indices)
        self._length = start + m
        self._refresh_views()


#: positions a :class:`SlidingLayer` keeps beyond its window: the longest rollback it can undo once
#: the window is full (a verification's rejected drafts: K <= SLIDING_SLACK)
SLIDING_SLACK = 64


class SlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window KV layer that can roll back across its window.

    transformers' ``DynamicSlidingWindowLayer`` keeps the last ``window - 1`` positions, so once the
    window is full a rejected draft cannot be cropped: the positions it pushed out are gone. This
    layer keeps the last ``window - 1 + slack`` positions and hands the model what transformers'
    layer would (the last ``window - 1`` cached positions and the new ones; the mask sizes are the
    parent's), so attention is unchanged; ``crop(-r)`` with r <= slack then restores a state with
    every position the window needs.

    ``keys`` / ``values`` [B, H, kept, D] hold positions [cumulative_length - kept, cumulative_length).

    Args:
        sliding_window: the model's window w (a query at position p sees positions > p - w).
        slack: positions kept beyond the window (default :data:`SLIDING_SLACK`).
    """

    def __init__(self, sliding_window: int, slack: int = SLIDING_SLACK, **kwargs) -> None:
        super().__init__(sliding_window)
        self.slack = slack

    @classmethod
    def like(cls, layer: DynamicSlidingWindowLayer) -> "SlidingLayer":
        """A fresh SlidingLayer with ``layer``'s window (``layer`` must be empty)."""
        if layer.is_initialized and layer.get_seq_length():
            raise ValueError("SlidingLayer.like takes an empty sliding-window layer")
        return cls(layer.sliding_window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, H, q, D]; return the keys and values the model attends to: the last
        ``window - 1`` cached positions (fewer before the window fills) and the q new ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys = keys[..., -(self.sliding_window - 1 + self.slack):, :]
        self.values = values[..., -(self.sliding_window - 1 + self.slack):, :]
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[..., -visible:, :], values[..., -visible:, :]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (a non-positive count). ValueError where
        that would leave fewer than the ``window - 1`` positions the next query needs (a rollback
        longer than the slack, once the window is full)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        removed = -tokens_to_remove
        kept = self.keys.shape[-2] - removed
        length = self.cumulative_length - removed
        if removed > self.cumulative_length or kept < min(length, self.sliding_window - 1):
            raise ValueError(
                f"cannot roll a sliding-window layer (window {self.sliding_window}) back by {removed} positions: "
                f"it keeps {self.slack} beyond the window; draft at most {self.slack} tokens a step"
            )
        self.keys = self.keys[..., :kept, :]
        self.values = self.values[..., :kept, :]
        self.cumulative_length = length

    def compact(self, start: int, indices: torch.Tensor) -> None:
        """Keep positions [0, start) and then ``start + indices`` (LongTensor [m], increasing),
        moved to [start, start + m): a tree forward's accepted path. ValueError where the kept
        positions no longer reach back to ``start`` or too few would remain for the window (a tree
        of more nodes than the slack)."""
        first = self.cumulative_length - self.keys.shape[-2]  # the position of the first kept entry
        kept = start - first
        if kept < min(start, self.sliding_window - 1):
            raise ValueError(f"cannot compact a sliding-window layer (window {self.sliding_window}) over a tree of "
                             f"{self.cumulative_length - start} nodes: it keeps {self.slack} positions beyond the window; "
                             "draft smaller trees")
        keep = torch.cat([torch.arange(kept, device=self.keys.device), kept + indices.to(self.keys.device)])
        self.keys = self.keys.index_select(-2, keep)
        self.values = self.values.index_select(-2, keep)
        self.cumulative_length = start + indices.shape[0]

    def window_states(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [B, H, m, D] of the last m = min(count, kept) cached positions."""
        return self.keys[..., -count:, :], self.values[..., -count:, :]


def make_cache(config, windows: bool = True) -> DynamicCache:
    """A DynamicCache for ``config`` whose full-attention layers roll back by bookkeeping
    (:class:`PreallocatedLayer`) and whose sliding-window layers roll back across the window
    (:class:`SlidingLayer`); other layers (KV-shared ones, which hold nothing) stay as they are.

    With ``windows=False`` the sliding-window layers keep every position too (PreallocatedLayer):
    a batch's rows are stacked and their slots gathered, so the window is applied by the
    attention mask instead (the target's row forward)."""
    cache = DynamicCache(config=config)
    if cache.layers:
        cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer
                        or not windows and type(layer) is DynamicSlidingWindowLayer
                        else SlidingLayer.like(layer) if type(layer) is DynamicSlidingWindowLayer
                        else layer for layer in cache.layers]
    else:
        cache.layer_class_to_replicate = PreallocatedLayer
    return cache


def crop_cache(cache: Cache, length: int) -> None:
    """Drop every cached position at index >= ``length``. Recurrent layers (:mod:`mmspec.core.recurrent`)
    are rewound to their states after ``length`` positions and settle there: what is kept counts as
    committed, so their history since the previous commit goes (also when nothing is dropped)."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if excess:
        cache.crop(-excess)
    for layer in getattr(cache, "layers", ()):  # (StaticKVCache and a target's own caches have none)
        if isinstance(layer, Settling):
            layer.settle()


#: faster compactions a backend offers: ``fn(cache layers, start, indices) -> True`` where it did
#: the whole compaction (every layer), False where it does not apply; tried in order by
#: :func:`compact_cache` (:mod:`mmspec.modeling.fused` registers its C one)
CACHE_COMPACTORS: list = []


def compact_cache(cache: Cache, start: int, indices: torch.Tensor) -> None:
    """Keep the first ``start`` cached positions and the positions ``start + indices``, in this
    order, contiguously; drop everything else (tree verification: keep the prefix and the accepted
    path, whose entries sit at scattered positions of the tree forward).

    Args:
        cache: every layer is compacted (PreallocatedLayer in place; other full-attention layers and
            sliding-window layers that have not reached their window by re-slicing).
        start: positions [0, start) are kept as they are.
        indices: LongTensor [m], increasing offsets (relative to ``start``) of the entries to keep.
    Raises:
        ValueError: for a sliding-window layer whose window is already full (its older entries are
            gone, so positions no longer match indices) or a layer type without positions.
    """
    indices = indices.to(torch.long)
    for compact in CACHE_COMPACTORS:
        if compact(cache.layers, start, indices):
            return
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.compact(start, indices.to(layer._key_buffer.device) if layer._key_buffer is not None else indices)
            continue
        if isinstance(layer, DummyLayer):  # a KV-shared layer: it holds nothing
            continue
        if isinstance(layer, SlidingLayer):
            if layer.is_initialized:
                layer.compact(start, indices)
            continue
        if not isinstance(layer, DynamicLayer):
            raise ValueError(f"cannot compact a {type(layer).__name__} cache layer")
        if not layer.is_initialized:
            continue
        if isinstance(layer, DynamicSlidingWindowLayer):
            if layer.cumulative_length != layer.keys.shape[-2]:
                raise ValueError(
                    f"cannot compact a sliding-window layer past its window ({layer.sliding_window}); "
                    "tree verification needs sequences shorter than the sliding window"
                )
        keep = torch.cat([torch.arange(start, device=layer.keys.device), start + indices.to(layer.keys.device)])
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = layer.keys.shape[-2]


class RowStateLayer:
    """Base of a cache layer whose state belongs to each cache row as a whole, not to slots: a
    recurrent layer's state (its value after the row's last position), a cross-attention layer's
    image keys and values. Batched decoding (:class:`~mmspec.core.batch.BatchState`) stacks,
    selects and joins such a layer by rows and, at every commit, tells it how many of the last
    forward's positions each row keeps (:meth:`keep_rows`); the slot bookkeeping of the attention
    layers (holes, squeezes, crops of slots no row holds) never reaches it. A plain class, so that
    an ``isinstance`` check costs nanoseconds."""

    @classmethod
    def stack_rows(cls, layers: list, shared: dict) -> "RowStateLayer":
        """One layer holding the rows of ``layers`` (one per sequence, each after its own prefill
        and settled), in order. ``shared``: one dict per stacked cache, for what the layers of one
        cache share (a replay group)."""
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the cache rows ``rows`` (LongTensor [B']), in this order."""
        raise NotImplementedError

    def join_rows(self, other: "RowStateLayer", shared: dict) -> None:
        """Append the rows of ``other`` (the same layer of another batch) after this layer's."""
        raise NotImplementedError

    def keep_rows(self, kept: list[int]) -> None:
        """After a forward over n positions of every row: cache row b keeps the first ``kept[b]``
        (0 <= kept[b] <= n) of them; the layer's state becomes each row's state after them."""
        raise NotImplementedError


def batch_layers(cache: Cache, stacked: bool = True) -> list[DynamicLayer]:
    """The slot layers of a cache batched decoding can hold rows of: all full-attention
    (:class:`PreallocatedLayer`; with ``stacked=False``, a cache to stack, any full-attention
    ``DynamicLayer``), KV-shared layers (which hold nothing) and :class:`RowStateLayer` layers
    (:func:`row_state_layers`) left out; ValueError for anything else (windowed sliding layers,
    static caches)."""
    kinds = {type(layer).__name__ for layer in cache.layers
             if not (isinstance(layer, (PreallocatedLayer, DummyLayer, RowStateLayer)) or not stacked and type(layer) is DynamicLayer)}
    if kinds:
        raise ValueError(f"batched decoding needs full-attention cache layers; this model has {', '.join(sorted(kinds))} "
                         "(sliding-window attention): decode it with batch size 1")
    return [layer for layer in cache.layers if not isinstance(layer, (DummyLayer, RowStateLayer))]


def slot_count(cache: Cache) -> int:
    """The slots per cache row of a batch's cache: the length of its slot layers
    (:func:`batch_layers`). Not ``cache.get_seq_length()``: transformers from 5.25 reads that from
    the cache's first layer, in a hybrid model a :class:`RowStateLayer`, which has no slots."""
    layers = batch_layers(cache)
    return layers[0].get_seq_length() if layers else cache.get_seq_length()


def row_state_layers(cache: Cache) -> list[RowStateLayer]:
    """The :class:`RowStateLayer` layers of a cache (recurrent layers, image keys/values)."""
    return [layer for layer in getattr(cache, "layers", ()) if isinstance(layer, RowStateLayer)]


def stack_caches(caches: list[Cache], paddings: list[torch.Tensor | None] | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """One cache from B caches of R rows each (R = 2 for a guided image sequence) and lengths n_b,
    left-padded to max n_b: sequence b's rows become rows [b R, (b + 1) R). A
    :class:`RowStateLayer` is stacked by its own :meth:`~RowStateLayer.stack_rows` (no padding:
    it has no slots).

    Args:
        paddings: per cache, None or LongTensor [R]: pad entries at the start of each of its rows
            (``SequenceState.row_padding``), which stay invalid.
    Returns:
        The cache (every attention layer a PreallocatedLayer [B R, H, C, D]) and ``valid`` BoolTensor
        [B R, C]: which slots hold each cache row's entries (its last n_b, less its own padding; the
        pad slots before them are zeros).
    """
    per_cache = [batch_layers(cache, stacked=False) for cache in caches]
    lengths = [cache.get_seq_length() for cache in caches]
    width = max(lengths)
    layers = []
    for parts in zip(*per_cache):  # (KV-shared and row-state layers are put at their places below)
        rows = parts[0].keys.shape[0]
        keys = parts[0].keys.new_zeros((len(parts) * rows, *parts[0].keys.shape[1:-2], width, parts[0].keys.shape[-1]))
        values = parts[0].values.new_zeros((len(parts) * rows, *parts[0].values.shape[1:-2], width, parts[0].values.shape[-1]))
        for b, (layer, n) in enumerate(zip(parts, lengths)):
            keys[b * rows : (b + 1) * rows, ..., width - n :, :] = layer.keys
            values[b * rows : (b + 1) * rows, ..., width - n :, :] = layer.values
        layers.append(PreallocatedLayer.from_tensors(keys, values))
    stacked = DynamicCache()
    data, shared = iter(layers), {}
    stacked.layers = [DummyLayer() if isinstance(layer, DummyLayer)
                      else type(layer).stack_rows([cache.layers[i] for cache in caches], shared) if isinstance(layer, RowStateLayer)
                      else next(data) for i, layer in enumerate(caches[0].layers)]
    stacked.layer_class_to_replicate = None
    rows = layers[0].keys.shape[0] // len(caches)
    paddings = paddings or [None] * len(caches)
    first = torch.cat([width - n + (torch.zeros(rows, dtype=torch.long) if pad is None else pad.cpu().long())
                       for n, pad in zip(lengths, paddings)])
    valid = torch.arange(width)[None, :] >= first[:, None]
    return stacked, valid


def layer_prefix_view(cache: Cache, num_layers: int) -> DynamicCache:
    """A cache that *shares* the first ``num_layers`` layer objects of ``cache``.

    Used by self-speculative drafters (layer skip, Kangaroo): the first N layers' keys and values
    of the committed prefix are identical for the shallow draft and the full target, so the draft
    reads them instead of recomputing. Anything the draft appends must be cropped from the view
    (:func:`crop_cache`) before the target runs again.
    """
    if num_layers > len(cache.layers):
        raise ValueError(f"cache has {len(cache.layers)} layers, cannot view the first {num_layers}")
    if not any(isinstance(layer, CacheLayerMixin) for layer in cache.layers[:num_layers]):
        attention = next((i for i, layer in enumerate(cache.layers) if isinstance(layer, CacheLayerMixin)), None)
        raise ValueError(f"the first {num_layers} layers are all recurrent: no attention layer among them counts the cached "
                         f"positions; a self-speculative draft needs more than {attention} layers (past the first attention layer)")
    view = DynamicCache()
    view.layer_class_to_replicate = None
    view.layers = list(cache.layers[:num_layers])
    return view


class SequenceState:
    """Everything one generated sequence carries between target forwards (batch size 1).

    Invariant between steps: ``tokens`` holds the prompt and every committed token; the KV cache
    holds all of them but the last ("pending") one, which is the first input of the next forward.

    Attributes:
        tokens: LongTensor [1, L] committed tokens (prompt + generated).
        cache: the target's KV cache (every layer).
        prompt_length: number of prompt tokens at the start of ``tokens``.
        position_offset: position id of token i is i + position_offset (0 for all supported
            families; models whose multimodal positions are shifted set it at prefill).
        row_padding: LongTensor [R] or None: for a cache of R rows whose prompts differ in length
            (a guided image sequence's conditional and unconditional prompts), the pad entries at
            the start of each row, masked out of every attention; fixed at prefill (rollback never
            reaches into the prompt).
    """

    def __init__(self, tokens: torch.Tensor, cache: Cache, prompt_length: int, position_offset: int = 0,
                 row_padding: torch.Tensor | None = None):
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"SequenceState holds one sequence [1, L], got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.cache = cache
        self.prompt_length = prompt_length
        self.position_offset = position_offset
        self.row_padding = row_padding

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def new_tokens(self) -> torch.Tensor:
        """LongTensor [1, L - prompt_length]: the generated part."""
        return self.tokens[:, self.prompt_length :]

    def position_ids(self, num_tokens: int, start: int | None = None) -> torch.Tensor:
        """LongTensor [1, num_tokens]: position ids of the next ``num_tokens`` inputs after the cache
        (or after ``start`` cached tokens)."""
        first = (self.cache_length if start is None else start) + self.position_offset
        return torch.arange(first, first + num_tokens, device=self.tokens.device).unsqueeze(0)

    def verification_inputs(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The next forward's inputs [1, 1 + K]: the pending token, then the drafts [1, K]."""
        return torch.cat([self.tokens[:, -1:], draft_tokens.to(self.tokens.device)], dim=1)

    def compact(self, path: torch.Tensor) -> None:
        """Keep the accepted path of a tree verification forward in the cache.

        The forward over [last token, node_0 .. node_{N-1}] (see ``mmspec.core.tree``) appended
        N + 1 entries after the ``length - 1`` cached ones. Afterwards the cache holds the
        ``length`` entries up to the last token, followed by the entries of the nodes in ``path``,
        moved to contiguous positions: exactly what a linear forward over the path would have left.

        Args:
            path: LongTensor [n] accepted node indices, root to leaf (no PAD).
        """
        if self.cache_length < self.length:
            raise ValueError(f"compact needs the tree forward's entries in the cache ({self.cache_length} < {self.length})")
        own = getattr(self.cache, "compact_tree", None)  # a target's own cache (e.g. a codec LM's step cache)
        if own is not None:
            own(self.length, path)
        else:
            compact_cache(self.cache, self.length, path)

    def commit(self, new_tokens: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Append accepted tokens [1, m] and drop every speculative cache entry beyond them.

        After a verification forward over [pending, d_1..d_K] with n drafts accepted, the cache holds
        L + K entries; committing d_1..d_n and the bonus token leaves L + n = new length - 1.
        After a tree forward, ``path`` (LongTensor [n], the accepted node indices) first moves the
        accepted nodes' entries behind the prefix (:meth:`compact`).
        """
        if path is not None:
            self.compact(path)
        self.tokens = torch.cat([self.tokens, new_tokens.to(self.tokens.device)], dim=1)
        crop_cache(self.cache, self.length - 1)

    def rollback(self, length: int) -> None:
        """Forget every token after the first ``length`` (>= prompt length), cache included."""
        if not self.prompt_length <= length <= self.length:
            raise ValueError(f"rollback length {length} outside [{self.prompt_length}, {self.length}]")
        self.tokens = self.tokens[:, :length]
        crop_cache(self.cache, min(self.cache_length, length - 1))


class StaticKVCache:
    """A KV cache of fixed buffers, for captured (CUDA-graph) forwards whose tensors never move.

    Every layer's keys and values live in buffers [R, H, capacity, D] allocated once. A forward
    writes its q inputs' entries at the slots in ``slots`` (LongTensor [q], a buffer its caller
    fills before the forward) and attends over the whole capacity, under a mask that hides every
    slot at or past the sequence (the caller's); ``length`` is host bookkeeping that the caller
    advances after a forward, so rollback (``crop``) moves a number and copies nothing. It offers
    what :class:`SequenceState` and the models use: ``get_seq_length``, ``crop``, ``update`` and
    ``compact_tree`` (tree verification).

    Args:
        layers: number of attention layers.
        shape: (R, H, capacity, D) of each layer's buffers.
    """

    def __init__(self, layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.length = 0
        self.owner = None  # the sequence state that holds the buffers now (its target sets it)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write [R, H, q, D] entries at ``slots``; return the layer's whole buffers [R, H, capacity, D]."""
        self.keys[layer_idx].index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (transformers' convention: a non-positive count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def compact_tree(self, start: int, path: torch.Tensor) -> None:
        """Keep slots [0, start) and then ``start + path`` (LongTensor [m]), moved to [start, start + m)."""
        keep = start + path.to(self.keys[0].device, torch.long)
        for buffer in (*self.keys, *self.values):
            buffer[:, :, start : start + keep.shape[0]] = buffer.index_select(2, keep)
        self.length = start + keep.shape[0]
