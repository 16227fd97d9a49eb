"""transformers' Dia (``DiaForConditionalGeneration``, Nari Labs' text-to-dialogue model) as a
delay-pattern :class:`~mmspec.adapters.audio.delay.StepModel`.

Dia is an encoder-decoder: a byte-level text encoder, and a decoder over K DAC codebooks
("channels") in the delay pattern of its config (``delay_pattern``, [0, 8, 9, ..., 15] for the
released checkpoint): codebook k holds frame t - 1 - d_k at step t. What its ``generate`` does that
decides the codes (transformers' ``DiaGenerationMixin`` and its Dia logits processors), and how it is
mirrored here so that the core's rules stay exact:

- the begin step and each codebook's steps t <= d_k are fed the audio BOS (the delay mask of
  ``DiaProcessor``), whatever was sampled there: forced pads of the stream, fed as BOS
  (``begin_token_id``);
- ``DiaEOSChannelFilterLogitsProcessor``: only channel 0 may emit the EOS (the end code), no
  channel the PAD / BOS / other ids above the EOS; and channel 0's EOS is forced where it is the
  argmax and forbidden elsewhere: applied here to each step's logits (a function of those logits
  alone, so the target's distribution is exactly this filtered one);
- ``DiaEOSDelayPatternLogitsProcessor``: once channel 0 emits the EOS at step s (or at step
  ``max_length - max(delays) - 1``, the length limit), channel k is forced to the EOS at step
  s + d_k, then PAD (transformers' per-row EOS stopping criterion), and generation ends after the
  last channel's EOS: the adapter's ``delayed_end`` layout, with ``num_frames`` F the limit
  (``max_new_tokens = F + 1 + max(delays)`` in Dia's ``generate``);
- classifier-free guidance (``guidance_scale`` g > 1: ``DiaClassifierFreeGuidanceLogitsProcessor``):
  the decoder runs on a batch of two, the text and an all-zero text of the same length, and a
  step's scores are the conditional logits restricted to the top ``guidance_top_k`` ids of
  cond + g (cond - uncond) (all of them without a top-k), before the channel filter.

Sampling (mmspec's temperature, then top-k, then top-p) applies to these filtered logits, the
order of Dia's own processors up to its clamp of temperatures below 1 to 1, which mmspec does not
do. Dia's generate without ``DiaProcessor``'s delayed ``decoder_input_ids`` (it warns that it then
decodes "non-delayed") and with an audio prompt (voice cloning) are not mirrored.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from ...core.cache import make_cache
from ...modeling.hf_compat import cache_kwargs

#: transformers' GenerationConfig default for top_k, which Dia's guidance top-k falls back to
DEFAULT_TOP_K = 50


class DiaSteps:
    """``DiaForConditionalGeneration`` one decoder step at a time (module doc).

    Conditioning inputs: ``input_ids`` [1, T] (the text's bytes, ``DiaProcessor``'s input_ids),
    ``attention_mask`` [1, T] (optional), ``guidance_scale`` (optional float; not given or None:
    the model's ``generation_config.guidance_scale``; 1: no guidance), ``guidance_top_k`` (optional
    int; not given or None: ``generation_config.top_k``, else transformers' 50; 0: no top-k, which
    Dia's own processor refuses). :meth:`start` runs the encoder once and puts
    ``encoder_hidden_states`` [B, T, D], ``encoder_attention_mask`` [B, T] or None (B = 2 with
    guidance: the text, then the zero text) and ``guidance`` (g, top-k) into the conditioning.

    Attributes (the :class:`~mmspec.adapters.audio.delay.StepModel` ones): the codes are
    0 .. eos - 1 and the end code is Dia's EOS, so ``codebook_size`` = eos + 1 (the ids above, PAD
    and BOS, are never emitted); ``delays`` = ``config.delay_pattern``; ``begin_token_id`` = BOS;
    ``delayed_end`` = True.
    """

    input_names = ("input_ids", "attention_mask", "guidance_scale", "guidance_top_k")
    #: (its cross-attention caches hold each row's encoded text, of each row's own length)
    batch_size_one_reason = "attends to each row's encoded text through cross-attention caches that mmspec does not stack"

    def __init__(self, model) -> None:
        config, decoder = model.config, model.config.decoder_config
        eos, pad, bos = decoder.eos_token_id, decoder.pad_token_id, decoder.bos_token_id
        if (not isinstance(eos, int) or pad is None or bos is None or min(pad, bos) <= eos
                or max(pad, bos) >= decoder.vocab_size):
            raise ValueError(f"Dia needs one EOS id below its PAD and BOS ids, all in its vocabulary of "
                             f"{decoder.vocab_size} (its EOS filter forbids every id above the EOS); got eos={eos}, "
                             f"pad={pad}, bos={bos}")
        if config.delay_pattern[0] != 0:
            raise ValueError(f"Dia's channel 0 (the one that ends the audio) must not be delayed; delay_pattern "
                             f"{config.delay_pattern}")
        self.model = model
        self.num_codebooks = decoder.num_channels
        self.codebook_size = eos + 1
        self.end_code = eos
        self.pad_token_id = pad
        self.begin_token_id = bos
        self.delays = tuple(int(d) for d in config.delay_pattern)
        self.delayed_end = True

    def new_cache(self):
        return EncoderDecoderCache(make_cache(self.model.config), DynamicCache(config=self.model.config))

    def start(self, cache, conditioning: dict[str, Any]) -> int:
        """Encode the text (and, with guidance, the zero text) once; the decoder's cache starts empty."""
        ids, mask = conditioning.get("input_ids"), conditioning.get("attention_mask")
        vocab = self.model.config.encoder_config.vocab_size
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError("Dia needs input_ids [1, T], the text's bytes (DiaProcessor's input_ids)")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}) (Dia's text encoder vocabulary)")
        if mask is not None and tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask has shape {list(mask.shape)} but input_ids {list(ids.shape)}")
        scale, top_k = self._guidance(conditioning)
        if scale is not None:
            ids = torch.cat([ids, torch.zeros_like(ids)])  # Dia's unconditional input: the zero text
            mask = None if mask is None else mask.repeat(2, 1)
        encoder = self.model.model.encoder(input_ids=ids, attention_mask=mask)
        conditioning["encoder_hidden_states"] = encoder.last_hidden_state
        conditioning["encoder_attention_mask"] = mask
        conditioning["guidance"] = (scale, top_k)
        return 0

    def _guidance(self, conditioning: dict[str, Any]) -> tuple[float | None, int | None]:
        """(g, top-k) of this generation: g None without guidance, top-k None without a top-k."""
        generation_config = self.model.generation_config
        scale = conditioning.get("guidance_scale", generation_config.guidance_scale)
        if scale is None or scale == 1:
            return None, None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 1:
            raise ValueError(f"guidance_scale must be a number > 1 (1: no guidance), got {scale!r}")
        top_k = conditioning.get("guidance_top_k", generation_config.top_k)
        top_k = DEFAULT_TOP_K if top_k is None else top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"guidance_top_k must be a non-negative integer (0: no top-k), got {top_k!r}")
        return float(scale), int(top_k) if top_k else None

    def forward_steps(self, steps, cache, conditioning, want_hidden):
        """steps [n, K] -> Dia's filtered scores [n, K, eos + 1] (float32, as its generate
        processes them) and the conditional last hidden states [n, D]."""
        encoder = conditioning["encoder_hidden_states"]
        batch, n, k = encoder.shape[0], steps.shape[0], self.num_codebooks
        out = self.model.model.decoder(input_ids=steps[None].expand(batch, n, k), encoder_hidden_states=encoder,
                                       encoder_attention_mask=conditioning["encoder_attention_mask"],
                                       **cache_kwargs(self.model.model.decoder, cache), use_cache=True)
        hidden = out.last_hidden_state  # [B, n, D]
        logits = self.model.logits_dense(hidden).view(batch, n, k, -1).float()  # [B, n, K, vocab]
        scale, top_k = conditioning["guidance"]
        scores = logits[0] if scale is None else guided_scores(logits[0], logits[1], scale, top_k)
        return eos_channel_filter(scores, self.end_code)[..., : self.codebook_size], hidden[0] if want_hidden else None


def guided_scores(cond: torch.Tensor, uncond: torch.Tensor, scale: float, top_k: int | None) -> torch.Tensor:
    """Dia's classifier-free guidance: logits [..., V] (conditional, unconditional) -> scores
    [..., V]: cond + scale (cond - uncond), or with ``top_k`` the conditional logits on the top_k
    ids of that combination (-inf elsewhere)."""
    guided = cond + (cond - uncond) * scale
    if top_k is None:
        return guided
    top = guided.topk(min(top_k, guided.shape[-1]), dim=-1).indices
    keep = torch.zeros_like(guided, dtype=torch.bool).scatter(-1, top, True)
    return cond.masked_fill(~keep, -torch.inf)


def eos_channel_filter(scores: torch.Tensor, eos: int) -> torch.Tensor:
    """Dia's EOS rules on scores [..., K, V]: no id >= eos on channels 1.., none > eos on channel 0;
    where a channel's argmax is then the eos, only the eos remains, elsewhere the eos is removed."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    channel = torch.arange(scores.shape[-2], device=scores.device)[:, None]
    scores = scores.masked_fill((vocab > eos) | ((channel > 0) & (vocab == eos)), -torch.inf)
    ends = (scores.argmax(-1) == eos)[..., None]
    return scores.masked_fill(ends & (vocab < eos) | ~ends & (vocab == eos), -torch.inf)
