"""Discrete-token text-to-image models behind the core's target interface.

Two adapter interfaces:

* :class:`ImageTokenizer` — encode images to a token grid, decode a grid to images, and expose the
  codebook (for neighbour tables). Implemented by :class:`VQImageTokenizer` (mmspec's LlamaGen-style
  :class:`~mmspec.modeling.vq.VQTokenizer`) and by the transformers adapters in
  :mod:`mmspec.adapters.image` (Janus, Emu3, Chameleon VQ models).
* :class:`GuidedImageTarget` — a :class:`~mmspec.core.target.Target` over image tokens with
  classifier-free guidance: every forward runs the conditional and the unconditional sequence as
  one batch of two (one KV cache of batch 2, so :class:`~mmspec.core.cache.SequenceState` rolls both
  halves back together) and returns the guided logits u + g (c - u) [1, n, V] that every acceptance
  rule sees. Subclasses implement ``_prefill_halves`` (-> :class:`HalvesPrefill`) and
  ``_forward_halves`` (which receives the sequence's state), and expose the
  generator's own image-token embedding (``embed_codes``) and codebook head (``code_logits``), which
  feature-level drafters (:mod:`mmspec.drafters.image_eagle`) share.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from ..core.batch import BatchState
from ..core.cache import SequenceState, StaticKVCache, make_cache
from ..core.captured import DEFAULT_BUCKETS, StaticForward, fill_static_mask
from ..core.sampling import cfg_combine
from ..core.target import TargetOutput
from ..core.tree import TokenTree, tree_attention_mask, tree_position_ids


class ImageTokenizer(Protocol):
    """Attributes:
        vocab_size: number of codes V.
        grid: (rows, columns) of a generated image's token grid.
    """

    vocab_size: int
    grid: tuple[int, int]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> LongTensor [B, rows * columns] (raster order)."""

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """LongTensor [B, rows * columns] -> images [B, 3, H, W] in [-1, 1]."""

    def codebook_embeddings(self) -> torch.Tensor:
        """[V, d] the code vectors (for neighbour tables)."""


class VQImageTokenizer:
    """:class:`ImageTokenizer` over mmspec's LlamaGen-style :class:`~mmspec.modeling.vq.VQTokenizer`."""

    def __init__(self, vq) -> None:
        self.vq = vq
        self.vocab_size = vq.vocab_size
        side = vq.config.grid_size
        self.grid = (side, side)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.vq.encode(images.to(next(self.vq.parameters()).dtype)).flatten(1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens.view(tokens.shape[0], *self.grid)).float()

    def codebook_embeddings(self) -> torch.Tensor:
        return self.vq.codebook_embeddings()


class GuidedState(SequenceState):
    """A sequence with classifier-free guidance: its cache holds two rows (conditional,
    unconditional) that share ``tokens``; ``guidance_scale`` None means a single unguided row."""

    def __init__(self, tokens, cache, prompt_length, guidance_scale: float | None, position_offset: int = 0,
                 row_padding: torch.Tensor | None = None):
        super().__init__(tokens, cache, prompt_length, position_offset, row_padding)
        self.guidance_scale = guidance_scale


class HalvesPrefill(NamedTuple):
    """What a guided target's ``_prefill_halves`` returns.

    Attributes:
        tokens: LongTensor [1, P] the sequence's prompt tokens (the conditional row's).
        logits: [R, 1, V] the rows' logits at the last prompt position.
        hidden: [R, 1, D] their last hidden states, or None when not asked for.
        row_padding: LongTensor [R] left padding of each row's prompt, or None when the rows
            have equal lengths (see :class:`~mmspec.core.cache.SequenceState`).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor | None
    row_padding: torch.Tensor | None = None


class GuidedImageTarget:
    """Base of the image-token targets (see the module doc).

    ``prefill`` takes ``model_inputs`` with the model's conditioning (``caption`` features for
    LlamaGen, ``input_ids`` for the transformers families) and ``guidance_scale`` (None or >= 1;
    1 still runs both halves, None runs the conditional sequence only).
    """

    vocab_size: int
    grid: tuple[int, int]
    #: the model_inputs prefill reads (mmspec.generate refuses any other keyword)
    input_names: ClassVar[tuple[str, ...]] = ("guidance_scale",)
    #: why this family cannot decode in batches (None: it can, :meth:`forward_rows`)
    batch_size_one_reason: ClassVar[str | None] = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def image_positions(self) -> int:
        """Positions an image takes after its prompt (its codes; Emu3 adds a token a row)."""
        return self.num_image_tokens

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """LongTensor [B, n] image codes -> the generator's input embeddings [B, n, D]."""
        raise NotImplementedError

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, n, D] (the head's input) -> logits over the codebook [B, n, V]."""
        raise NotImplementedError

    def _guide(self, logits: torch.Tensor, guidance_scale: float | None) -> torch.Tensor:
        """[rows, n, V] -> [1, n, V] guided logits (float32)."""
        logits = logits.float()
        if guidance_scale is None:
            return logits[:1]
        return cfg_combine(logits[:1], logits[1:2], guidance_scale)

    def new_cache(self, rows: int):
        """The KV cache of a new sequence of ``rows`` cache rows."""
        return make_cache(self.cache_config)

    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[GuidedState, TargetOutput]:
        guidance_scale = model_inputs.get("guidance_scale")
        if guidance_scale is not None and guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (got {guidance_scale}); use None to switch guidance off")
        rows = 1 if guidance_scale is None else 2
        cache = self.new_cache(rows)
        prefill = self._prefill_halves(model_inputs, rows, cache, hidden_layer is not None)
        state = GuidedState(prefill.tokens, cache, prompt_length=prefill.tokens.shape[1], guidance_scale=guidance_scale,
                            row_padding=prefill.row_padding)
        return state, TargetOutput(self._guide(prefill.logits, guidance_scale), prefill.hidden)

    def forward(
        self, state: GuidedState, tokens: torch.Tensor, hidden_layer: int | None = None, tree: TokenTree | None = None
    ) -> TargetOutput:
        """Append image tokens [1, n] to both halves; guided logits [1, n, V] (and with ``hidden_layer``
        the last hidden states of every row, [R, n, D]: R = 2 with guidance, conditional row first).
        With ``tree`` the n tokens form a token tree (tree attention mask, positions by depth)."""
        rows = 1 if state.guidance_scale is None else 2
        prefix = state.cache_length
        if tree is None:
            mask, positions = None, torch.arange(prefix, prefix + tokens.shape[1], device=self.device)
        else:
            if prefix + tree.max_depth > self.max_length:  # positions go by depth; the cache itself grows
                raise ValueError(f"a tree of depth {tree.max_depth} after {prefix} positions exceeds the model's {self.max_length}")
            mask = tree_attention_mask(tree, prefix, dtype=self.dtype, device=self.device)
            positions = tree_position_ids(tree, prefix, device=self.device)[0]
        logits, hidden = self._forward_halves(tokens.to(self.device).expand(rows, -1), state, mask, positions,
                                              hidden_layer is not None)
        return TargetOutput(self._guide(logits, state.guidance_scale), hidden)

    def prefill_rows(self, rows: list[dict[str, Any]], hidden_layer: int | None = None) -> tuple[BatchState, list[TargetOutput]]:
        """Prefill B prompts one at a time and stack them (each sequence's R = 1 or 2 guided cache
        rows kept together): see :class:`~mmspec.core.batch.BatchState`. Every prompt must use
        the same ``guidance_scale``."""
        scales = {inputs.get("guidance_scale") for inputs in rows}
        if len(scales) > 1:
            raise ValueError(f"a batch shares one guidance_scale, got {sorted(scales, key=str)}")
        return BatchState.prefill(self, rows, hidden_layer)

    def forward_rows(self, state: BatchState, tokens: torch.Tensor, hidden_layer: int | None = None) -> TargetOutput:
        """Append image tokens [B, n] to every sequence (both guided rows); guided logits [B, n, V],
        hidden states [B R, n, D] (each sequence's rows together, conditional first)."""
        rows, n = state.rows_per_item, tokens.shape[1]
        mask = state.attention_mask(n).bool()[:, None, None, :].expand(-1, 1, n, -1).clone()
        mask[..., -n:] &= torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
        # a row whose draft is shorter than the batch's is padded; those inputs' outputs are ignored,
        # and near the end of the image their positions may pass the last one: clamp them
        positions = state.position_ids(n).clamp(max=self.max_length - 1)
        logits, hidden = self._forward_rows(tokens.to(self.device).repeat_interleave(rows, dim=0), state, mask, positions,
                                            hidden_layer is not None)
        logits = logits.view(-1, rows, n, logits.shape[-1])
        guidance_scale = state.rows[0].guidance_scale
        guided = logits[:, 0].float() if guidance_scale is None else cfg_combine(logits[:, 0].float(), logits[:, 1].float(), guidance_scale)
        return TargetOutput(guided, hidden)

    def _forward_rows(self, tokens, state, mask, positions, want_hidden):
        """One forward of every cache row of a batch: image tokens [B R, n], boolean mask
        [B R, 1, n, C + n] (True = attend), positions [B R, n] -> (logits [B R, n, V], last hidden
        states [B R, n, D] or None)."""
        raise NotImplementedError(f"{type(self).__name__} decodes one sequence at a time; use batch size 1")


class LlamaGenTarget(GuidedImageTarget):
    """mmspec's LlamaGen-style generator (:class:`~mmspec.modeling.llamagen.LlamaGenModel`).

    model_inputs: ``caption`` [1, P, C] caption features (from the generator's text encoder),
    ``guidance_scale``. The unconditional half is the model's null caption.

    Args:
        captured: verify through captured forwards (:mod:`mmspec.core.captured`): a static KV cache of
            max_length + the largest bucket slots, inputs padded to a bucket, and on CUDA one graph
            per bucket, replayed with one launch. Chains and trees alike (the tree's mask goes into
            the static mask). A captured target decodes one sequence at a time (the graphs own its
            KV buffers: a new prefill ends the previous sequence) and no batches.
        buckets: the padded forward sizes (inputs per forward) that are captured.
    """

    input_names = ("caption", "guidance_scale")

    def __init__(self, model, grid: tuple[int, int] | None = None, captured: bool = False,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        side = model.config.grid_size
        self.grid = grid or (side, side)
        self.max_length = model.max_length
        self.cache_config = None  # a plain DynamicCache of PreallocatedLayers
        self.captured, self.buckets = captured, tuple(buckets)
        self._static: dict[int, StaticForward] = {}  # per cache rows, built at first use

    def embed_codes(self, codes):
        return self.model.tok_embeddings(codes)

    def code_logits(self, hidden):
        return self.model.output(hidden).float()

    def _static_forward(self, rows: int) -> StaticForward:
        """The captured forward of ``rows`` cache rows (built at first use): its static KV cache
        holds max_length + the largest bucket slots."""
        if rows not in self._static:
            c, device = self.config, self.device
            cache = StaticKVCache(c.n_layer, (rows, c.kv_heads, self.max_length + self.buckets[-1], c.head_dim), self.dtype,
                                  device)

            def inputs(b: int) -> dict[str, torch.Tensor]:
                return {"tokens": torch.zeros(rows, b, dtype=torch.long, device=device),
                        "positions": torch.zeros(b, dtype=torch.long, device=device)}

            def forward(tokens, positions, mask):
                out = self.model(tokens, past_key_values=cache, attention_mask=mask, positions=positions,
                                 output_hidden_states=True)
                return out.logits, out.hidden_states

            self._static[rows] = StaticForward(forward, inputs, cache, self.buckets, device)
        return self._static[rows]

    def new_cache(self, rows):
        if not self.captured:
            return super().new_cache(rows)
        cache = self._static_forward(rows).cache
        cache.length, cache.owner = 0, None
        return cache

    def prefill(self, model_inputs, hidden_layer=None):
        state, out = super().prefill(model_inputs, hidden_layer)
        if self.captured:
            state.cache.owner = state  # the sequence that holds the static buffers now
        return state, out

    def prefill_rows(self, rows, hidden_layer=None):
        if self.captured:
            raise ValueError("a captured LlamaGen target decodes one image at a time; use batch_size=1 or captured=False")
        return super().prefill_rows(rows, hidden_layer)

    def _prefill_halves(self, model_inputs, rows, cache, want_hidden):
        caption = model_inputs.get("caption")
        if caption is None or caption.dim() != 3 or caption.shape[0] != 1:
            raise ValueError("LlamaGen prefill needs caption=[1, P, C] caption features (see SmolTextEncoder.encode)")
        if caption.shape[1] != self.config.cls_token_num or caption.shape[2] != self.config.caption_dim:
            raise ValueError(f"caption features must be [1, {self.config.cls_token_num}, {self.config.caption_dim}], "
                             f"got {list(caption.shape)}")
        caption = caption.to(self.device)
        if rows == 2:
            caption = torch.cat([caption, self.model.null_caption(1).to(caption)])
        mask, length = None, caption.shape[1]
        if isinstance(cache, StaticKVCache):  # eager, into the static buffers
            cache.slots = torch.arange(length, device=self.device)
            mask = torch.zeros(1, 1, length, cache.capacity, dtype=torch.bool, device=self.device)
            fill_static_mask(mask, 0, torch.ones(length, length, dtype=torch.bool, device=self.device).tril())
        out = self.model(caption=caption, past_key_values=cache, attention_mask=mask, output_hidden_states=want_hidden)
        if isinstance(cache, StaticKVCache):
            cache.length = length
        prefix = torch.zeros(1, length, dtype=torch.long, device=self.device)
        hidden = None if out.hidden_states is None else out.hidden_states[:, -1:]
        return HalvesPrefill(prefix, out.logits[:, -1:], hidden)

    def _forward_rows(self, tokens, state, mask, positions, want_hidden):
        out = self.model(tokens, past_key_values=state.cache, attention_mask=mask, positions=positions,
                         output_hidden_states=want_hidden)
        return out.logits, out.hidden_states

    def _forward_halves(self, tokens, state, mask, positions, want_hidden):
        if mask is not None:
            mask = mask > torch.finfo(mask.dtype).min / 2  # additive -> boolean (True = attend)
        if self.captured:
            return self._forward_captured(tokens, state, mask, positions, want_hidden)
        out = self.model(tokens, past_key_values=state.cache, attention_mask=mask, positions=positions,
                         output_hidden_states=want_hidden)
        return out.logits, out.hidden_states

    def _forward_captured(self, tokens, state, mask, positions, want_hidden):
        """One padded forward through the bucket's graph: tokens [R, n], boolean tree mask
        [1, 1, n, L + n] or None (a chain), positions [n] -> (logits [R, n, V], hidden [R, n, D] or None)."""
        cache = state.cache
        if getattr(cache, "owner", None) is not state:
            raise ValueError("this captured target has started another sequence since; a captured target decodes "
                             "one sequence at a time")
        rows, n = tokens.shape
        cached = cache.length
        if mask is None and cached + n > self.max_length:
            raise ValueError(f"position {cached + n - 1} beyond the model's {self.max_length} positions")
        block = None if mask is None else mask[0, 0, :, cached:]
        logits, hidden = self._static_forward(rows)(n, block, tokens=tokens, positions=positions)
        return logits, hidden if want_hidden else None
