"""Emu3 (``Emu3ForConditionalGeneration``, e.g. BAAI/Emu3-Gen-hf).

Conditional prompt: ``input_ids`` ending with the image prefix ``<|image start|>{h}*{w}<|image
token|>`` (``Emu3Processor(..., return_for_image_generation=True)``); unconditional: the
``negative_input_ids`` (a negative prompt in the same format, as Emu3's official example) or by
default [BOS] + the image prefix (the empty prompt). Image tokens are text-vocabulary visual tokens
(``vocabulary_mapping``).

End-of-line tokens: Emu3's official generation forces ``<|extra_200|>`` after every row of codes.
They are deterministic, so the adapter inserts them into the model's input stream itself: the core
only ever sees codes; each code that ends a row is followed by its end-of-line token in the same
forward, the code's logits are read at the end-of-line position (the model's prediction for the
first code of the next row), positions count the end-of-line tokens, and the state
(:class:`Emu3State`) crops the cache to "committed codes + their end-of-line tokens" on commit and
rollback. Limitation: token-tree verification (``forward(tree=...)``: EAGLE-2 / Medusa-style tree
drafters) is not implemented for Emu3 (the tree would have to be re-threaded with an end-of-line
node after every row-ending node and the accepted path mapped back through them); linear drafts
work (tested with SJD).
"""

from __future__ import annotations

import torch

from ...core.cache import crop_cache
from ..image_gen import GuidedState
from .common import ImageFamily, single_prompt, VocabularyImageTarget

#: Emu3Processor's default generation size: ratio "1:1", image_area 518400, 8x downsampling.
EMU3_DEFAULT_GRID = (90, 90)


class Emu3State(GuidedState):
    """A guided sequence whose cache also holds Emu3's end-of-line token after every full row of
    codes: commit and rollback crop to the committed codes plus their end-of-line tokens.

    Attributes (besides :class:`~mmspec.adapters.image_gen.GuidedState`'s):
        columns: codes per row.
        prompt_entries: cache entries of the (padded) prompt.
    """

    def __init__(self, tokens, cache, prompt_length, guidance_scale, columns: int, prompt_entries: int,
                 row_padding: torch.Tensor | None = None):
        super().__init__(tokens, cache, prompt_length, guidance_scale, row_padding=row_padding)
        self.columns = columns
        self.prompt_entries = prompt_entries

    def cache_entries(self, length: int) -> int:
        """Cache entries of a sequence of ``length`` tokens: all but the last ("pending") code, and
        one end-of-line token per full row among them."""
        cached_codes = length - self.prompt_length - 1
        if cached_codes < 0:
            return self.prompt_entries - 1
        return self.prompt_entries + cached_codes + cached_codes // self.columns

    def compact(self, path):
        raise ValueError("token-tree verification is not implemented for Emu3 (see mmspec.adapters.image.emu3)")

    def commit(self, new_tokens, path=None):
        if path is not None:
            self.compact(path)
        self.tokens = torch.cat([self.tokens, new_tokens.to(self.tokens.device)], dim=1)
        crop_cache(self.cache, self.cache_entries(self.length))

    def rollback(self, length):
        if not self.prompt_length <= length <= self.length:
            raise ValueError(f"rollback length {length} outside [{self.prompt_length}, {self.length}]")
        self.tokens = self.tokens[:, :length]
        crop_cache(self.cache, min(self.cache_length, self.cache_entries(length)))


class Emu3ImageTarget(VocabularyImageTarget):
    """Emu3 (``Emu3ForConditionalGeneration``, e.g. BAAI/Emu3-Gen-hf).

    model_inputs: ``input_ids`` [1, L] from ``Emu3Processor(text=..., return_for_image_generation=True)``
    (ending with ``<|image start|>{h}*{w}<|image token|>``), optionally ``negative_input_ids``
    [1, L'] (a negative prompt in the same format) and ``image_sizes`` (checked against ``grid``),
    ``guidance_scale``.

    Args:
        model: the model.
        grid: (rows, columns) of codes, the processor's ``image_sizes`` (default: the processor's
            default 1:1 size, :data:`EMU3_DEFAULT_GRID`).
    """

    batch_size_one_reason = "inserts an end-of-line token into the cache after every image row"

    input_names = VocabularyImageTarget.input_names + ("negative_input_ids", "negative_attention_mask", "image_sizes")

    def __init__(self, model, grid: tuple[int, int] | None = None) -> None:
        self.model = model
        self.config = model.config
        mapping = model.model.vocabulary_mapping
        vocab = mapping.vocab_map
        text = model.config.text_config
        self.eol_token_id = mapping.eol_token_id
        self.boi_token_id = vocab.get("<|image start|>")
        self.image_wrapper_token_id = vocab.get("<|image token|>")
        self.bos_token_id = text.bos_token_id
        if self.eol_token_id is None or self.image_wrapper_token_id is None:
            raise ValueError("Emu3's vocabulary_map lacks <|extra_200|> (end of line) or <|image token|>")
        self._setup_codes(mapping, model.config.vq_config.codebook_size, model.lm_head)
        self.grid = tuple(grid) if grid is not None else EMU3_DEFAULT_GRID
        self.max_length = text.max_position_embeddings
        self.cache_config = text
        self.backbone = model.model.text_model

    @property
    def image_positions(self) -> int:
        """Codes plus an end-of-line token after every row."""
        return self.grid[0] * (self.grid[1] + 1)

    def _embed_ids(self, ids):
        return self.model.get_input_embeddings()(ids)

    def _check_prefix(self, ids: torch.Tensor, key: str) -> None:
        if int(ids[-1]) != self.image_wrapper_token_id:
            raise ValueError(f"{key} must end with Emu3's image prefix <|image start|>{{h}}*{{w}}<|image token|> "
                             "(Emu3Processor(text=..., return_for_image_generation=True))")

    def _prompt_rows(self, model_inputs, rows):
        sizes = model_inputs.get("image_sizes")
        if sizes is not None and tuple(int(s) for s in torch.as_tensor(sizes).view(-1, 2)[0]) != self.grid:
            raise ValueError(f"image_sizes {torch.as_tensor(sizes).view(-1, 2)[0].tolist()} differ from the "
                             f"target's grid {list(self.grid)}; build the target with grid=(rows, columns)")
        cond = single_prompt(model_inputs)
        self._check_prefix(cond, "input_ids")
        if rows == 1:
            return [cond]
        if model_inputs.get("negative_input_ids") is not None:
            uncond = single_prompt(model_inputs, "negative_input_ids")
            self._check_prefix(uncond, "negative_input_ids")
        else:
            starts = (cond == self.boi_token_id).nonzero()
            if self.boi_token_id is None or not len(starts):
                raise ValueError("no <|image start|> in input_ids: pass negative_input_ids for the unconditional half")
            uncond = torch.cat([cond.new_tensor([self.bos_token_id]), cond[int(starts[-1]):]])
        return [cond, uncond]

    def prefill(self, model_inputs, hidden_layer=None):
        state, out = super().prefill(model_inputs, hidden_layer)
        state = Emu3State(state.tokens, state.cache, state.prompt_length, state.guidance_scale,
                          columns=self.grid[1], prompt_entries=state.cache_length, row_padding=state.row_padding)
        return state, out

    def _forward_halves(self, tokens, state, mask, positions, want_hidden):
        """Codes [rows, n] -> the input stream with an end-of-line token after every code that ends
        a row; logits [rows, n, V] at each code's last stream position."""
        if mask is not None:
            raise ValueError("token-tree verification is not implemented for Emu3: the tree would need an "
                             "end-of-line node after every row-ending node (see mmspec.adapters.image.emu3)")
        columns = self.grid[1]
        past = state.cache_length
        # codes already cached: each full row is columns codes + 1 end-of-line entry
        rows_done, rest = divmod(past - state.prompt_entries, columns + 1)
        first = rows_done * columns + rest
        ids = self._code_ids(tokens)
        eol = torch.full_like(ids[:, :1], self.eol_token_id)
        pieces, read = [], []
        for i in range(tokens.shape[1]):
            pieces.append(ids[:, i : i + 1])
            if (first + i + 1) % columns == 0:
                pieces.append(eol)
            read.append(len(pieces) - 1)  # the code's own position, or its end-of-line token's
        stream = torch.cat(pieces, dim=1)
        positions = torch.arange(past, past + stream.shape[1], device=self.device)
        attention_mask, position_ids = self._attention_inputs(state, stream.shape[1], None, positions)
        logits, hidden = self._run(self._embed_ids(stream), state.cache, attention_mask, position_ids, want_hidden)
        read = torch.tensor(read, device=logits.device)
        return logits[:, read], None if hidden is None else hidden[:, read]


class Emu3ImageTokenizer:
    """:class:`~mmspec.adapters.image_gen.ImageTokenizer` over ``Emu3VQVAE``. ``grid`` is the
    generation grid (default :data:`EMU3_DEFAULT_GRID`); ``encode`` accepts any size divisible by
    the VQ's spatial factor (8 in the released model)."""

    def __init__(self, vq, grid: tuple[int, int] | None = None) -> None:
        self.vq = vq
        self.vocab_size = vq.config.codebook_size
        self.grid = tuple(grid) if grid is not None else EMU3_DEFAULT_GRID

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        sizes = torch.tensor([list(images.shape[-2:])] * images.shape[0])
        out = self.vq.encode(images.to(next(self.vq.parameters()).dtype), sizes)
        return torch.stack(list(out.image_tokens)).flatten(1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens.long().view(tokens.shape[0], *self.grid)).float()

    def codebook_embeddings(self) -> torch.Tensor:
        return self.vq.quantize.embedding.weight.detach()


FAMILY = ImageFamily("Emu3 (Emu3ForConditionalGeneration)", ("Emu3ForConditionalGeneration", "Emu3VQVAE"),
                     Emu3ImageTarget, Emu3ImageTokenizer)
