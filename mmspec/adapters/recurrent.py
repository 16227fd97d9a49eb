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
- Gated DeltaNet (:func:`gated_delta_replay`): from the layer's input hidden states of those m
  positions (the adapter keeps them from the verification forward, ``keep_layer_inputs``), its
  RMSNorm, the small gate projections a, b [H -> H_v] and the convolution of the kept conv inputs
  give q, k, v, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), then the delta rule

      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   t = 1 .. m

  (transformers' ``torch_recurrent_gated_delta_rule``, the function its one-token decoding steps
  run). The large projections (q/k/v, z, out) are not run again.

A forward of one token (plain steps, a drafter's steps on shared layers) ends on a segment boundary:
rewinding there restores references, no arithmetic. The same holds for a fully accepted chain.

Batches and token trees are refused (:data:`TREES_REFUSED`, :data:`BATCHES_REFUSED`): a tree needs
a recurrent state per branch, and a batch left-pads rows whose padding decays S (the delta rule
decays the state at every position, padded or not), so rows would not equal batch-1 rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ..core.cache import make_cache
from ..core.recurrent import Replay, Settling, StateHistory

TREES_REFUSED = ("has recurrent layers (linear attention / short convolutions) whose state follows one sequence: a token "
                 "tree would need a state per branch. Use a chain drafter (prompt-lookup, layer-skip:N, a draft model, eagle)")
BATCHES_REFUSED = ("has recurrent layers (linear attention / short convolutions): a left-padded row's padding would decay "
                   "its recurrent state, so rows would differ from batch-1 rows")

#: token-mixer class name -> factory(decoder layer) -> replay of its recurrent state; None for a
#: short convolution with no recurrent state (the cache layer rewinds its window itself)
MIXERS: dict[str, Callable[[nn.Module], Replay] | None] = {"Lfm2ShortConv": None}


def register_mixer(*names: str):
    """Register a replay factory for the token-mixer classes ``names``."""
    def decorator(factory):
        for name in names:
            MIXERS[name] = factory
        return factory
    return decorator


def _window(conv: torch.Tensor | None, inputs: torch.Tensor, size: int) -> torch.Tensor:
    """The last ``size`` columns of [conv, inputs] ([B, C, size]; zeros on the left where shorter)."""
    full = inputs if conv is None else torch.cat([conv, inputs], dim=-1)
    window = full[..., -size:]
    return F.pad(window, (size - window.shape[-1], 0)) if window.shape[-1] < size else window


@register_mixer("Qwen3_5GatedDeltaNet")
def gated_delta_replay(decoder_layer: nn.Module) -> Replay:
    """The replay of a Qwen3.5 decoder layer's Gated DeltaNet state (module docstring): ``(states,
    inputs, m) -> (conv window, S after m positions)``, with ``inputs`` the segment's ``conv``
    [B, C, n] and ``hidden`` [B, n, H] (the layer's input hidden states)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_recurrent_gated_delta_rule

    mixer, norm = decoder_layer.linear_attn, decoder_layer.input_layernorm

    def replay(states: tuple, inputs: dict, m: int) -> tuple:
        conv, recurrent = states
        hidden = inputs.get("hidden")
        if hidden is None:
            raise ValueError("cannot replay a Gated DeltaNet state without the layer's inputs of that forward "
                             "(run it through mmspec's TransformersTarget)")
        x = norm(hidden[:, :m])
        new = inputs["conv"][..., :m]
        full = new if conv is None else torch.cat([conv, new], dim=-1)
        mixed = causal_conv1d_fn(full, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation)
        mixed = mixed[..., -m:].transpose(1, 2)
        query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        b, _ = x.shape[:2]
        query = query.reshape(b, m, -1, mixer.head_k_dim)
        key = key.reshape(b, m, -1, mixer.head_k_dim)
        value = value.reshape(b, m, -1, mixer.head_v_dim)
        beta = mixer.in_proj_b(x).sigmoid()
        g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float() + mixer.dt_bias)
        _, state = torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=recurrent,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        return _window(conv, new, mixer.conv_kernel_size), state

    replay.needs_hidden = True
    return replay


class RecurrentLayer(Settling, LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (one conv window, one optional recurrent state) with a
    history that rewinds it (module docstring).

    The model's modules see ``is_recording_past`` true, so every forward, one token included,
    hands its conv inputs to :meth:`update_conv_state` (never the in-place one-token update), and
    :meth:`update_recurrent_state` stores the new state instead of copying it into the old one:
    the previous tensors stay intact as the history's start states, no copy made.

    Args:
        replay: the layer's recurrent replay (:data:`MIXERS`), or None for a convolution only.
    """

    def __init__(self, replay: Replay | None = None) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=1)
        self.record_past = True
        self.mixer_replay = replay
        self.needs_hidden = bool(getattr(replay, "needs_hidden", False))
        self.history = StateHistory(self._replay)

    def _replay(self, states: tuple, inputs: dict, m: int) -> tuple:
        conv, recurrent = states
        if recurrent is None or self.mixer_replay is None:
            if recurrent is not None:
                raise ValueError("this recurrent layer has no registered replay for its state")
            return _window(conv, inputs["conv"][..., :m], self.conv_kernel_size[0]), None
        return self.mixer_replay(states, inputs, m)

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

    def crop(self, tokens_to_remove: int) -> None:
        """Rewind by ``-tokens_to_remove`` positions (transformers' convention) and settle there."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        states = self.history.rewind(self.history.length + tokens_to_remove)
        if states is None:
            return
        conv, recurrent = states
        self.has_previous_state[0] = conv is not None
        if conv is not None:
            self.conv_states[0] = conv
        self.recurrent_states[0] = recurrent
        self.is_recurrent_states_initialized[0] = recurrent is not None

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


def mixer_replay(decoder_layer: nn.Module, index: int) -> Replay | None:
    """The registered replay of decoder layer ``index``'s token mixer (None: a convolution only).
    Raises ValueError for a mixer mmspec cannot roll back."""
    for module in decoder_layer.children():
        name = type(module).__name__
        if name in MIXERS:
            factory = MIXERS[name]
            return None if factory is None else factory(decoder_layer)
    kinds = ", ".join(type(m).__name__ for m in decoder_layer.children())
    raise ValueError(f"decoder layer {index} ({kinds}) has a recurrent state mmspec cannot roll back; "
                     f"supported token mixers: {', '.join(sorted(MIXERS))}")


def make_recurrent_cache(config, decoder: nn.Module) -> DynamicCache:
    """:func:`mmspec.core.cache.make_cache` for a hybrid decoder (its ``layers`` in ``decoder``):
    full-attention layers preallocated, recurrent layers :class:`RecurrentLayer` with their replays."""
    cache = make_cache(config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[i] = RecurrentLayer(mixer_replay(decoder.layers[i], i))
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
