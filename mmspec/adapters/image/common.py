"""transformers' discrete-token text-to-image models behind the image-target interface.

Three families (transformers >= 5), each as a :class:`~mmspec.adapters.image_gen.GuidedImageTarget`
whose logits are over the **image codebook only** (index = VQ code id, ``vocab_size`` = codebook
size), so the core and the SJD drafters sample codes directly; the adapter maps codes to the model's
input tokens. ``mmspec.generate(target, ...)`` then returns ``sequences`` = [conditional prompt ids
(with the image-start token the adapter appends for Janus and Chameleon), generated VQ codes]; the
codes feed the family's :class:`~mmspec.adapters.image_gen.ImageTokenizer` (``image_tokenizer_for``).
With ``hidden_layer`` the targets return the last layer's hidden states (the image head's input).

========== ============================================ ==========================================
family     conditional / unconditional prompt           image tokens
========== ============================================ ==========================================
Janus      ``input_ids`` (+ the image-start token, as    generation embeddings + aligner in,
           the processor's generation mode adds); the    ``generation_head`` out (Janus'
           uncond half replaces every token but BOS and  ``generate(generation_mode="image")``)
           image-start by PAD, as Janus' ``generate``
Emu3       ``input_ids`` ending with the image prefix    text-vocabulary visual tokens
           ``<|image start|>{h}*{w}<|image token|>``     (``vocabulary_mapping``); the
           (``Emu3Processor(...,                         end-of-line token after every row is
           return_for_image_generation=True)``); uncond  inserted by the adapter
           = ``negative_input_ids`` (a negative prompt
           in the same format, as Emu3's official
           example) or by default [BOS] + the image
           prefix (the empty prompt)
Chameleon  ``input_ids`` (+ ``<racm3:break>``, the       text-vocabulary ``IMGIMG*`` tokens
(Anole)    begin-image token, as Chameleon's             (``vocabulary_mapping``)
           ``ImageDecoder`` appends); uncond =
           [BOS, begin-image], as Chameleon's
           official in-batch CFG
========== ============================================ ==========================================

Prompts of different lengths (Emu3's negative prompt, Chameleon's two-token unconditional prompt)
are left-padded to one length: the pads are masked out of every attention (a 4-D additive mask) and
each row's positions start at 0 at its first real token, which is exactly the independent
unconditional sequence of the official code (Chameleon's per-sequence attention, Emu3's unbatched
CFG). The per-row padding travels on the KV cache object (``cache.row_padding``; Emu3 also
stores ``cache.prompt_entries``), the one per-sequence object both target hooks receive.

Emu3 end-of-line tokens: Emu3's official generation forces ``<|extra_200|>`` after every row of
codes. They are deterministic, so the adapter inserts them into the model's input stream itself:
the core only ever sees codes; each code that ends a row is followed by its end-of-line token in the
same forward, the code's logits are read at the end-of-line position (the model's prediction for
the first code of the next row), positions count the end-of-line tokens, and the state
(:class:`Emu3State`) crops the cache to "committed codes + their end-of-line tokens" on commit and
rollback. Limitation: token-tree verification (``forward(tree=...)``: EAGLE-2 / Medusa-style tree
drafters) is not implemented for Emu3 (the tree would have to be re-threaded with an end-of-line
node after every row-ending node and the accepted path mapped back through them); linear drafts
work (tested with SJD).

Chameleon / Anole limitations: transformers' ``ChameleonVQVAE`` has no decoder (its checkpoint
conversion drops the VQGAN decoder weights, "we dont do image generation yet"), so
:class:`ChameleonImageTokenizer` decodes only with a :class:`ChameleonVQDecoder` (the original
VQGAN decoder; load it from Chameleon's ``tokenizer/vqgan.ckpt`` with
:meth:`ChameleonVQDecoder.from_vqgan_state_dict`). The target covers text-only prompts: Chameleon's
official CFG for prompts that contain input images uses a third, image-conditioned row
(InstructPix2Pix-style), which the two-row interface cannot express; such prompts raise
ValueError. Without input images the image-conditioned row equals the unconditional one and the
official three-row rule reduces exactly to u + g_text (c - u).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.cache import crop_cache
from .image_gen import GuidedImageTarget, GuidedState

#: the families :func:`image_target_for` / :func:`image_tokenizer_for` accept.
SUPPORTED_FAMILIES = (
    "Janus (JanusForConditionalGeneration)",
    "Emu3 (Emu3ForConditionalGeneration)",
    "Chameleon / Anole (ChameleonForConditionalGeneration)",
)

#: Emu3Processor's default generation size: ratio "1:1", image_area 518400, 8x downsampling.
EMU3_DEFAULT_GRID = (90, 90)


def _single_prompt(model_inputs: dict[str, Any], key: str = "input_ids") -> torch.Tensor:
    """model_inputs[key] [1, L] (unpadded) -> LongTensor [L]."""
    ids = model_inputs.get(key)
    if ids is None:
        raise ValueError(f"prefill needs {key}=[1, L] (the tokenized prompt)")
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"{key} must be one non-empty prompt [1, L], got shape {tuple(ids.shape)}")
    mask_key = "attention_mask" if key == "input_ids" else key.replace("input_ids", "attention_mask")
    mask = model_inputs.get(mask_key)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(f"{key} is padded ({mask_key} has zeros); pass the one prompt unpadded")
    return ids[0].long()


class TransformersImageTarget(GuidedImageTarget):
    """Shared machinery of the transformers image targets.

    A family provides ``_prompt_rows`` (conditional and unconditional prompt ids), ``_embed_ids``
    (prompt ids -> embeddings), ``embed_codes`` (VQ codes -> input embeddings), ``backbone`` (the
    decoder stack, called with ``inputs_embeds``) and ``code_logits`` (last hidden states ->
    logits over the codebook).
    """

    backbone: nn.Module

    # ---- family hooks -------------------------------------------------------------------------
    def _prompt_rows(self, model_inputs: dict[str, Any], rows: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def _embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------
    def _run(self, embeds, cache, attention_mask, position_ids, want_hidden):
        out = self.backbone(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state
        return self.code_logits(hidden), (hidden if want_hidden else None)

    def _attention_inputs(self, cache, num_tokens: int, mask: torch.Tensor | None, positions: torch.Tensor):
        """The attention mask and position ids of ``num_tokens`` inputs after the cache, with the
        rows' left padding (``cache.row_padding``) masked out and subtracted from the positions."""
        padding = getattr(cache, "row_padding", None)
        if padding is None:
            return mask, positions.view(1, -1)
        past = cache.get_seq_length()
        if mask is None:
            query = torch.arange(past, past + num_tokens, device=self.device)
            key = torch.arange(past + num_tokens, device=self.device)
            blocked = key[None, :] > query[:, None]
            mask = torch.zeros(num_tokens, past + num_tokens, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(blocked, torch.finfo(self.dtype).min).view(1, 1, num_tokens, -1)
        key = torch.arange(mask.shape[-1], device=self.device)
        pads = key[None, :] < padding[:, None]  # [rows, keys]
        mask = mask.expand(padding.shape[0], 1, num_tokens, -1)
        mask = mask.masked_fill(pads[:, None, None, :], torch.finfo(mask.dtype).min)
        return mask, (positions.view(1, -1) - padding[:, None]).clamp_min(0)

    def _prefill_halves(self, model_inputs, rows, cache, want_hidden):
        prompts = [p.to(self.device) for p in self._prompt_rows(model_inputs, rows)]
        length = max(p.shape[0] for p in prompts)
        if length > self.max_length:
            raise ValueError(f"a prompt of {length} tokens exceeds the model's {self.max_length} positions")
        padding = torch.tensor([length - p.shape[0] for p in prompts], device=self.device)
        ids = torch.stack([F.pad(p, (int(pad), 0), value=int(p[0])) for p, pad in zip(prompts, padding)])
        embeds = self._embed_ids(ids)
        if bool(padding.any()):
            cache.row_padding = padding
            visible = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
            visible = visible[None] & (torch.arange(length, device=self.device)[None, None, :] >= padding[:, None, None])
            visible |= torch.eye(length, dtype=torch.bool, device=self.device)  # pads see themselves (no empty rows)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]
            positions = (torch.arange(length, device=self.device)[None] - padding[:, None]).clamp_min(0)
        else:
            mask, positions = None, torch.arange(length, device=self.device)[None]
        logits, hidden = self._run(embeds, cache, mask, positions, want_hidden)
        return prompts[0][None], logits[:, -1:], None if hidden is None else hidden[:, -1:]

    def _forward_halves(self, tokens, cache, mask, positions, want_hidden):
        attention_mask, position_ids = self._attention_inputs(cache, tokens.shape[1], mask, positions)
        return self._run(self.embed_codes(tokens), cache, attention_mask, position_ids, want_hidden)


# ======================================================================================= Janus
class JanusImageTarget(TransformersImageTarget):
    """Janus / Janus-Pro (``JanusForConditionalGeneration``) in image-generation mode.

    model_inputs: ``input_ids`` [1, L] (the chat-formatted prompt; the image-start token is
    appended when missing, as the processor's ``generation_mode="image"`` does), ``guidance_scale``.

    Args:
        model: the model.
        boi_token_id, pad_token_id, bos_token_id: override the generation config's
            ``generation_kwargs["boi_token_id"]``, ``pad_token_id``, ``bos_token_id``.
    """

    def __init__(self, model, boi_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None) -> None:
        self.model = model
        self.config = model.config
        generation = getattr(model, "generation_config", None)
        kwargs = (getattr(generation, "generation_kwargs", None) or {}) if generation is not None else {}
        text = model.config.text_config
        self.boi_token_id = boi_token_id if boi_token_id is not None else kwargs.get("boi_token_id")
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(generation, "pad_token_id", None)
        self.bos_token_id = bos_token_id if bos_token_id is not None else getattr(generation, "bos_token_id", None)
        self.pad_token_id = self.pad_token_id if self.pad_token_id is not None else text.pad_token_id
        self.bos_token_id = self.bos_token_id if self.bos_token_id is not None else text.bos_token_id
        if self.boi_token_id is None or self.pad_token_id is None:
            raise ValueError("Janus image generation needs the image-start and pad token ids (generation_config."
                             "generation_kwargs['boi_token_id'] and generation_config.pad_token_id); pass "
                             "boi_token_id=... / pad_token_id=...")
        vq = model.config.vq_config
        self.vocab_size = vq.num_embeddings
        self.grid = (vq.num_patches, vq.num_patches)
        self.max_length = text.max_position_embeddings
        self.cache_config = text
        self.backbone = model.model.language_model

    def _prompt_rows(self, model_inputs, rows):
        cond = _single_prompt(model_inputs)
        if int(cond[-1]) != self.boi_token_id:
            cond = torch.cat([cond, cond.new_tensor([self.boi_token_id])])
        if rows == 1:
            return [cond]
        keep = (cond == self.boi_token_id) | (cond == self.bos_token_id if self.bos_token_id is not None else False)
        return [cond, torch.where(keep, cond, torch.full_like(cond, self.pad_token_id))]

    def _embed_ids(self, ids):
        return self.model.get_input_embeddings()(ids)

    def embed_codes(self, codes):
        return self.model.prepare_embeddings_for_image_generation(codes)

    def code_logits(self, hidden):
        return self.model.model.generation_head(hidden)


# ================================================================ text-vocabulary image tokens
class _VocabularyImageTarget(TransformersImageTarget):
    """Families whose image tokens are text-vocabulary ids (``vocabulary_mapping.img2bpe``)."""

    def _setup_codes(self, mapping, num_codes: int, lm_head: nn.Linear) -> None:
        img2bpe = mapping.img2bpe
        missing = [code for code in range(num_codes) if code not in img2bpe]
        if missing:
            raise ValueError(f"the vocabulary maps no token to VQ codes {missing[:5]}... of {num_codes}")
        self.code_to_id = torch.tensor([img2bpe[code] for code in range(num_codes)], dtype=torch.long)
        first = int(self.code_to_id[0])
        contiguous = torch.equal(self.code_to_id, torch.arange(first, first + num_codes))
        self._first_code_id = first if contiguous else None  # code c is token first + c
        self.lm_head = lm_head
        self.vocab_size = num_codes

    def _code_ids(self, codes: torch.Tensor) -> torch.Tensor:
        """VQ codes -> the model's token ids (same shape)."""
        if self.code_to_id.device != codes.device:
            self.code_to_id = self.code_to_id.to(codes.device)
        return self.code_to_id[codes]

    def _code_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The code tokens' rows of an output-layer tensor [vocab, ...], in code order (a view when
        the code tokens are one increasing id range, as in Chameleon's and Emu3's vocabularies)."""
        if self._first_code_id is not None:
            return tensor.narrow(0, self._first_code_id, self.vocab_size)
        return tensor.index_select(0, self._code_ids(torch.arange(self.vocab_size, device=tensor.device)))

    def embed_codes(self, codes):
        return self._embed_ids(self._code_ids(codes))

    def code_logits(self, hidden):
        logits = hidden @ self._code_rows(self.lm_head.weight).T
        return logits if self.lm_head.bias is None else logits + self._code_rows(self.lm_head.bias)


# ======================================================================================= Emu3
class Emu3State(GuidedState):
    """A guided sequence whose cache also holds Emu3's end-of-line token after every full row of
    codes: commit and rollback crop to the committed codes plus their end-of-line tokens.

    Attributes (besides :class:`~mmspec.adapters.image_gen.GuidedState`'s):
        columns: codes per row.
        prompt_entries: cache entries of the (padded) prompt.
    """

    def __init__(self, tokens, cache, prompt_length, guidance_scale, columns: int, prompt_entries: int):
        super().__init__(tokens, cache, prompt_length, guidance_scale)
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
        raise ValueError("token-tree verification is not implemented for Emu3 (see mmspec.adapters.hf_image)")

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


class Emu3ImageTarget(_VocabularyImageTarget):
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
        cond = _single_prompt(model_inputs)
        self._check_prefix(cond, "input_ids")
        if rows == 1:
            return [cond]
        if model_inputs.get("negative_input_ids") is not None:
            uncond = _single_prompt(model_inputs, "negative_input_ids")
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
                          columns=self.grid[1], prompt_entries=state.cache_length)
        state.cache.prompt_entries = state.prompt_entries
        return state, out

    def _forward_halves(self, tokens, cache, mask, positions, want_hidden):
        """Codes [rows, n] -> the input stream with an end-of-line token after every code that ends
        a row; logits [rows, n, V] at each code's last stream position."""
        if mask is not None:
            raise ValueError("token-tree verification is not implemented for Emu3: the tree would need an "
                             "end-of-line node after every row-ending node (see mmspec.adapters.hf_image)")
        columns = self.grid[1]
        past = cache.get_seq_length()
        # codes already cached: each full row is columns codes + 1 end-of-line entry
        rows_done, rest = divmod(past - cache.prompt_entries, columns + 1)
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
        attention_mask, position_ids = self._attention_inputs(cache, stream.shape[1], None, positions)
        logits, hidden = self._run(self._embed_ids(stream), cache, attention_mask, position_ids, want_hidden)
        read = torch.tensor(read, device=logits.device)
        return logits[:, read], None if hidden is None else hidden[:, read]


# ================================================================================== Chameleon
class ChameleonImageTarget(_VocabularyImageTarget):
    """Chameleon / Anole (``ChameleonForConditionalGeneration``) image generation, Anole-style:
    1024 codes (32 x 32) per 512 px image in the released checkpoints.

    model_inputs: ``input_ids`` [1, L] (BOS + text; the begin-image token ``<racm3:break>`` is
    appended when missing, as Chameleon's ``ImageDecoder`` does), ``guidance_scale`` (Chameleon's
    ``guidance_scale_text``, official default 3.0). The prompt may not contain input images (see the
    module doc).

    Args:
        model: the model.
        boi_token_id, bos_token_id: override the vocabulary's ``<racm3:break>`` / ``<s>``.
    """

    def __init__(self, model, boi_token_id: int | None = None, bos_token_id: int | None = None) -> None:
        self.model = model
        self.config = model.config
        mapping = model.model.vocabulary_mapping
        vocab = mapping.vocab_map
        self.boi_token_id = boi_token_id if boi_token_id is not None else vocab.get("<racm3:break>")
        self.bos_token_id = bos_token_id if bos_token_id is not None else vocab.get("<s>", model.config.bos_token_id)
        if self.boi_token_id is None or self.bos_token_id is None:
            raise ValueError("Chameleon's vocabulary_map lacks <racm3:break> (begin image) or <s>; pass "
                             "boi_token_id=... / bos_token_id=...")
        vq = model.config.vq_config
        self._setup_codes(mapping, vq.num_embeddings, model.lm_head)
        side = vq.resolution // 2 ** (len(vq.channel_multiplier) - 1)
        self.grid = (side, side)
        self.max_length = model.config.max_position_embeddings
        self.cache_config = model.config
        self.backbone = model.model
        image_ids = [i for i in (mapping.image_token_id,) if i is not None]
        self._input_image_ids = torch.tensor(sorted(set(mapping.image_tokens) | set(image_ids)), dtype=torch.long)

    def _embed_ids(self, ids):
        return self.model.get_input_embeddings()(ids)

    def _prompt_rows(self, model_inputs, rows):
        cond = _single_prompt(model_inputs)
        if model_inputs.get("pixel_values") is not None or bool(torch.isin(cond, self._input_image_ids).any()):
            raise ValueError("Chameleon prompts with input images need the official three-row (image-conditioned) "
                             "guidance, which this two-row target does not implement; use a text-only prompt")
        if int(cond[-1]) != self.boi_token_id:
            cond = torch.cat([cond, cond.new_tensor([self.boi_token_id])])
        if rows == 1:
            return [cond]
        return [cond, cond.new_tensor([self.bos_token_id, self.boi_token_id])]


# ================================================================================ tokenizers
class _ImageTokensEncoder:
    """``encode`` for the transformers VQ models whose ``encode`` returns ``image_tokens``."""

    vq: nn.Module

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        out = self.vq.encode(images.to(next(self.vq.parameters()).dtype))
        return out.image_tokens.view(images.shape[0], -1)


class JanusImageTokenizer(_ImageTokensEncoder):
    """:class:`~mmspec.adapters.image_gen.ImageTokenizer` over ``JanusVQVAE`` (a Janus model or its
    ``model.model.vqmodel``)."""

    def __init__(self, vq) -> None:
        self.vq = vq
        self.vocab_size = vq.config.num_embeddings
        side = vq.config.num_patches
        self.grid = (side, side)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens.long()).float()

    def codebook_embeddings(self) -> torch.Tensor:
        # Janus' decoder reads l2-normalised code vectors
        return F.normalize(self.vq.quantize.embedding.weight.detach(), dim=-1)


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


class ChameleonVQDecoder(nn.Module):
    """The decoder of Chameleon's VQGAN (taming-transformers' ``Decoder``), which transformers'
    ``ChameleonVQVAE`` omits. Module names match the original checkpoint's ``decoder.*`` keys.

    Args:
        config: the model's ``ChameleonVQVAEConfig`` (``vq_config``).
    """

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.chameleon.modeling_chameleon import (
            ChameleonVQVAEEncoderAttnBlock as AttnBlock,
            ChameleonVQVAEEncoderResnetBlock as ResnetBlock,
        )

        multipliers = tuple(config.channel_multiplier)
        levels = len(multipliers)
        attn_resolutions = config.attn_resolutions or []
        block_in = config.base_channels * multipliers[-1]
        resolution = config.resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(config.latent_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(config=config, in_channels=block_in, out_channels=block_in)
        self.mid.attn_1 = AttnBlock(block_in) if config.attn_type == "vanilla" else nn.Identity()
        self.mid.block_2 = ResnetBlock(config=config, in_channels=block_in, out_channels=block_in)
        self.up = nn.ModuleList()
        for level in reversed(range(levels)):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = config.base_channels * multipliers[level]
            for _ in range(config.num_res_blocks + 1):
                up.block.append(ResnetBlock(config=config, in_channels=block_in, out_channels=block_out))
                block_in = block_out
                if resolution in attn_resolutions:
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = nn.Module()
                up.upsample.conv = nn.Conv2d(block_in, block_in, kernel_size=3, stride=1, padding=1)
                resolution *= 2
            self.up.insert(0, up)
        self.norm_out = nn.GroupNorm(num_groups=32, num_channels=block_in, eps=1e-6, affine=True)
        self.conv_out = nn.Conv2d(block_in, config.in_channels, kernel_size=3, stride=1, padding=1)

    @classmethod
    def from_vqgan_state_dict(cls, config, state_dict: dict[str, torch.Tensor]) -> "ChameleonVQDecoder":
        """Build from the ``state_dict`` of Chameleon's ``tokenizer/vqgan.ckpt`` (its ``decoder.*`` keys)."""
        decoder = cls(config)
        decoder.load_state_dict({k[len("decoder."):]: v for k, v in state_dict.items() if k.startswith("decoder.")})
        return decoder.eval()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        hidden = self.conv_in(latents)
        hidden = self.mid.block_2(self.mid.attn_1(self.mid.block_1(hidden)))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i, block in enumerate(up.block):
                hidden = block(hidden)
                if len(up.attn):
                    hidden = up.attn[i](hidden)
            if level != 0:
                hidden = up.upsample.conv(F.interpolate(hidden, scale_factor=2.0, mode="nearest"))
        hidden = self.norm_out(hidden)
        return self.conv_out(hidden * torch.sigmoid(hidden))


class ChameleonImageTokenizer(_ImageTokensEncoder):
    """:class:`~mmspec.adapters.image_gen.ImageTokenizer` over ``ChameleonVQVAE`` plus a
    :class:`ChameleonVQDecoder` (needed by ``decode`` only; transformers ships no VQGAN decoder)."""

    def __init__(self, vq, decoder: ChameleonVQDecoder | None = None) -> None:
        self.vq = vq
        self.decoder = decoder
        self.vocab_size = vq.config.num_embeddings
        side = vq.config.resolution // 2 ** (len(vq.config.channel_multiplier) - 1)
        self.grid = (side, side)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise ValueError("transformers' ChameleonVQVAE has no decoder (its checkpoints drop the VQGAN decoder "
                             "weights); pass decoder=ChameleonVQDecoder.from_vqgan_state_dict(vq_config, "
                             "torch.load('tokenizer/vqgan.ckpt')['state_dict'])")
        quant = self.vq.quantize.embedding(tokens.long()).view(tokens.shape[0], *self.grid, -1).permute(0, 3, 1, 2)
        return self.decoder(self.vq.post_quant_conv(quant.contiguous())).float()

    def codebook_embeddings(self) -> torch.Tensor:
        return self.vq.quantize.embedding.weight.detach()


# ================================================================================== factories
def _family(model) -> str:
    from transformers import (
        ChameleonForConditionalGeneration,
        ChameleonVQVAE,
        Emu3ForConditionalGeneration,
        Emu3VQVAE,
        JanusForConditionalGeneration,
        JanusVQVAE,
    )

    for family, classes in (("janus", (JanusForConditionalGeneration, JanusVQVAE)),
                            ("emu3", (Emu3ForConditionalGeneration, Emu3VQVAE)),
                            ("chameleon", (ChameleonForConditionalGeneration, ChameleonVQVAE))):
        if isinstance(model, classes):
            return family
    raise ValueError(f"{type(model).__name__} is not a supported text-to-image model; supported: "
                     f"{', '.join(SUPPORTED_FAMILIES)}")


def image_target_for(model, **kwargs) -> GuidedImageTarget:
    """The image target of a transformers text-to-image model (keyword arguments go to the family's
    target: ``grid`` for Emu3, token-id overrides for Janus and Chameleon).

    Raises:
        ValueError: for a model outside :data:`SUPPORTED_FAMILIES`.
    """
    family = _family(model)
    if not hasattr(model, "lm_head"):  # a bare VQ model
        raise ValueError(f"{type(model).__name__} is a VQ model; build the target from the full generator "
                         f"({', '.join(SUPPORTED_FAMILIES)})")
    return {"janus": JanusImageTarget, "emu3": Emu3ImageTarget, "chameleon": ChameleonImageTarget}[family](model, **kwargs)


def image_tokenizer_for(model, **kwargs):
    """The :class:`~mmspec.adapters.image_gen.ImageTokenizer` of a transformers text-to-image model
    or of its VQ model (``grid`` for Emu3, ``decoder`` for Chameleon).

    Raises:
        ValueError: for a model outside :data:`SUPPORTED_FAMILIES`.
    """
    family = _family(model)
    vq = model.model.vqmodel if hasattr(model, "lm_head") else model
    tokenizers = {"janus": JanusImageTokenizer, "emu3": Emu3ImageTokenizer, "chameleon": ChameleonImageTokenizer}
    return tokenizers[family](vq, **kwargs)
