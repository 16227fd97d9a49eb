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

Trees (``tree_paths``, as Medusa's static trees: path (a, b, ...) = the a-th choice after the
pending token, then its b-th choice, ...): the assistant has no cache of its own, so every node
of a depth is one more query of one forward, the queries stacked along the batch dimension (each
sees the same target keys and values; stacked along the sequence, transformers' assistant mask
would give each query a different sliding window). Node tokens are top-k picks (q = 1 per node,
exact under sampling by the tree rule); the target verifies the tree in one forward, its
sliding-window layers included (:meth:`~mmspec.adapters.hf.TransformersTarget.tree_masks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState, SlidingLayer
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.target import TargetOutput
from ..core.tree import TokenTree


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
    """Chains or static trees drafted by a Gemma 4 assistant over a Gemma 4 target (module doc).

    Args:
        assistant: a ``Gemma4AssistantForCausalLM`` whose ``backbone_hidden_size`` is the target's
            hidden size and whose vocabulary is the target's.
        num_draft_tokens: K (a chain's length).
        tree_paths: None (chains), or the paths of a static tree (e.g. :data:`DEFAULT_TREE`); its
            depth becomes K.
    Raises:
        ValueError: a model that is not a Gemma 4 assistant (checked here), a target it does not
            fit (checked at :meth:`start`).
    """

    spec_argument = "path"
    needs_transformers_target = True
    requires_target_hidden = True
    target_hidden_layer = -1
    batch_size_one_reason = "reads the target's sliding-window cache, which batches do not hold"

    #: a sparse static tree of 14 nodes, 4 deep (more children where the assistant is confident)
    DEFAULT_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0)]

    def __init__(self, assistant: nn.Module, num_draft_tokens: int = 4,
                 tree_paths: list[tuple[int, ...]] | None = None) -> None:
        self.tree_paths = None if tree_paths is None else [tuple(p) for p in tree_paths]
        if self.tree_paths is not None:
            known = set(self.tree_paths)
            if not self.tree_paths or any(not p or p[:-1] and p[:-1] not in known for p in self.tree_paths):
                raise ValueError("tree_paths must be non-empty paths whose every prefix is a path too, e.g. "
                                 "[(0,), (1,), (0, 0)]")
            num_draft_tokens = max(len(p) for p in self.tree_paths)
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

        from ..hub import cannot_load, is_remote_code_refusal, remote_code_refused

        param = next(target.model.parameters())
        try:  # (False, not None: transformers would ask [y/N] on the terminal about an assistant of its own code)
            assistant = AutoModelForCausalLM.from_pretrained(arg, dtype=param.dtype, trust_remote_code=False)
            assistant = assistant.to(param.device).eval()
        except OSError as error:  # (offline with a hub id not cached: transformers' two lines about the connection)
            raise cannot_load("assistant", arg, error) from None
        except ValueError as error:
            if is_remote_code_refusal(error):
                raise remote_code_refused(arg, f"load it with AutoModelForCausalLM.from_pretrained({arg!r}, trust_remote_code="
                                               "True) and pass AssistantDrafter(model) as the drafter") from None
            raise
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
        own = self.assistant.config.get_text_config()
        if own.vocab_size != context.target.vocab_size:
            raise ValueError(f"the assistant's vocabulary ({own.vocab_size}) is not the target's ({context.target.vocab_size})")
        for layer_type in set(own.layer_types):  # its queries meet the target's keys: the same heads and sizes
            mine = own.per_layer_config[own.layer_types.index(layer_type)]
            theirs = None if layer_type not in self.stores else text_config.per_layer_config[self.stores[layer_type]]
            if theirs is None or (mine.head_dim, mine.num_key_value_heads) != (theirs.head_dim, theirs.num_key_value_heads):
                raise ValueError(f"the assistant's {layer_type} layers do not fit the target's keys and values "
                                 f"({'none' if theirs is None else (theirs.head_dim, theirs.num_key_value_heads)} "
                                 f"as (head_dim, KV heads)): use the assistant made for this target")
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

    def _queries(self, state: SequenceState):
        """-> run(tokens [m, 1], hidden [m, 1, H]) -> (logits [m, V], projected states [m, 1, H]):
        m assistant queries at the pending position over the target's committed keys and values
        (the batch dimension holds the queries)."""
        if self.hidden is None:
            raise ValueError("the assistant drafter has no target hidden state yet (start() and on_verified() first)")
        if state.cache_length != state.length - 1:
            raise ValueError(f"the target's cache holds {state.cache_length} positions, expected {state.length - 1}")
        shared = self.shared_states(state)
        full = shared.get("full_attention")
        length = None if full is None else full[0].shape[-2]
        position = state.length - 1 + state.position_offset

        def run(tokens: torch.Tensor, hidden: torch.Tensor):
            m = tokens.shape[0]
            embeds = torch.cat([self.embed(tokens), hidden.to(self.embed.weight.dtype)], dim=-1)
            kv = shared if m == 1 else {k: (key.expand(m, -1, -1, -1), value.expand(m, -1, -1, -1))
                                        for k, (key, value) in shared.items()}
            mask = None if length is None else torch.ones(m, length, dtype=torch.long, device=tokens.device)
            out = self.assistant(inputs_embeds=embeds, position_ids=torch.full((m, 1), position, device=tokens.device),
                                 shared_kv_states=kv, attention_mask=mask, use_cache=False)
            self.forwards += 1
            return out.logits[:, -1], out.last_hidden_state

        return run

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        run = self._queries(state)
        if self.tree_paths is not None:
            return self._tree(run, state, max_tokens)
        token, hidden = state.tokens[:, -1:], self.hidden
        tokens, probs = [], []
        for _ in range(min(self.num_draft_tokens, max_tokens)):
            logits, hidden = run(token, hidden)
            choice, q = self._pick(logits)
            token = choice.view(1, 1)
            tokens.append(token)
            probs.append(q)
        return Draft.chain(tokens, probs)

    def _tree(self, run, state: SequenceState, max_tokens: int) -> Draft:
        """The static tree's tokens, one assistant forward per depth: the query of node p reads
        [E(token of p); the state of the query that chose p]; its top choices are p's children."""
        paths = [p for p in self.tree_paths if len(p) <= max_tokens]
        top_k = 1 + max(p[-1] for p in paths)
        token_of: dict[tuple, torch.Tensor] = {}
        parents, tokens, hidden = [()], state.tokens[:, -1:], self.hidden  # the root's query: the pending token
        for depth in range(1, max(len(p) for p in paths) + 1):
            logits, states = run(tokens, hidden)
            choices = torch.topk(logits, top_k, dim=-1).indices  # [parents, k]
            row_of = {parent: row for row, parent in enumerate(parents)}
            for p in paths:
                if len(p) == depth:
                    token_of[p] = choices[row_of[p[:-1]], p[-1]]
            parents = sorted({p[:-1] for p in paths if len(p) == depth + 1})
            if not parents:
                break
            tokens = torch.stack([token_of[p] for p in parents]).view(-1, 1)
            hidden = torch.cat([states[row_of[p[:-1]]][None] for p in parents])
        return Draft.from_tree(TokenTree.from_paths(paths, torch.stack([token_of[p] for p in paths])))

    def describe(self) -> dict[str, Any]:
        config = self.assistant.config
        tree = {} if self.tree_paths is None else {"tree": "static", "tree_nodes": len(self.tree_paths)}
        return {**super().describe(), "assistant_layers": config.get_text_config().num_hidden_layers,
                "ordered_embeddings": bool(config.use_ordered_embeddings), **tree}
