"""Shared machinery of the transformers text-to-image targets (:mod:`mmspec.adapters.image`).

Prompts of different lengths (Emu3's negative prompt, Chameleon's two-token unconditional prompt)
are left-padded to one length: the pads are masked out of every attention (a 4-D additive mask) and
each row's positions start at 0 at its first real token, which is exactly the independent
unconditional sequence of the official code (Chameleon's per-sequence attention, Emu3's unbatched
CFG). The per-row padding is part of the sequence's state
(:attr:`mmspec.core.cache.SequenceState.row_padding`, set at prefill), which every forward receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...modeling.hf_compat import cache_kwargs
from ..image_gen import GuidedImageTarget, HalvesPrefill


@dataclass(frozen=True)
class ImageFamily:
    """A transformers text-to-image family: how its models are recognised and what serves them.

    Attributes:
        description: the family's name and model class, for messages.
        model_classes: names of transformers' classes of the family (the generator, its VQ model).
        target: its :class:`~mmspec.adapters.image_gen.GuidedImageTarget` class (built from the
            generator).
        tokenizer: its :class:`~mmspec.adapters.image_gen.ImageTokenizer` class (built from the VQ model).
    """

    description: str
    model_classes: tuple[str, ...]
    target: type
    tokenizer: type

    def matches(self, model) -> bool:
        import transformers

        return isinstance(model, tuple(getattr(transformers, name) for name in self.model_classes))


def single_prompt(model_inputs: dict[str, Any], key: str = "input_ids") -> torch.Tensor:
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
    input_names = ("input_ids", "attention_mask", "guidance_scale")

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
                            **cache_kwargs(self.backbone, cache), use_cache=True)
        hidden = out.last_hidden_state
        return self.code_logits(hidden), (hidden if want_hidden else None)

    def _attention_inputs(self, state, num_tokens: int, mask: torch.Tensor | None, positions: torch.Tensor):
        """The attention mask and position ids of ``num_tokens`` inputs after ``state``'s cache, with
        the rows' left padding (``state.row_padding``) masked out and subtracted from the positions."""
        padding = state.row_padding
        if padding is None:
            return mask, positions.view(1, -1)
        past = state.cache_length
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
        if self.image_positions >= self.max_length:  # (no prompt could fit: "shorten the prompt to at most 0 tokens")
            raise ValueError(f"the image's {self.image_positions} positions ({' x '.join(map(str, self.grid))} codes) leave no room for a "
                             f"prompt in the model's {self.max_length}: generate a smaller image (a target built with a "
                             f"smaller grid=(rows, columns), where the family takes one: Emu3)")
        if length + self.image_positions > self.max_length:
            raise ValueError(f"a prompt of {length} tokens and the image's {self.image_positions} positions exceed the "
                             f"model's {self.max_length}: shorten the prompt to at most "
                             f"{max(self.max_length - self.image_positions, 0)} tokens")
        padding = torch.tensor([length - p.shape[0] for p in prompts], device=self.device)
        ids = torch.stack([F.pad(p, (int(pad), 0), value=int(p[0])) for p, pad in zip(prompts, padding)])
        embeds = self._embed_ids(ids)
        if bool(padding.any()):
            visible = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
            visible = visible[None] & (torch.arange(length, device=self.device)[None, None, :] >= padding[:, None, None])
            visible |= torch.eye(length, dtype=torch.bool, device=self.device)  # pads see themselves (no empty rows)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]
            positions = (torch.arange(length, device=self.device)[None] - padding[:, None]).clamp_min(0)
        else:
            mask, positions = None, torch.arange(length, device=self.device)[None]
        logits, hidden = self._run(embeds, cache, mask, positions, want_hidden)
        return HalvesPrefill(prompts[0][None], logits[:, -1:], None if hidden is None else hidden[:, -1:],
                             padding if bool(padding.any()) else None)

    def _forward_halves(self, tokens, state, mask, positions, want_hidden):
        attention_mask, position_ids = self._attention_inputs(state, tokens.shape[1], mask, positions)
        return self._run(self.embed_codes(tokens), state.cache, attention_mask, position_ids, want_hidden)

    def _forward_rows(self, tokens, state, mask, positions, want_hidden):
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(~mask, torch.finfo(self.dtype).min)
        return self._run(self.embed_codes(tokens), state.cache, additive, positions, want_hidden)


class VocabularyImageTarget(TransformersImageTarget):
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


class ImageTokensEncoder:
    """``encode`` for the transformers VQ models whose ``encode`` returns ``image_tokens``."""

    vq: nn.Module

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        out = self.vq.encode(images.to(next(self.vq.parameters()).dtype))
        return out.image_tokens.view(images.shape[0], -1)
