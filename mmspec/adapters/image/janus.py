"""Janus / Janus-Pro (``JanusForConditionalGeneration``) in image-generation mode.

Conditional prompt: ``input_ids`` + the image-start token (as the processor's generation mode
adds); the unconditional row replaces every token but BOS and image-start by PAD, as Janus'
``generate(generation_mode="image")``. Image tokens go in through the generation embeddings +
aligner and come out of ``generation_head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import ImageFamily, TransformersImageTarget, ImageTokensEncoder, single_prompt


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
        cond = single_prompt(model_inputs)
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


class JanusImageTokenizer(ImageTokensEncoder):
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


FAMILY = ImageFamily("Janus (JanusForConditionalGeneration)", ("JanusForConditionalGeneration", "JanusVQVAE"),
                     JanusImageTarget, JanusImageTokenizer)
