"""Adapter: the recurrent layers of transformers' hybrid decoders as cache layers that roll back.

Qwen3.5 (``Qwen3_5ForCausalLM``; every 4th layer full attention, the others Gated DeltaNet linear
attention with a short causal convolution before it) and LFM2 / LFM2-VL (``Lfm2ForCausalLM``,
``Lfm2VlForConditionalGeneration``; short-convolution layers between attention layers) keep, per
recurrent layer, transformers' ``LinearAttentionLayer`` state: a conv window [B, C, k] (the last k
inputs of the causal depthwise convolution, k = its kernel size) and, for Gated DeltaNet, the
delta-rule state S [B, H_v, d_k, d_v] (float32). transformers can crop the conv window
(``activate_past_recording``) but not S. :class:`RecurrentLayer` replaces that cache layer: the
model's own modules run unchanged and hand it their states through transformers' cache interface
(``update_conv_state`` / ``update_recurrent_state``); it keeps, per forward since the last commit,
the states before it and the conv inputs [B, C, n] (:class:`mmspec.core.recurrent.StateHistory`).
Rewinding to an accepted length inside a verification forward of n = K + 1 positions restores the
states before it and replays the first m positions:

- conv window: the last k columns of [window, conv inputs[:, :, :m]] (no arithmetic);
- Gated DeltaNet (:func:`delta_rule_states`): from the layer's input hidden states of those m
  positions (the adapter keeps them from the verification forward, :func:`keep_layer_inputs`), its
  RMSNorm, the small gate projections a, b [H -> H_v] and the convolution of the kept conv inputs
  give k, v, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), then the delta rule

      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   t = 1 .. m

  (the state update of transformers' ``torch_recurrent_gated_delta_rule``, the function its
  one-token decoding steps run). The large projections (q/k/v, z, out) are not run again, and all
  Gated DeltaNet layers of a cache replay in one stacked computation (:class:`DeltaGroup`).

A forward of one token (plain steps, a drafter's steps on shared layers) ends on a segment boundary:
rewinding there restores references, no arithmetic. The same holds for a fully accepted chain.

Batches (:class:`~mmspec.core.cache.RowStateLayer`): rows are prefilled alone and their states
stacked on the batch dimension (no padding: a state has no positions); at every commit each row is
rewound to its own accepted length (:meth:`RecurrentLayer.keep_rows`: per-row lengths m_b, one
replay over max m_b positions, row b's state taken after its own m_b). Token trees are refused
(:data:`TREES_REFUSED`): a tree needs a recurrent state per branch.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ..core.cache import RowStateLayer, make_cache
from ..core.recurrent import Segment, Settling, StateHistory

TREES_REFUSED = ("has recurrent layers (linear attention / short convolutions) whose state follows one sequence: a token "
                 "tree would need a state per branch. Use a chain drafter (prompt-lookup, layer-skip:N, a draft model, eagle)")

#: token-mixer class name -> the class of the group that replays the recurrent states of a cache's
#: layers of that kind (``group.members``, ``group.replay(layer, segment, m)``); None for a short
#: convolution with no recurrent state (the cache layer rewinds its window itself)
MIXERS: dict[str, type | None] = {"Lfm2ShortConv": None, "Lfm2MoeShortConv": None}


def register_mixer(*names: str):
    """Register a replay group class for the token-mixer classes ``names``."""
    def decorator(group_class):
        for name in names:
            MIXERS[name] = group_class
        return group_class
    return decorator


def _window(conv: torch.Tensor | None, inputs: torch.Tensor, size: int) -> torch.Tensor:
    """The last ``size`` columns of [conv, inputs] ([B, C, size]; zeros on the left where shorter)."""
    full = inputs if conv is None else torch.cat([conv, inputs], dim=-1)
    window = full[..., -size:]
    return F.pad(window, (size - window.shape[-1], 0)) if window.shape[-1] < size else window


def _windows(conv: torch.Tensor | None, inputs: torch.Tensor, m: "int | tuple[int, ...]", size: int) -> torch.Tensor:
    """The conv windows [B, C, size] after the first m positions of a forward's conv inputs [B, C, n]:
    :func:`_window` of [conv, inputs[..., :m]], or with per-row lengths m = (m_0 .. m_{B-1}) each
    row's own (a row of a batch keeps its own number of positions)."""
    if isinstance(m, int):
        return _window(conv, inputs[..., :m], size)
    return torch.stack([_window(None if conv is None else conv[b], inputs[b, :, :mb], size) for b, mb in enumerate(m)])


def _stacked(entries: list[tuple[nn.Module, tuple, dict]]) -> dict | None:
    """The per-layer constants of Gated DeltaNet layers stacked over the layers, or None where a
    module is not the plain kind whose arithmetic is stacked here (a replaced projection, another norm):
    then each layer's own modules run."""
    layers = [layer for layer, _, _ in entries]
    mixers = [layer.linear_attn for layer in layers]
    if not all(type(m.in_proj_a) is nn.Linear and type(m.in_proj_b) is nn.Linear and m.in_proj_a.bias is None
               and m.in_proj_b.bias is None and type(layer.input_layernorm).__name__ in ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")
               for m, layer in zip(mixers, layers)):
        return None
    return {"norm": torch.stack([layer.input_layernorm.weight.float() for layer in layers])[:, None, :],  # [L, 1, H]
            "eps": layers[0].input_layernorm.eps,
            # [L, H, 2 H_v] in fp32: a few-row bmm in bf16 takes a slow path on CPUs (~1 ms here)
            "gates": torch.stack([torch.cat([m.in_proj_a.weight, m.in_proj_b.weight]).T.float() for m in mixers]),
            "a": torch.stack([-m.A_log.float().exp() for m in mixers])[:, None, :],  # [L, 1, H_v]
            "dt_bias": torch.stack([m.dt_bias for m in mixers])[:, None, :]}


def delta_rule_states(entries: list[tuple[nn.Module, tuple, dict]], m: "int | tuple[int, ...]", stacked: dict | None = None
                      ) -> list[tuple]:
    """The states of Gated DeltaNet layers after the first m positions of a forward, all layers in one
    computation (the layers stacked; module docstring's replay). With per-row lengths
    m = (m_0 .. m_{B-1}) (the rows of a batch, each keeping its own accepted positions) the
    recurrence runs over max m_b positions and row b's state is taken after its own m_b: the same
    operations on row b as the replay of m_b positions on that row alone.

    Args:
        entries: per layer (its decoder layer, its states before the forward (conv window [B, C, k]
            or None, S [B, H_v, d_k, d_v] or None), the forward's ``conv`` inputs [B, C, n] and
            ``hidden`` inputs [B, n, H]).
        stacked: :func:`_stacked` of the same layers (None: each layer's modules run).
    Returns:
        Per layer (conv window [B, C, k], S [B, H_v, d_k, d_v] fp32).

    Only what the state needs is computed: the layer's RMSNorm (Qwen3.5's: x / rms(x) (1 + w)) and
    gate projections give beta = sigmoid(b) and exp(g), g = -exp(A_log) softplus(a + dt_bias); the
    depthwise convolution of the k and v channels (then the activation), k L2-normalised
    (transformers' l2norm, eps 1e-6) and the state update of transformers' one-token recurrence
    (``torch_recurrent_gated_delta_rule``) without its output (q and the attention output are not
    needed; the large projections are not run again).
    """
    from transformers.activations import ACT2FN

    mixers = [layer.linear_attn for layer, _, _ in entries]
    first = mixers[0]
    for mixer in mixers[1:]:  # one shape for all (true of every layer of one model)
        if (mixer.key_dim, mixer.value_dim, mixer.num_v_heads, mixer.conv_kernel_size, mixer.activation) != (
                first.key_dim, first.value_dim, first.num_v_heads, first.conv_kernel_size, first.activation):
            raise ValueError("Gated DeltaNet layers of different shapes cannot be replayed together")
    size, heads, key_heads, dk, dv = first.conv_kernel_size, first.num_v_heads, first.num_k_heads, first.head_k_dim, first.head_v_dim
    per_row, m = (m, max(m)) if isinstance(m, tuple) else (None, m)
    news, fulls, hiddens, starts = [], [], [], []
    for _, (conv, recurrent), inputs in entries:
        hidden = inputs.get("hidden")
        if hidden is None:
            raise ValueError("cannot replay a Gated DeltaNet state without the layer's inputs of that forward "
                             "(run it through mmspec's TransformersTarget)")
        new = inputs["conv"][..., :m]
        full = new if conv is None else torch.cat([conv, new], dim=-1)
        news.append(new)
        fulls.append(F.pad(full[:, first.key_dim:], (max(0, size - full.shape[-1]), 0)))  # k, v channels [B, C', k' + m]
        hiddens.append(hidden[:, :m])
        starts.append(torch.zeros(hidden.shape[0], heads, dk, dv, device=hidden.device) if recurrent is None else recurrent.float())
    b, layers, channels = news[0].shape[0], len(entries), fulls[0].shape[1]
    if stacked is not None:  # every layer's norm and gate projections in one go
        hidden = torch.stack(hiddens).flatten(1, 2)  # [L, B m, H]
        x = hidden.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + stacked["eps"]) * (1.0 + stacked["norm"])).type_as(hidden)
        a, gate_b = torch.bmm(x.float(), stacked["gates"]).split(heads, dim=-1)  # [L, B m, H_v] each (the norm's rounding kept)
        beta = gate_b.sigmoid()
        decay = (stacked["a"] * F.softplus(a + stacked["dt_bias"].float())).exp()
    else:
        betas, decays = [], []
        for (layer, _, _), mixer, h in zip(entries, mixers, hiddens):
            x = layer.input_layernorm(h)
            betas.append(mixer.in_proj_b(x).sigmoid().float().flatten(0, 1))
            decays.append((-mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float() + mixer.dt_bias)).exp().flatten(0, 1))
        beta, decay = torch.stack(betas), torch.stack(decays)
    weight = torch.cat([mixer.conv1d.weight[first.key_dim:] for mixer in mixers])  # [L C', 1, k]
    bias = None if first.conv1d.bias is None else torch.cat([mixer.conv1d.bias[first.key_dim:] for mixer in mixers])
    kv = F.conv1d(torch.cat(fulls, dim=1).to(weight.dtype), weight, bias, groups=weight.shape[0])[..., -m:]
    kv = ACT2FN[first.activation](kv).to(news[0].dtype)  # [B, L C', m]
    kv = kv.view(b, layers, channels, m).permute(1, 0, 3, 2)  # [L, B, m, C']
    key = kv[..., : first.key_dim].reshape(layers, b, m, key_heads, dk).float()
    key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    if heads != key_heads:
        key = key.repeat_interleave(heads // key_heads, dim=3)
    value = kv[..., first.key_dim:].reshape(layers, b, m, heads, dv).float()
    # S_t = exp(g_t) S_{t-1} + k_t delta_t^T, delta_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t), on
    # [L B H_v, d_k, d_v]: a GEMV and a rank-1 update per position, in place on a new tensor
    rows = layers * b * heads
    key = key.permute(0, 1, 3, 2, 4).reshape(rows, m, dk)
    value = value.permute(0, 1, 3, 2, 4).reshape(rows, m, dv)
    beta = beta.view(layers, b, m, heads).permute(0, 1, 3, 2).reshape(rows, m)
    decay = decay.view(layers, b, m, heads).permute(0, 1, 3, 2).reshape(rows, m)
    state = torch.stack(starts).view(rows, dk, dv)
    if per_row is not None:  # (rows of the [L, B, H_v] layout) -> its batch row's length; kept[r]: r's state once it has its m_b
        lengths = torch.tensor(per_row, device=state.device)[None, :, None].expand(layers, b, heads).reshape(rows)
        kept = state
    for t in range(m):
        state = state * decay[:, t, None, None] if t == 0 else state.mul_(decay[:, t, None, None])
        k_t = key[:, t, None, :]  # [rows, 1, d_k]
        delta = (value[:, t, None, :] - torch.bmm(k_t, state)) * beta[:, t, None, None]  # [rows, 1, d_v]
        state = state.baddbmm_(k_t.transpose(1, 2), delta)
        if per_row is not None and t + 1 in per_row:
            kept = torch.where((lengths == t + 1)[:, None, None], state, kept)
    if per_row is not None:
        state, m = kept, per_row
    state = state.view(layers, b, heads, dk, dv)
    return [(_windows(conv, inputs["conv"], m, size), state[i]) for i, (_, (conv, _), inputs) in enumerate(entries)]


class Shared:
    """A reference that a deep copy shares instead of copying (a model module held by a cache layer:
    copying a cache must not copy the model)."""

    def __init__(self, value) -> None:
        self.value = value

    def __deepcopy__(self, memo) -> "Shared":
        return self


class DeltaGroup:
    """The Gated DeltaNet layers of one cache, rewound together: a crop rewinds every layer in turn;
    the first one to replay inside a forward computes the states of every member whose history holds
    the same forward (:func:`delta_rule_states`, one computation over the stacked layers), the others
    take theirs. A rollback then costs about one layer's Python instead of one per layer. (A deep
    copy of the cache copies its group with it: the members are the copy's layers.)
    """

    def __init__(self) -> None:
        self.members: list["RecurrentLayer"] = []
        #: id(a member's segment inputs) -> (those inputs (held, so the id stays theirs), m, its states)
        self.results: dict[int, tuple[dict, int, tuple]] = {}
        #: (the decoder layers replayed together) -> _stacked of them; shared by deep copies of the cache
        self.constants = Shared({})

    def replay(self, layer: "RecurrentLayer", segment: Segment, m: int) -> tuple:
        done = self.results.pop(id(segment.inputs), None)
        if done is not None and done[0] is segment.inputs and done[1] == m:
            return done[2]
        self.results.clear()
        entries, others = [(layer.decoder_layer.value, segment.states, segment.inputs)], []
        for other in self.members:
            if other is layer:
                continue
            same = next((s for s in other.history.segments if (s.start, s.count) == (segment.start, segment.count)), None)
            if same is not None and "hidden" in same.inputs:
                entries.append((other.decoder_layer.value, same.states, same.inputs))
                others.append(same.inputs)
        group = tuple(id(layer) for layer, _, _ in entries)
        constants = self.constants.value
        if group not in constants:  # (once per sequence and its copies: the weights are fixed while it decodes)
            constants[group] = _stacked(entries)
        results = delta_rule_states(entries, m, constants[group])
        for inputs, result in zip(others, results[1:]):
            self.results[id(inputs)] = (inputs, m, result)
        return results[0]


register_mixer("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")(DeltaGroup)


class RecurrentLayer(Settling, RowStateLayer, LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (one conv window, one optional recurrent state) with a
    history that rewinds it (module docstring).

    The model's modules see ``is_recording_past`` true, so every forward, one token included,
    hands its conv inputs to :meth:`update_conv_state` (never the in-place one-token update), and
    :meth:`update_recurrent_state` stores the new state instead of copying it into the old one:
    the previous tensors stay intact as the history's start states, no copy made.

    Args:
        group: the replay group of the cache's layers of this kind (:data:`MIXERS`), or None for a
            convolution only.
        decoder_layer: the model's decoder layer this cache layer serves (with a group).
    """

    def __init__(self, group=None, decoder_layer: nn.Module | None = None) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=1)
        self.record_past = True
        self.group = group
        self.decoder_layer = Shared(decoder_layer)
        self.needs_hidden = group is not None
        self.history = StateHistory(self._replay)
        if group is not None:
            group.members.append(self)

    def _replay(self, segment: Segment, m: int) -> tuple:
        conv, recurrent = segment.states
        if self.group is not None:
            return self.group.replay(self, segment, m)
        if recurrent is not None:
            raise ValueError("this recurrent layer has no registered replay for its state")
        return _windows(conv, segment.inputs["conv"], m, self.conv_kernel_size[0]), None

    def _states(self) -> tuple:
        if not self.has_previous_state[0]:
            return None, None
        return self.conv_states[0], self.recurrent_states[0]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Record the forward (its conv inputs ``conv_states`` [B, C, n]) and return [window, inputs]
        (just the inputs at the first forward), the columns the model's causal convolution runs over."""
        if state_idx:
            raise ValueError("mmspec's recurrent cache layer holds one state per layer")
        if not self.is_conv_states_initialized[0]:
            self.lazy_initialization(conv_states=conv_states, conv_kernel_size=conv_kernel_size)
        before = self._states()
        self.history.record(conv_states.shape[-1], before, conv=conv_states)
        conv = before[0]
        self.conv_states[0] = _window(conv, conv_states, self.conv_kernel_size[0])
        self.has_previous_state[0] = True
        return conv_states if conv is None else torch.cat([conv, conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Keep the new state [B, H_v, d_k, d_v] by reference (the previous one is a start state)."""
        self.is_recurrent_states_initialized[0] = True
        self.recurrent_states[0] = recurrent_states
        return recurrent_states

    def get_seq_length(self) -> int:
        """The positions this layer holds (its history's length, an int). transformers from 5.25
        reads a cache's length from its first layer, a recurrent one in these models (before, from
        its first attention layer); the rows of a batch count their slots in the attention layers."""
        return self.history.length

    def crop(self, tokens_to_remove: int) -> None:
        """Rewind by ``-tokens_to_remove`` positions (transformers' convention) and settle there."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        states = self.history.rewind(self.history.length + tokens_to_remove)
        if states is not None:
            self._restore(*states)

    def _restore(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        self.has_previous_state[0] = conv is not None
        if conv is not None:
            self.conv_states[0] = conv
        self.recurrent_states[0] = recurrent
        self.is_recurrent_states_initialized[0] = recurrent is not None

    # the rows of a batch (mmspec.core.batch): states stacked on dim 0, each row rewound to its own length
    def keep_rows(self, kept: list[int]) -> None:
        """Row b keeps the first ``kept[b]`` positions of the last forward: its window and state
        become those after them (:meth:`~mmspec.core.recurrent.StateHistory.rewind_rows`; one replay
        for the rows cut inside the forward)."""
        states = self.history.rewind_rows(kept, self._states())
        if states is not None:
            self._restore(*states)

    def _settled_states(self) -> tuple:
        if self.history.segments:
            raise ValueError("a recurrent layer's rows are selected or joined only between commits")
        return self._states()

    @classmethod
    def stack_rows(cls, layers: list["RecurrentLayer"], shared: dict) -> "RecurrentLayer":
        """One layer of the rows of ``layers`` (each a sequence's, after its prefill): windows
        [B, C, k] and states [B, H_v, d_k, d_v] concatenated; no padding, a state has no positions.
        The stacked cache's layers of one mixer kind share one new replay group (``shared``)."""
        first = layers[0]
        group = None
        if first.group is not None:
            group = shared.get(("group", type(first.group)))
            if group is None:
                group = shared[("group", type(first.group))] = type(first.group)()
                group.constants = first.group.constants  # (the same model: the same stacked weights)
        layer = cls(group, first.decoder_layer.value)
        states = [other._states() for other in layers]  # (each row's states now: the stacked layer starts settled)
        if any(c is None for c, _ in states):
            raise ValueError("a recurrent layer's rows are stacked only after their prefill")
        conv = torch.cat([c for c, _ in states])
        layer.lazy_initialization(conv_states=conv, conv_kernel_size=first.conv_kernel_size[0])
        layer._restore(conv, None if states[0][1] is None else torch.cat([r for _, r in states]))
        return layer

    def select_rows(self, rows: torch.Tensor) -> None:
        conv, recurrent = self._settled_states()
        rows = rows.to(conv.device)
        self._restore(conv.index_select(0, rows), None if recurrent is None else recurrent.index_select(0, rows))

    def join_rows(self, other: "RecurrentLayer", shared: dict) -> None:
        (conv, recurrent), (their_conv, theirs) = self._settled_states(), other._settled_states()
        self._restore(torch.cat([conv, their_conv]), None if recurrent is None else torch.cat([recurrent, theirs]))

    def reset(self) -> None:
        self.history = StateHistory(self._replay)
        self.has_previous_state[0] = False
        self.recurrent_states[0] = None
        self.is_recurrent_states_initialized[0] = False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return False


def has_recurrent_layers(config) -> bool:
    """Whether transformers' cache for ``config`` has linear-attention / convolution layers."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers)


def first_attention_layer(config) -> int | None:
    """The index of the first attention (not recurrent) layer of transformers' cache for ``config``,
    or None where every layer is recurrent."""
    layers = DynamicCache(config=config).layers
    return next((i for i, layer in enumerate(layers) if not isinstance(layer, LinearAttentionCacheLayerMixin)), None)


def mixer_kind(decoder_layer: nn.Module, index: int) -> str:
    """The registered token-mixer class name of decoder layer ``index`` (:data:`MIXERS`). Raises
    ValueError for a mixer mmspec cannot roll back."""
    for module in decoder_layer.children():
        if type(module).__name__ in MIXERS:
            return type(module).__name__
    kinds = ", ".join(type(m).__name__ for m in decoder_layer.children())
    raise ValueError(f"decoder layer {index} ({kinds}) has a recurrent state mmspec cannot roll back; "
                     f"supported token mixers: {', '.join(sorted(MIXERS))}")


def make_recurrent_cache(config, decoder: nn.Module) -> DynamicCache:
    """:func:`mmspec.core.cache.make_cache` for a hybrid decoder (its ``layers`` in ``decoder``):
    full-attention layers preallocated, recurrent layers :class:`RecurrentLayer` with their replays
    (one replay group per mixer kind and cache)."""
    cache = make_cache(config)
    groups: dict[str, object] = {}
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            kind = mixer_kind(decoder.layers[i], i)
            group = None if MIXERS[kind] is None else groups.setdefault(kind, MIXERS[kind]())
            cache.layers[i] = RecurrentLayer(group, decoder.layers[i])
        elif isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError(f"cache layer {i} is a {type(layer).__name__} (recurrent and attention in one layer), "
                             "which mmspec cannot roll back")
    return cache


def wants_layer_inputs(cache) -> bool:
    """Whether a forward over several positions must keep its layer inputs (:func:`keep_layer_inputs`)."""
    return any(isinstance(layer, RecurrentLayer) and layer.needs_hidden for layer in cache.layers)


def keep_layer_inputs(cache, hidden_states: tuple[torch.Tensor, ...]) -> None:
    """Give each Gated DeltaNet layer's last segment its input hidden states [B, n, H] (entry i of a
    transformers ``hidden_states`` tuple is layer i's input), for a rewind inside that forward."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, RecurrentLayer) and layer.needs_hidden and layer.history.segments:
            layer.history.segments[-1].inputs["hidden"] = hidden_states[i]


def held_bytes(cache) -> int:
    """Bytes the recurrent layers' histories keep alive now (what rollback costs in memory)."""
    return sum(layer.history.held_bytes() for layer in cache.layers if isinstance(layer, RecurrentLayer))
