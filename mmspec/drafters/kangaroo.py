"""Kangaroo (Liu et al., 2024): self-speculative drafting from a shallow sub-network of the target
plus a small trained adapter.

The draft model is the target's embedding and first ``exit_layer`` decoder layers (shared, with
their KV cache: the committed prefix's entries are the target's own), an adapter and the target's
LM head:

    s_t = FinalNorm(Layers_{1..l}(x_{<=t}))            logits_{t+1} = LMHead(Adapter(s_{<=t}))

The adapter (one decoder layer of the target's family + norm, with its own KV cache over the
committed shallow states; the paper's adapter is attention + norms) is trained to make the shallow
states readable by the LM head (``mmspec train drafter --method kangaroo``). Drafting stops early
when the draft's top-1 probability falls below ``stop_threshold`` (the paper's dynamic draft
length), which only changes speed, never the output. The adapter is
:class:`mmspec.modeling.heads.KangarooAdapter`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..adapters.hf import final_norm, text_decoder, truncated_decoder
from ..core.batch import BatchDrafting
from ..core.cache import SequenceState, crop_cache, layer_prefix_view, make_cache
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.target import TargetOutput
from ..modeling.heads import KangarooAdapter
from ..modeling.hf_compat import cache_kwargs
from .layer_skip import draft_rows_through_target_cache
from .shipped import shipped_drafter_dir
from .vocab import DraftLMHead, load_draft_vocabulary


@register_drafter("kangaroo")
class KangarooDrafter(BatchDrafting, Drafter):
    """Args:
    target_model: the transformers target (its first ``exit_layer`` layers and LM head are used).
    adapter: a trained :class:`KangarooAdapter`.
    exit_layer: l, the shallow sub-network's depth (the adapter was trained on this layer's states).
    num_draft_tokens: K, the longest draft.
    stop_threshold: stop drafting when the draft's top-1 probability is below this.
    draft_vocabulary: token ids to draft from (:mod:`mmspec.drafters.vocab`), or None for all.
    """

    spec_argument = "path"
    needs_transformers_target = True
    saved_layouts = ((KangarooAdapter.config_file,),)
    requires_target_hidden = True

    def __init__(self, target_model: nn.Module, adapter: KangarooAdapter, exit_layer: int = 2,
                 num_draft_tokens: int = 6, stop_threshold: float = 0.4, draft_vocabulary: torch.Tensor | None = None) -> None:
        super().__init__(num_draft_tokens)
        self.adapter = adapter
        self.exit_layer = self.target_hidden_layer = exit_layer
        decoder = text_decoder(target_model)
        self.shallow = truncated_decoder(decoder, exit_layer, "Kangaroo's exit layer")  # ends with the final norm
        self.final_norm = final_norm(decoder)
        self.lm_head = DraftLMHead(target_model.get_output_embeddings(), draft_vocabulary)
        self.stop_threshold = stop_threshold
        self.cache = None
        self.states: torch.Tensor | None = None  # committed shallow states not yet in the adapter's cache

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "KangarooDrafter":
        import json
        from pathlib import Path

        path = Path(arg or shipped_drafter_dir(target.model, "kangaroo", KangarooAdapter.config_file))
        adapter = KangarooAdapter.load(path, target.model)
        exit_layer = json.loads((path / KangarooAdapter.config_file).read_text()).get("exit_layer", 2)
        return cls(target.model, adapter, exit_layer, num_draft_tokens or 6, draft_vocabulary=load_draft_vocabulary(path))

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.cache = make_cache(None)  # preallocated layers: in-place appends, fused head layers
        self.states = None

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep the committed tokens' shallow states (the target's layer-l output, normalised)."""
        new = target_output.hidden_states if self.states is None else target_output.hidden_states[:, : num_accepted + 1]
        new = self.final_norm(new)
        self.states = new if self.states is None else torch.cat([self.states, new], dim=1)

    def _adapt(self, shallow: torch.Tensor) -> torch.Tensor:
        start = self.cache.get_seq_length()
        positions = torch.arange(start, start + shallow.shape[1], device=shallow.device)[None]
        return self.adapter(shallow, self.cache, positions)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        committed = state.cache_length
        if self.states.shape[1]:
            self._adapt(self.states)  # committed shallow states enter the adapter's cache
            self.states = self.states[:, :0]
        target_cache = layer_prefix_view(state.cache, self.exit_layer)
        token = state.tokens[:, -1:]
        tokens, probs = [], []
        for _ in range(k):
            shallow = self.shallow(input_ids=token, **cache_kwargs(self.shallow, target_cache), use_cache=True,
                                   position_ids=state.position_ids(1, start=target_cache.get_seq_length())).last_hidden_state
            logits = self.lm_head(self._adapt(shallow)[:, -1])
            self.forwards += 1
            choice, q = self.lm_head.pick(self, logits)
            token = choice.view(1, 1)
            tokens.append(token)
            probs.append(q)
            if torch.softmax(logits.float(), -1).max() < self.stop_threshold:
                break
        crop_cache(target_cache, committed)  # the target's first layers are back to the committed prefix
        crop_cache(self.cache, committed)
        return Draft.chain(tokens, probs)

    @classmethod
    def propose_rows(cls, drafters: list["KangarooDrafter"], state, positions: list[int], budgets: list[int]) -> list[Draft]:
        """Every row of a batch drafts at once: one shallow forward over [B, 1] per draft token
        through the shared cache's first l layers (:func:`draft_rows_through_target_cache`), then
        each drafting row's own adapter (its own cache), LM head and generator, exactly as
        :meth:`propose`; a row stops at its budget or when its top-1 probability is below ``stop_threshold``."""
        for d in drafters:
            if d.states.shape[1]:
                d._adapt(d.states)  # committed shallow states enter each row's adapter cache
                d.states = d.states[:, :0]

        def next_tokens(shallow: torch.Tensor, drafting: list[int]) -> list[tuple]:
            picks = []
            for i in drafting:
                d = drafters[i]
                logits = d.lm_head(d._adapt(shallow[positions[i] : positions[i] + 1])[:, -1])
                d.forwards += 1
                picks.append((*d.lm_head.pick(d, logits), bool(torch.softmax(logits.float(), -1).max() < d.stop_threshold)))
            return picks

        lengths = [min(d.num_draft_tokens, budget) for d, budget in zip(drafters, budgets)]
        target = drafters[0].context.target
        drafts = draft_rows_through_target_cache(state, positions, lengths, drafters[0].exit_layer, drafters[0].shallow,
                                                 next_tokens, getattr(target, "row_masks", None),
                                                 getattr(target, "draft_inputs", None))
        for d, p in zip(drafters, positions):
            crop_cache(d.cache, state.rows[p].length - 1)  # each adapter cache back to its row's committed states
        return drafts

    def describe(self) -> dict:
        return {**super().describe(), "exit_layer": self.exit_layer, "stop_threshold": self.stop_threshold,
                "draft_vocabulary": self.lm_head.size}
