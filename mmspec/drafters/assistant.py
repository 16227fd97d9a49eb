"""Gemma 4's multi-token-prediction assistant (``gemma4_assistant``) as a drafter.

The assistant (transformers' ``Gemma4AssistantForCausalLM``) is a small decoder whose every layer
is KV-shared: it has no keys or values of its own and cross-attends to the target's, namely the
keys and values of the target's last non-shared layer of each attention type (the "store" layers
of ``config.kv_sharing_modes``; transformers hands them over as ``shared_kv_states``). It drafts
from one constant position: with x_L the pending token (the last committed one, at position
p = L - 1, not yet in the target's cache) and h the target's last hidden state that predicted it
(the LM head's input at position p - 1),

    e_1 = [E_target(x_L); h]                          [1, 1, 2 H_target]
    (logits_i, g_i) = Assistant(e_i, position p, KV_target[0 .. p - 1])
    d_i = pick(logits_i)                              (argmax, or a draw from q_i)
    e_{i+1} = [E_target(d_i); g_i]                    g_i: the assistant's state projected to H_target

so K drafts cost K assistant forwards of one query each and no prefill. Sliding-window layers see
the last ``sliding_window + 1`` cached positions: transformers' assistant mask keeps the keys
within distance w of the query over the reversed keys (|i - j| <= w), the positions p - 1 - w ..
p - 1. ``E_target`` is the target's scaled input embedding; with
``use_ordered_embeddings`` the assistant's logits come from its centroid-masked LM head (inside
its forward), which leaves every token a finite logit, so q is a proper distribution.

The keys and values are read from the target's own cache after each verification: the committed
prefix only. (transformers' ``SinglePositionMultiTokenCandidateGenerator`` slices the
verification forward's states at the new length, which after a rejection keeps the rejected
draft's entry at the bonus token's index; the first round's drafts are the same either way, and
the output of exact decoding is the target's whatever is drafted.)

Chains only: the target's tree verification of a sliding-window model is refused once the
sequence outgrows the window (one 4-D tree mask serves every layer), so trees would not reach
the sequences Gemma 4 captions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState, SlidingLayer
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.target import TargetOutput


def store_layers(config) -> dict[str, int]:
    """layer type -> index of the target's layer whose keys and values the assistant reads (the
    "store" layer of each type in a Gemma 4 text config's ``kv_sharing_modes``)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        raise ValueError(f"{getattr(config, 'model_type', '?')} has no KV-sharing layout (kv_sharing_modes); "
                         "the assistant drafter needs a Gemma 4 target")
    return {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


@register_drafter("assistant")
class AssistantDrafter(BatchDrafting, Drafter):
    """Chain drafting with a Gemma 4 assistant over a Gemma 4 target (module doc).

    Args:
        assistant: a ``Gemma4AssistantForCausalLM`` whose ``backbone_hidden_size`` is the target's
            hidden size and whose vocabulary is the target's.
        num_draft_tokens: K.
    Raises:
        ValueError: a model that is not a Gemma 4 assistant (checked here), a target it does not
            fit (checked at :meth:`start`).
    """

    requires_target_hidden = True
    target_hidden_layer = -1
    batch_size_one_reason = "reads the target's sliding-window cache, which batches do not hold"

    def __init__(self, assistant: nn.Module, num_draft_tokens: int = 4) -> None:
        super().__init__(num_draft_tokens)
        config = getattr(assistant, "config", None)
        if getattr(config, "model_type", None) != "gemma4_assistant":
            raise ValueError(f"the assistant drafter takes a Gemma4AssistantForCausalLM (model_type gemma4_assistant), "
                             f"got {type(assistant).__name__}; for another draft model pass it as drafter=model")
        self.assistant = assistant
        self.hidden: torch.Tensor | None = None  # [1, 1, H]: the target state that predicted the pending token
        self.embed: nn.Module | None = None
        self.stores: dict[str, int] = {}

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "AssistantDrafter":
        """``"assistant:DIR"`` (or a hub id): load the assistant in the target's dtype and device."""
        if not arg:
            raise ValueError('the assistant drafter needs its checkpoint: drafter="assistant:DIR" '
                             '(a Gemma4AssistantForCausalLM directory or hub id, e.g. google/gemma-4-e2b-it-assistant)')
        from transformers import AutoModelForCausalLM

        param = next(target.model.parameters())
        assistant = AutoModelForCausalLM.from_pretrained(arg, dtype=param.dtype).to(param.device).eval()
        return cls(assistant, num_draft_tokens or 4)

    def start(self, context: DraftContext, state: SequenceState) -> None:
        super().start(context, state)
        model = getattr(context.target, "model", None)
        if model is None:
            raise ValueError("the assistant drafter needs a transformers Gemma 4 target")
        text_config = model.config.get_text_config()
        self.stores = store_layers(text_config)
        backbone = self.assistant.config.backbone_hidden_size
        if backbone != text_config.hidden_size:
            raise ValueError(f"this assistant was trained on a target of hidden size {backbone}; the target's is "
                             f"{text_config.hidden_size}: use the assistant made for this target")
        vocab = self.assistant.config.get_text_config().vocab_size
        if vocab != context.target.vocab_size:
            raise ValueError(f"the assistant's vocabulary ({vocab}) is not the target's ({context.target.vocab_size})")
        self.embed = model.get_input_embeddings()
        self.hidden = None

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep the target's last hidden state that predicted the new pending token: the prefill's
        last row, or the row of the last accepted input (pending, d_1 .. d_n: row n)."""
        hidden = target_output.hidden_states
        self.hidden = hidden[:, -1:] if num_drafted == 0 and self.hidden is None else hidden[:, num_accepted : num_accepted + 1]

    def shared_states(self, state: SequenceState) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The committed keys and values [1, H_kv, m, D] of the target's store layer of each type:
        every cached position of a full-attention layer, the last ``sliding_window + 1`` of a
        sliding-window layer (module doc)."""
        states = {}
        for layer_type, index in self.stores.items():
            layer = state.cache.layers[index]
            if isinstance(layer, SlidingLayer):
                states[layer_type] = layer.window_states(layer.sliding_window + 1)
            elif getattr(layer, "is_sliding", False):
                raise ValueError("the assistant drafter needs the target's cache made by mmspec (make_cache)")
            else:
                states[layer_type] = (layer.keys, layer.values)
        return states

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        if self.hidden is None:
            raise ValueError("the assistant drafter has no target hidden state yet (start() and on_verified() first)")
        if state.cache_length != state.length - 1:
            raise ValueError(f"the target's cache holds {state.cache_length} positions, expected {state.length - 1}")
        shared = self.shared_states(state)
        full = shared.get("full_attention")
        mask = None if full is None else torch.ones(1, full[0].shape[-2], dtype=torch.long, device=full[0].device)
        position = torch.tensor([[state.length - 1 + state.position_offset]], device=state.tokens.device)
        token, hidden = state.tokens[:, -1:], self.hidden
        tokens, probs = [], []
        for _ in range(k):
            embeds = torch.cat([self.embed(token), hidden.to(self.embed.weight.dtype)], dim=-1)
            out = self.assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=shared,
                                 attention_mask=mask, use_cache=False)
            self.forwards += 1
            choice, q = self._pick(out.logits[:, -1])
            token, hidden = choice.view(1, 1), out.last_hidden_state
            tokens.append(token)
            probs.append(q)
        return Draft.chain(tokens, probs)

    def describe(self) -> dict[str, Any]:
        config = self.assistant.config
        return {**super().describe(), "assistant_layers": config.get_text_config().num_hidden_layers,
                "ordered_embeddings": bool(config.use_ordered_embeddings)}
