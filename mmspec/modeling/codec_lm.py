"""The embedded voice's codec language model: a decoder-only delay-pattern LM over phonemes then
audio codes (the Parler-TTS / MusicGen step layout, with the text as a prefix instead of
cross-attention, as in VALL-E).

Sequence: [P phoneme ids, a separator] then audio steps t = 0, 1, ... . Step 0 is the begin step
(every codebook holds the pad); step t >= 1 holds, in codebook k, the code of audio frame t - k - 1
(the delay), the pad where that frame does not exist, and in codebook 0 the end code at the step
after the last frame. A step's input embedding is the sum of its K codebook embeddings; K heads
on the last hidden state give the next step's K distributions over ``codebook_size + 1`` outputs
(the codes and the end code; only head 0 is trained on the end code).

An **aligned** codec LM (``aligned=True``, the embedded voice) also knows when each phoneme is said,
as FastSpeech-style TTS does: a duration predictor (:class:`DurationPredictor`) gives each phoneme
its frames, and step t's input adds the embeddings of the phoneme at audio frame t (the frame whose
codebook 0 step t predicts), of the phoneme two frames ahead, and of the frames already spent in and
still left for the current phoneme (:func:`frame_alignment`). The codes stay autoregressive; only
*where in the text* each frame is becomes given instead of learnt from attention, which a small LM
on a few hours of speech does not learn reliably (the unaligned embedded voice stayed unintelligible
after an hour of training: docs/speech.md). The durations are an input of the generation
(``durations`` [1, P] frames per phoneme id), shared by the target and its draft, so they are fixed
before decoding and every speculative rule stays exact; their total F fixes the audio's length
(:func:`end_at`: codebook 0's end code is ruled out before step F + 1 and certain there).

The backbone is transformers' ``LlamaModel`` (RMSNorm, rotary positions, SwiGLU) driven by
``inputs_embeds``, so its KV cache is a transformers ``Cache`` the core rolls back.
:class:`CodecLMSteps` is its :class:`~mmspec.adapters.audio.delay.StepModel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fast_linear import FewRowLinear
from .hf_compat import cache_kwargs
from .lean import lean_forward, lean_supported, padding_mask_4d
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
    aligned: bool = False

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


TIMING_BUCKETS = 8  # frames spent in / left for the current phoneme, clipped


def frame_alignment(phonemes: torch.Tensor, durations: torch.Tensor, steps: torch.Tensor, end_id: int) -> torch.Tensor:
    """The alignment inputs of steps ``steps`` [n] (step t: audio frame t) -> LongTensor [n, 4]:
    (phoneme id at frame t, phoneme id at frame t + 2, frames spent in the current phoneme,
    TIMING_BUCKETS + frames left after t in it), clipped to TIMING_BUCKETS - 1. Past the last
    frame the phoneme ids are ``end_id`` (the separator) and the timings 0.

    Args:
        phonemes: [P] ids; durations: [P] frames per phoneme (non-negative; zero skips it).
    """
    ends = durations.cumsum(0)
    last = phonemes.shape[0]
    ids = torch.cat([phonemes, phonemes.new_tensor([end_id])])
    bounds = torch.cat([ends, ends.new_tensor([int(ends[-1]) if last else 0])])
    current = torch.searchsorted(ends, steps, right=True)  # P past the end
    ahead = torch.searchsorted(ends, steps + 2, right=True)
    inside = current < last
    spent = torch.where(inside, steps - (bounds[current] - torch.cat([durations, durations.new_zeros(1)])[current]), 0)
    left = torch.where(inside, bounds[current] - steps - 1, 0)
    top = TIMING_BUCKETS - 1
    return torch.stack([ids[current], ids[ahead], spent.clamp(0, top), left.clamp(0, top) + TIMING_BUCKETS], dim=-1)


class AlignmentInputs:
    """The embeddings of :func:`frame_alignment` rows, for an ``nn.Module`` (mix in before it): the
    phoneme at the frame, the phoneme two frames ahead (each over ``text_vocab`` ids + the end) and
    the two timing buckets; :meth:`embed_alignment` sums them."""

    def add_alignment_inputs(self, text_vocab: int, dim: int) -> None:
        self.align_phoneme = nn.Embedding(text_vocab + 1, dim)  # + the end (separator)
        self.align_ahead = nn.Embedding(text_vocab + 1, dim)
        self.align_timing = nn.Embedding(2 * TIMING_BUCKETS, dim)

    def embed_alignment(self, features: torch.Tensor) -> torch.Tensor:
        """:func:`frame_alignment` rows [B, n, 4] -> [B, n, D]."""
        return (self.align_phoneme(features[..., 0]) + self.align_ahead(features[..., 1])
                + self.align_timing(features[..., 2]) + self.align_timing(features[..., 3]))


class DurationPredictor(nn.Module):
    """FastSpeech 2's variance predictor: phoneme ids [B, P] (mask [B, P]) -> log(1 + frames) [B, P]
    (two conv1d(kernel 3) + ReLU + LayerNorm + dropout blocks, then a linear)."""

    def __init__(self, vocab: int, dim: int, kernel: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList(nn.Conv1d(dim, dim, kernel, padding=kernel // 2) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dim, 1)

    def forward(self, phonemes: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        keep = torch.ones_like(phonemes, dtype=torch.float32) if mask is None else mask.float()
        x = self.embeddings(phonemes) * keep[..., None]
        for conv, norm in zip(self.convs, self.norms):
            x = self.dropout(norm(torch.relu(conv(x.transpose(1, 2)).transpose(1, 2)))) * keep[..., None]
        return self.out(x)[..., 0]


class CodecLM(DataclassModel, AlignmentInputs, nn.Module):
    """forward(embeds [B, n, D], past_key_values, attention_mask, position_ids) -> (logits
    [B, n, K, C + 1], last hidden [B, n, D]); :meth:`embed_text`, :meth:`embed_steps` build the
    inputs."""

    config_class = CodecLMConfig
    config_file = "codec_lm.json"
    weights_file = "codec_lm.safetensors"
    kind = "codec LM"
    save_dtype = torch.bfloat16
    load_dtype = torch.float32
    #: the backbone runs through :func:`~mmspec.modeling.lean.lean_forward` where it applies
    #: (equal outputs, less framework work per step); False: transformers' forward
    lean = True

    def __init__(self, config: CodecLMConfig) -> None:
        super().__init__(config)
        from transformers import LlamaModel

        self.text_embeddings = nn.Embedding(config.text_vocab + 1, config.dim)  # + the separator
        self.code_embeddings = nn.ModuleList(nn.Embedding(config.codebook_size + 2, config.dim)  # codes, end, pad
                                             for _ in range(config.num_codebooks))
        self.backbone = LlamaModel(config.llama_config())
        self.backbone.embed_tokens = None  # inputs come as embeddings
        self.heads = nn.Linear(config.dim, config.num_codebooks * (config.codebook_size + 1), bias=False)
        if config.aligned:
            self.durations = DurationPredictor(config.text_vocab, config.dim)
            self.add_alignment_inputs(config.text_vocab, config.dim)

    @property
    def separator(self) -> int:
        return self.config.text_vocab

    def cast_steps(self, dtype: torch.dtype) -> "CodecLM":
        """The step model (embeddings, backbone, heads) in ``dtype``, in place; the duration
        predictor stays float32, so a sentence's frame count is the same in every dtype."""
        self.to(dtype)
        if self.config.aligned:
            self.durations.float()
        return self

    @torch.no_grad()
    def predict_durations(self, phonemes: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """Phoneme ids [1, P] -> frames per phoneme LongTensor [1, P] (``speed`` > 1 speaks faster),
        rounded on the running sum so the total is the rounded total."""
        if not self.config.aligned:
            raise ValueError("this codec LM is not aligned: it has no duration predictor")
        frames = torch.expm1(self.durations(phonemes).float()).clamp_min(0) / speed
        ends = frames.cumsum(-1).round().long()
        return torch.diff(ends, dim=-1, prepend=ends.new_zeros(ends.shape[0], 1))

    def embed_text(self, phonemes: torch.Tensor) -> torch.Tensor:
        """Phoneme ids [B, P] -> [B, P + 1, D] (the separator appended)."""
        sep = torch.full_like(phonemes[:, :1], self.separator)
        return self.text_embeddings(torch.cat([phonemes, sep], dim=1))

    def embed_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """Steps [B, n, K] (codes, end code, pad code) -> summed embeddings [B, n, D] (in codebook order)."""
        embeds = self.code_embeddings[0](steps[..., 0])
        for k in range(1, len(self.code_embeddings)):
            embeds = embeds + self.code_embeddings[k](steps[..., k])
        return embeds

    def step_embeddings(self, steps: torch.Tensor, alignment: torch.Tensor | None = None) -> torch.Tensor:
        """The LM's inputs of steps [B, n, K] (and, for an aligned model, their :func:`frame_alignment`
        rows [B, n, 4]) -> [B, n, D]."""
        embeds = self.embed_steps(steps)
        return embeds + self.embed_alignment(alignment) if self.config.aligned else embeds

    def forward(self, embeds, past_key_values=None, attention_mask=None, position_ids=None):
        """embeds [B, n, D] after ``past_key_values`` -> (logits [B, n, K, C + 1], hidden [B, n, D]).
        ``attention_mask``: None (causal after the cache), a batch's 2-D padding mask [B, L], or a
        4-D one [B or 1, 1, n, L]. The lean forward runs where it applies; in batched decoding (a
        cache; the new inputs are always valid slots) a 2-D mask is made 4-D for it
        (:func:`~mmspec.modeling.lean.padding_mask_4d`), so each row of a batch is computed alone and
        equals its batch-1 forward bitwise, in bf16 too. (Training's left-padded rows keep
        transformers' forward: a padding query there may see no key at all.)"""
        hidden = self.hidden_states(embeds, past_key_values, attention_mask, position_ids)
        c = self.config
        return self._heads(hidden).view(*hidden.shape[:2], c.num_codebooks, c.codebook_size + 1), hidden

    def hidden_states(self, embeds, past_key_values=None, attention_mask=None, position_ids=None) -> torch.Tensor:
        """:meth:`forward` without the heads: the last hidden states [B, n, D] (a prompt, whose
        logits nobody reads: the heads over its rows cost a GEMM, and oneDNN a new primitive for
        every new prompt length)."""
        if self.lean and past_key_values is not None and attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = padding_mask_4d(attention_mask, embeds.shape[1])
        if self.lean and lean_supported(self.backbone, attention_mask):
            return lean_forward(self.backbone, embeds, past_key_values, position_ids, attention_mask)
        return self.backbone(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=past_key_values is not None, **cache_kwargs(self.backbone, past_key_values)).last_hidden_state

    def _heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """The heads over hidden [B, n, D]. A batch of more rows than a few-row head takes runs in
        groups of whole batch entries (the kernel computes each row alone), so a batch row's logits
        are its batch-1 forward's, bitwise, instead of oneDNN's, whose sums depend on the row count."""
        batch, n = hidden.shape[:2]
        limit = self.heads.max_rows if isinstance(self.heads, FewRowLinear) else None
        if batch == 1 or limit is None or batch * n <= limit or n > limit:
            return self.heads(hidden)
        return torch.cat([self.heads(part) for part in hidden.split(max(1, limit // n))])

    def get_output_embeddings(self) -> nn.Linear:
        """The K heads as one linear [K * (C + 1), D] (what Medusa heads on this LM read through)."""
        return self.heads

    def step_logits(self, phonemes: torch.Tensor, text_mask: torch.Tensor, steps: torch.Tensor, step_mask: torch.Tensor,
                    alignment: torch.Tensor | None = None, return_hidden: bool = False):
        """Teacher-forced logits of the steps that follow ``steps`` -> [B, S, K, C + 1] (and the last
        hidden states [B, S, D] with ``return_hidden``).

        Args:
            phonemes: [B, P] left-padded phoneme ids; text_mask [B, P] (1 = real).
            steps: [B, S, K] input steps (begin step first); step_mask [B, S] (1 = real).
            alignment: [B, S, 4] :func:`frame_alignment` rows of the steps (aligned models).
        """
        embeds = torch.cat([self.embed_text(phonemes), self.step_embeddings(steps, alignment)], dim=1)
        mask = torch.cat([text_mask, torch.ones_like(text_mask[:, :1]), step_mask], dim=1)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        logits, hidden = self(embeds, attention_mask=mask, position_ids=positions)
        first = phonemes.shape[1] + 1
        return (logits[:, first:], hidden[:, first:]) if return_hidden else logits[:, first:]

    def loss(self, phonemes: torch.Tensor, text_mask: torch.Tensor, steps: torch.Tensor, step_mask: torch.Tensor,
             targets: torch.Tensor, alignment: torch.Tensor | None = None, durations: torch.Tensor | None = None,
             teacher: "CodecLM | None" = None, text_hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Teacher-forced losses: {"codes": the cross-entropy with the data's next codes, or with a
        ``teacher`` codec LM the distillation loss KL(teacher || self) per predicted code (what
        a draft for speculative sampling should minimise: its acceptance is 1 - TV), "durations":
        the duration predictor's MSE on log(1 + frames) (aligned models)}.

        Args: as :meth:`step_logits`, and targets [B, S, K] the next step's codes, -100 where
        nothing is predicted (pads of the delay pattern, padding); durations [B, P] frames per
        phoneme, aligned with ``phonemes`` (aligned models); text_hidden [B] bool: rows whose
        phonemes the steps do not attend to (prefix dropout: an aligned model then has only its
        alignment inputs; the duration predictor still reads them).
        """
        losses = {}
        if self.config.aligned:
            predicted = self.durations(phonemes, text_mask)
            error = (predicted.float() - torch.log1p(durations.float())) ** 2
            losses["durations"] = (error * text_mask).sum() / text_mask.sum()
        seen = text_mask if text_hidden is None else text_mask * (~text_hidden)[:, None]
        logits = self.step_logits(phonemes, seen, steps, step_mask, alignment).float()
        if teacher is None:
            losses["codes"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
            return losses
        with torch.no_grad():
            reference = teacher.step_logits(phonemes, text_mask, steps, step_mask, alignment).float().log_softmax(-1)
        kl = (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1)  # [B, S, K]
        valid = targets != -100
        losses["codes"] = (kl * valid).sum() / valid.sum()
        return losses


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


def end_at(logits: torch.Tensor, steps: torch.Tensor, frames: int, end_code: int) -> torch.Tensor:
    """Step logits [n, K, C + 1] of steps ``steps`` [n] with codebook 0's end code ruled out where
    it holds a frame (step <= F) and certain at step F + 1 (the aligned model's length is the
    durations' total F)."""
    logits = logits.clone()
    index = steps.tolist()
    before = [row for row, step in enumerate(index) if step <= frames]
    if len(before) == len(index):
        logits[:, 0, end_code] = -torch.inf
    elif before:
        logits[before, 0, end_code] = -torch.inf
    for row in (row for row, step in enumerate(index) if step == frames + 1):
        logits[row, 0, :end_code] = -torch.inf
        logits[row, 0, end_code + 1 :] = -torch.inf
    return logits


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
        self.input_names = ("phoneme_ids", "durations") if config.aligned else ("phoneme_ids",)
        self._tables: dict[int, tuple] = {}  # id(durations) -> (durations, alignment rows, their embeddings)

    def _table(self, conditioning: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(durations, :func:`frame_alignment` rows [F + 1, 4] of every frame of the utterance and
        the one after it, their embeddings [F + 1, D]), built once per conditioning."""
        durations = conditioning["durations"]
        entry = self._tables.get(id(durations))
        if entry is None or entry[0] is not durations:
            if len(self._tables) >= 64:  # utterances decoded earlier
                self._tables.clear()
            frames = int(durations.sum())
            table = frame_alignment(conditioning["phoneme_ids"][0], durations[0],
                                    torch.arange(frames + 1, device=durations.device), self.model.separator)
            entry = self._tables[id(durations)] = (durations, table, self.model.embed_alignment(table))
        return entry

    def num_frames(self, conditioning: dict) -> int:
        """F, the utterance's frames (its durations' total), from its table."""
        return self._table(conditioning)[1].shape[0] - 1

    def alignment_embeddings(self, conditioning: dict, index: torch.Tensor) -> torch.Tensor:
        """``model.embed_alignment`` of the :func:`frame_alignment` rows of steps ``index`` [n] under
        ``conditioning`` -> [n, D], looked up in the utterance's table of embedded rows (built once
        per conditioning; a step past the last frame has the row of the frame after it: end ids,
        zero timings)."""
        embedded = self._table(conditioning)[2]
        return embedded[index.clamp(0, embedded.shape[0] - 1)]

    def new_cache(self):
        from ..core.cache import make_cache

        return make_cache(self.model.backbone.config)

    def start(self, cache, conditioning) -> int:
        phonemes = conditioning.get("phoneme_ids")
        if phonemes is None or phonemes.dim() != 2 or phonemes.shape[0] != 1 or phonemes.shape[1] == 0:
            raise ValueError("the codec LM needs phoneme_ids [1, P] (the voice's phonemizer output)")
        if int(phonemes.max()) >= self.model.config.text_vocab or int(phonemes.min()) < 0:
            raise ValueError(f"phoneme_ids must lie in [0, {self.model.config.text_vocab})")
        if self.model.config.aligned:
            durations = conditioning.get("durations")
            if (durations is None or durations.shape != phonemes.shape or durations.dtype != torch.long
                    or int(durations.min()) < 0 or int(durations.sum()) < 1):
                raise ValueError("this aligned codec LM needs durations, a LongTensor [1, P] of non-negative frames per "
                                 "phoneme id (model.predict_durations(phoneme_ids))")
        embeds = self.model.embed_text(phonemes)
        self.model.hidden_states(embeds, past_key_values=cache)  # (the prompt's logits are not read)
        return embeds.shape[1]

    def code_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Model ids [C] of a one-codebook LM -> their step embeddings [C, D] before the alignment:
        step t's input for id c is ``code_inputs(ids)[c]`` plus row t of :meth:`alignment_table`
        (an aligned LM; the embedding alone otherwise), the one addition :meth:`step_inputs` makes."""
        if self.num_codebooks != 1:
            raise ValueError(f"code_inputs is for a one-codebook LM; this one has {self.num_codebooks} codebooks")
        return self.model.embed_steps(ids.view(1, -1, 1))[0]

    def alignment_table(self, conditioning: dict) -> torch.Tensor | None:
        """What :meth:`step_inputs` adds to the code embeddings: row min(t, F) for step t, [F + 1, D]
        (:meth:`alignment_embeddings`' table), or None for an unaligned LM."""
        return self._table(conditioning)[2] if self.model.config.aligned else None

    def forward_steps(self, steps, cache, conditioning, want_hidden):
        first = cache.get_seq_length() - conditioning["phoneme_ids"].shape[1] - 1  # the step index of steps[0]
        logits, hidden = self.forward_step_rows(steps[None], [first], cache, [conditioning], want_hidden)
        return logits[0], hidden[0] if want_hidden else None

    def step_inputs(self, steps: torch.Tensor, first_steps: list[int], conditionings: list[dict],
                    step_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM's inputs [B, n, D] of steps [B, n, K] (model ids), row b's first at step index
        ``first_steps[b]`` under ``conditionings[b]``, and those step indices [B, n] (given as
        ``step_index`` [B, n] when they do not follow each other: a token tree's nodes, by depth)."""
        batch, n = steps.shape[:2]
        if step_index is not None:
            index = step_index
        elif batch == 1:
            index = torch.arange(first_steps[0], first_steps[0] + n, device=steps.device)[None]
        else:
            index = torch.tensor(first_steps, device=steps.device)[:, None] + torch.arange(n, device=steps.device)
        embeds = self.model.embed_steps(steps)
        if self.model.config.aligned:  # (an unaligned draft of an aligned target ignores the durations)
            if batch == 1:
                embeds = embeds + self.alignment_embeddings(conditionings[0], index[0])
            else:
                embeds = embeds + torch.stack([self.alignment_embeddings(c, i) for c, i in zip(conditionings, index)])
        return embeds, index

    def forward_step_rows(self, steps, first_steps, cache, conditionings, want_hidden, attention_mask=None,
                          position_ids=None, step_index=None):
        """B rows of steps at once (batched decoding, :mod:`mmspec.core.batch`): steps [B, n, K],
        row b's first step index ``first_steps[b]`` and its ``conditionings[b]``, appended after
        ``cache`` (B rows) under a 2-D ``attention_mask`` [B, C + n] at ``position_ids`` [B, n] ->
        logits [B, n, K, codebook_size], last hidden states [B, n, D] (or None). A token tree
        (one row): a 4-D additive mask [1, 1, n, C + n] and ``step_index`` [1, n], each node's step."""
        embeds, index = self.step_inputs(steps, first_steps, conditionings, step_index)
        logits, hidden = self.model(embeds, past_key_values=cache, attention_mask=attention_mask, position_ids=position_ids)
        if self.model.config.aligned:  # the durations fix the length: the end code after the last frame, never before
            logits = torch.stack([end_at(row, i + 1, self.num_frames(c), self.end_code)
                                  for row, i, c in zip(logits, index, conditionings)])
        return logits, hidden if want_hidden else None
