"""The embedded voice's codec language model: a decoder-only delay-pattern LM over phonemes then
audio codes (the Parler-TTS / MusicGen step layout, with the text as a prefix instead of
cross-attention, as in VALL-E).

Sequence: [P phoneme ids, a separator] then audio steps t = 0, 1, ... . Step 0 is the begin step
(every codebook holds the pad); step t >= 1 holds, in codebook k, the code of audio frame t - k - 1
(the delay), the pad where that frame does not exist, and in codebook 0 the end code at the step
after the last frame. A step's input embedding is the sum of its K codebook embeddings; K heads
on the last hidden state give the next step's K distributions over ``codebook_size + 1`` outputs
(the codes and the end code; only head 0 is trained on the end code).

The backbone is transformers' ``LlamaModel`` (RMSNorm, rotary positions, SwiGLU) driven by
``inputs_embeds``, so its KV cache is a transformers ``Cache`` the core rolls back.
:class:`CodecLMSteps` is its :class:`~mmspec.adapters.audio.delay.StepModel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .persistence import DataclassModel


@dataclass
class CodecLMConfig:
    text_vocab: int = 256
    num_codebooks: int = 8
    codebook_size: int = 256
    dim: int = 256
    layers: int = 6
    heads: int = 4
    ffn: int = 768
    max_positions: int = 1024

    @property
    def end_code(self) -> int:
        return self.codebook_size

    @property
    def pad_code(self) -> int:
        return self.codebook_size + 1

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=1, hidden_size=self.dim, intermediate_size=self.ffn, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.heads,
                           max_position_embeddings=self.max_positions, rms_norm_eps=1e-5, attn_implementation="sdpa",
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)


class CodecLM(DataclassModel, nn.Module):
    """forward(embeds [B, n, D], past_key_values, attention_mask, position_ids) -> (logits
    [B, n, K, C + 1], last hidden [B, n, D]); :meth:`embed_text`, :meth:`embed_steps` build the
    inputs."""

    config_class = CodecLMConfig
    config_file = "codec_lm.json"
    weights_file = "codec_lm.safetensors"
    kind = "codec LM"
    save_dtype = torch.bfloat16
    load_dtype = torch.float32

    def __init__(self, config: CodecLMConfig) -> None:
        super().__init__(config)
        from transformers import LlamaModel

        self.text_embeddings = nn.Embedding(config.text_vocab + 1, config.dim)  # + the separator
        self.code_embeddings = nn.ModuleList(nn.Embedding(config.codebook_size + 2, config.dim)  # codes, end, pad
                                             for _ in range(config.num_codebooks))
        self.backbone = LlamaModel(config.llama_config())
        self.backbone.embed_tokens = None  # inputs come as embeddings
        self.heads = nn.Linear(config.dim, config.num_codebooks * (config.codebook_size + 1), bias=False)

    @property
    def separator(self) -> int:
        return self.config.text_vocab

    def embed_text(self, phonemes: torch.Tensor) -> torch.Tensor:
        """Phoneme ids [B, P] -> [B, P + 1, D] (the separator appended)."""
        sep = torch.full_like(phonemes[:, :1], self.separator)
        return self.text_embeddings(torch.cat([phonemes, sep], dim=1))

    def embed_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """Steps [B, n, K] (codes, end code, pad code) -> summed embeddings [B, n, D]."""
        return sum(table(steps[..., k]) for k, table in enumerate(self.code_embeddings))

    def forward(self, embeds, past_key_values=None, attention_mask=None, position_ids=None):
        out = self.backbone(inputs_embeds=embeds, past_key_values=past_key_values, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=past_key_values is not None)
        hidden = out.last_hidden_state
        c = self.config
        return self.heads(hidden).view(*hidden.shape[:2], c.num_codebooks, c.codebook_size + 1), hidden

    def loss(self, phonemes: torch.Tensor, text_mask: torch.Tensor, steps: torch.Tensor, step_mask: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
        """Teacher-forced cross-entropy.

        Args:
            phonemes: [B, P] left-padded phoneme ids; text_mask [B, P] (1 = real).
            steps: [B, S, K] input steps (begin step first); step_mask [B, S] (1 = real).
            targets: [B, S, K] the next step's codes, -100 where nothing is predicted (pads of the
                delay pattern, padding).
        """
        embeds = torch.cat([self.embed_text(phonemes), self.embed_steps(steps)], dim=1)
        mask = torch.cat([text_mask, torch.ones_like(text_mask[:, :1]), step_mask], dim=1)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        logits, _ = self(embeds, attention_mask=mask, position_ids=positions)
        logits = logits[:, phonemes.shape[1] + 1 :]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


def delayed_steps(codes: torch.Tensor, config: CodecLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Audio codes [K, F] -> (input steps [S, K], targets [S, K]) for training, S = F + K.

    Inputs: the begin step, then steps 1 .. F + K - 1 (codebook k = frame t - k - 1 or the pad;
    codebook 0 holds the end code at step F + 1). Targets: row t = step t + 1's codes, -100 on pads.
    """
    k, frames = codes.shape
    total = frames + k  # steps 0 .. F + K - 1
    steps = torch.full((total + 1, k), config.pad_code, dtype=torch.long)
    for c in range(k):
        steps[1 + c : 1 + c + frames, c] = codes[c]
    steps[frames + 1, 0] = config.end_code
    targets = steps[1:].clone()
    targets[targets == config.pad_code] = -100
    return steps[:-1], targets


class CodecLMSteps:
    """:class:`CodecLM` as a delay-pattern :class:`~mmspec.adapters.audio.delay.StepModel`: the
    phoneme prefix is fed once at the start, then steps."""

    def __init__(self, model: CodecLM) -> None:
        self.model = model
        config = model.config
        self.num_codebooks = config.num_codebooks
        self.codebook_size = config.codebook_size + 1  # the heads' outputs: codes and the end code
        self.pad_token_id = config.pad_code
        self.end_code = config.end_code
        self.input_names = ("phoneme_ids",)

    def new_cache(self):
        from ..core.cache import make_cache

        return make_cache(self.model.backbone.config)

    def start(self, cache, conditioning) -> int:
        phonemes = conditioning.get("phoneme_ids")
        if phonemes is None or phonemes.dim() != 2 or phonemes.shape[0] != 1 or phonemes.shape[1] == 0:
            raise ValueError("the codec LM needs phoneme_ids [1, P] (the voice's phonemizer output)")
        if int(phonemes.max()) >= self.model.config.text_vocab or int(phonemes.min()) < 0:
            raise ValueError(f"phoneme_ids must lie in [0, {self.model.config.text_vocab})")
        embeds = self.model.embed_text(phonemes)
        self.model(embeds, past_key_values=cache)
        return embeds.shape[1]

    def forward_steps(self, steps, cache, conditioning, want_hidden):
        logits, hidden = self.model(self.model.embed_steps(steps[None]), past_key_values=cache)
        return logits[0], hidden[0] if want_hidden else None
