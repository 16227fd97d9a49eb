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
from ..core.batch import BatchDrafting
from ..core.cache import SequenceState, crop_cache, layer_prefix_view
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.spec import positive_int
from ..modeling.hf_compat import cache_kwargs


@register_drafter("layer-skip")
class LayerSkipDrafter(BatchDrafting, Drafter):
    """Args:
    target_model: the target transformers model (its modules are shared, never copied).
    num_layers: N, layers run by the draft (spec ``"layer-skip:N"``).
    num_draft_tokens: K.
    """

    spec_argument = "layers"
    needs_transformers_target = True

    def __init__(self, target_model: torch.nn.Module, num_layers: int, num_draft_tokens: int = 4) -> None:
        super().__init__(num_draft_tokens)
        self.num_layers = num_layers
        self.decoder = truncated_decoder(text_decoder(target_model), num_layers)
        self.lm_head = target_model.get_output_embeddings()

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "LayerSkipDrafter":
        if not arg:
            raise ValueError('layer-skip needs the number of layers, e.g. drafter="layer-skip:8"')
        return cls(target.model, positive_int(arg, "layer-skip's layers"), num_draft_tokens or 4)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        committed = state.cache_length
        cache = layer_prefix_view(state.cache, self.num_layers)
        token = state.tokens[:, -1:]
        tokens, probs = [], []
        for _ in range(k):
            hidden = self.decoder(
                input_ids=token, **cache_kwargs(self.decoder, cache), position_ids=state.position_ids(1, start=cache.get_seq_length()), use_cache=True
            ).last_hidden_state
            logits = self.lm_head(hidden[:, -1])
            self.forwards += 1
            choice, q = self._pick(logits)
            token = choice.view(1, 1)
            tokens.append(token)
            probs.append(q)
        crop_cache(cache, committed)  # the target's first N layers are back to the committed prefix
        return Draft.chain(tokens, probs)

    @classmethod
    def propose_rows(cls, drafters: list["LayerSkipDrafter"], state, positions: list[int], budgets: list[int]) -> list[Draft]:
        """Every row of a batch drafts through the shared cache's first N layers at once
        (:func:`draft_rows_through_target_cache`): the LM head over the drafting rows, then each
        row's own pick (its generator), exactly as :meth:`propose` draws."""
        first = drafters[0]

        def next_tokens(hidden: torch.Tensor, drafting: list[int]) -> list[tuple]:
            logits = first.lm_head(hidden[[positions[i] for i in drafting], -1])  # [drafting rows, V]
            picks = []
            for row, i in enumerate(drafting):
                drafters[i].forwards += 1
                picks.append((*drafters[i]._pick(logits[row : row + 1]), False))
            return picks

        lengths = [min(d.num_draft_tokens, budget) for d, budget in zip(drafters, budgets)]
        target = first.context.target
        return draft_rows_through_target_cache(state, positions, lengths, first.num_layers, first.decoder, next_tokens,
                                               getattr(target, "row_masks", None), getattr(target, "draft_inputs", None))

    def describe(self) -> dict:
        return {**super().describe(), "num_layers": self.num_layers}


def draft_rows_through_target_cache(state, positions: list[int], lengths: list[int], num_layers: int, decoder,
                                    next_tokens, row_masks=None, draft_inputs=None) -> list[Draft]:
    """Self-speculative drafting for the rows of a batch (:class:`~mmspec.core.batch.BatchState`)
    through the target's own first ``num_layers`` cache layers: one ``decoder`` forward over [B, 1]
    per draft token with the rows' attention masks and positions, appended to those layers and
    cropped off at the end.

    Args:
        positions, lengths: the drafting rows and the most tokens each may draft.
        next_tokens: (hidden [B, 1, H], indices i into ``positions`` of the rows still drafting) ->
            for each, (token [1], its draft distribution [1, V] or None, whether the row stops here).
            Rows not drafting get their previous token again; their outputs are ignored.
        row_masks: the target's ``row_masks(state, n)`` (the 4-D masks of a model with
            sliding-window layers, whose window counts positions, not slots), or None: the 2-D
            slot mask.
        draft_inputs: the target's ``draft_inputs(cache, n)``: further inputs its shallow forwards
            take so that each row drafts what it drafts alone (Mllama: the rows' image tiles, without
            the batch's padding), or None.
    Returns:
        One Draft per row of ``positions``.
    """
    committed = state.cache.get_seq_length()
    cache = layer_prefix_view(state.cache, num_layers)
    token = torch.stack([row.tokens[0, -1:] for row in state.rows])  # [B, 1]
    picked: list[list] = [[] for _ in positions]
    drafting = list(range(len(positions)))
    for step in range(max(lengths)):
        drafting = [i for i in drafting if step < lengths[i]]
        if not drafting:
            break
        mask = state.attention_mask(step + 1) if row_masks is None else row_masks(state, step + 1)
        if isinstance(mask, dict) or mask.dim() == 4:  # the last query row: the one input of this forward
            mask = {k: m[:, :, -1:] for k, m in mask.items()} if isinstance(mask, dict) else mask[:, :, -1:]
        extra = {} if draft_inputs is None else draft_inputs(state.cache, 1)
        hidden = decoder(input_ids=token, **cache_kwargs(decoder, cache), attention_mask=mask,
                         position_ids=state.position_ids(1) + step, use_cache=True, **extra).last_hidden_state
        token = token.clone()
        stopped = set()
        for i, (choice, q, stop) in zip(drafting, next_tokens(hidden, drafting)):
            token[positions[i], 0] = choice[0]
            picked[i].append((choice.view(1, 1), q))
            if stop:
                stopped.add(i)
        drafting = [i for i in drafting if i not in stopped]
    crop_cache(cache, committed)  # the target's first layers are back to the committed slots
    return [Draft.chain(*zip(*rows)) for rows in picked]
