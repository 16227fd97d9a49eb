"""Layer skip (self-speculative; Draft&Verify, LayerSkip): the target's first N layers draft.

The draft is the target's embedding, its first N decoder layers, its final norm and its LM head.
It shares the target's KV cache for the committed prefix: those N layers' keys and values are
exactly what the draft would compute, so it reads them from the target's cache (a view of the
first N layer objects) and crops its own appends before the target verifies.

Untrained early exit is a weak drafter (the intermediate hidden state is not trained to be read
by the LM head); the trained adapter of Kangaroo fixes that.
"""

from __future__ import annotations

import torch

from ..adapters.hf import text_decoder, truncated_decoder
from ..core.cache import SequenceState, crop_cache, layer_prefix_view
from ..core.drafter import Draft, Drafter, register_drafter


@register_drafter("layer-skip")
class LayerSkipDrafter(Drafter):
    """Args:
    target_model: the target transformers model (its modules are shared, never copied).
    num_layers: N, layers run by the draft (spec ``"layer-skip:N"``).
    num_draft_tokens: K.
    """

    def __init__(self, target_model: torch.nn.Module, num_layers: int, num_draft_tokens: int = 4) -> None:
        super().__init__(num_draft_tokens)
        self.num_layers = num_layers
        self.decoder = truncated_decoder(text_decoder(target_model), num_layers)
        self.lm_head = target_model.get_output_embeddings()

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "LayerSkipDrafter":
        if not arg:
            raise ValueError('layer-skip needs the number of layers, e.g. drafter="layer-skip:8"')
        return cls(target.model, int(arg), num_draft_tokens or 4)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        committed = state.cache_length
        cache = layer_prefix_view(state.cache, self.num_layers)
        token = state.tokens[:, -1:]
        tokens, probs = [], []
        for _ in range(k):
            hidden = self.decoder(
                input_ids=token, past_key_values=cache, position_ids=state.position_ids(1, start=cache.get_seq_length()), use_cache=True
            ).last_hidden_state
            logits = self.lm_head(hidden[:, -1])
            self.forwards += 1
            choice, q = self._pick(logits)
            token = choice.view(1, 1)
            tokens.append(token)
            probs.append(q)
        crop_cache(cache, committed)  # the target's first N layers are back to the committed prefix
        return Draft(
            tokens=torch.cat(tokens, dim=1),
            probs=torch.stack(probs, dim=1) if probs[0] is not None else None,
        )

    @classmethod
    def propose_rows(cls, drafters: list["LayerSkipDrafter"], state, positions: list[int], budgets: list[int]) -> list[Draft]:
        """Every row of a batch drafts through the shared cache's first N layers at once: one
        truncated forward over [B, 1] per draft token (the rows' attention masks and positions as
        in verification); row ``positions[i]`` takes ``min(K, budgets[i])`` tokens, drawn with its
        own generator exactly as :meth:`propose` draws them, and the others' outputs are ignored."""
        first = drafters[0]
        lengths = {p: min(d.num_draft_tokens, budget) for d, p, budget in zip(drafters, positions, budgets)}
        committed = state.cache.get_seq_length()
        cache = layer_prefix_view(state.cache, first.num_layers)
        token = torch.stack([row.tokens[0, -1:] for row in state.rows])  # [B, 1]
        picked: dict[int, list] = {p: [] for p in positions}
        for step in range(max(lengths.values())):
            mask = state.attention_mask(step + 1)
            hidden = first.decoder(input_ids=token, past_key_values=cache, attention_mask=mask,
                                   position_ids=state.position_ids(1) + step, use_cache=True).last_hidden_state
            logits = first.lm_head(hidden[:, -1])  # [B, V]
            token = token.clone()
            for d, p in zip(drafters, positions):
                if step < lengths[p]:
                    d.forwards += 1
                    choice, q = d._pick(logits[p : p + 1])
                    token[p, 0] = choice[0]
                    picked[p].append((choice.view(1, 1), q))
        crop_cache(cache, committed)  # the target's first N layers are back to the committed slots
        return [Draft(tokens=torch.cat([t for t, _ in picked[p]], dim=1),
                      probs=torch.stack([q for _, q in picked[p]], dim=1) if picked[p][0][1] is not None else None)
                for p in positions]

    def describe(self) -> dict:
        return {**super().describe(), "num_layers": self.num_layers}
