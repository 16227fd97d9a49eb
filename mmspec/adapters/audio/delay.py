"""Delay-pattern codec language models (MusicGen / Parler-TTS / Dia layout) as a core Target.

A delay-pattern model predicts one token per codebook at every step: step t's input is the sum of
the K codebook embeddings of step t - 1's tokens, and its K heads give K distributions
p_k(. | steps < t), k = 0..K-1, **conditionally independent given the earlier steps**. Codebook k
at step t holds audio frame t - 1 - d_k (the delay d_k: MusicGen / Parler-TTS d_k = k, Dia its
config's ``delay_pattern``, e.g. [0, 8, 9, ..., 15]), so steps t <= d_k and, for an audio of F
frames, steps t > d_k + F hold fixed tokens in codebook k (:class:`DelayPattern` says which).

The core verifies one token stream. This adapter flattens the steps codebook by codebook:
sub-token i of the stream is codebook ``i % K`` of step ``i // K`` (the prompt is step 0, the
begin frame). Under the flattened order the target's factorisation is exact:

    P(step t) = prod_k p_k(x_{t,k} | steps < t) = prod_k P(x_{t,k} | stream before it),

because p_k does not depend on the codebooks of its own step. So the stream is an ordinary
autoregressive sequence whose next-token distribution at sub-token (t, k) is p_k(. | steps < t),
and every rule of the core (speculative sampling, greedy, trees aside) keeps the joint
distribution of the frames exactly the target's. A drafted frame is thereby accepted or corrected
codebook by codebook: the first rejected codebook k is resampled from norm(max(0, p_k - q_k)), and
the rest of that step (whose distributions are already known, p_{k'}(. | steps < t)) comes from
the next verification without another model forward.

Stream ids are offset per codebook: code c of codebook k is id ``k * C + c`` (C codes per codebook),
and ``K * C`` is the pad. Each position's logits are -inf outside its codebook's range, so drafters
and rules need nothing codebook-specific, n-gram lookups match codebook by codebook, and a codebook
neighbour table (LANTERN on audio codes) is one [K * C, k] table over the stream's vocabulary.
Forced positions (the pads of the delay pattern, and Dia's delayed end codes) put all mass on one
id, so every drafter that uses the same adapter proposes them and every rule accepts them.

The model's KV cache is kept in steps; :class:`StepCache` presents it to the core in sub-tokens
(``get_seq_length`` / ``crop``), so the core's :class:`~mmspec.core.cache.SequenceState`, its
commit / rollback and the draft-model drafter work unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache

from ...core.batch import BatchState
from ...core.cache import SequenceState, compact_cache, crop_cache, make_cache, stack_caches
from ...core.target import TargetOutput
from ...core.tree import TokenTree, tree_attention_mask
from ...modeling.codec_lm import CodecLMSteps
from ...modeling.hf_compat import cache_kwargs
from .dia import DiaSteps


class StepModel(Protocol):
    """A delay-pattern LM, one step at a time (per family: :class:`MusicgenSteps`,
    :class:`~mmspec.adapters.audio.dia.DiaSteps`, :class:`~mmspec.modeling.codec_lm.CodecLMSteps`).

    Attributes:
        num_codebooks: K.
        codebook_size: outputs per head (codes, and the end code if any).
        pad_token_id: the model's input for the pads of the delay pattern (and for the begin step
            and the pads before a codebook's first frame, unless ``begin_token_id`` says otherwise);
            may be >= codebook_size.
        end_code: None, or the code (< codebook_size) that codebook 0 emits at the step after the
            last audio frame: the audio's length is then the model's choice.

    Optional attributes (absent: the MusicGen layout):
        delays: tuple of K ints, codebook k's delay d_k (codebook k holds frame t - 1 - d_k at
            step t; d_0 = 0); absent: ``tuple(range(K))``.
        begin_token_id: the model's input for the begin step and for the pads before each
            codebook's first frame (Dia's BOS); absent: ``pad_token_id``.
        delayed_end: True (Dia): codebook 0's end code at step F + 1 is repeated in codebook k at
            step F + 1 + d_k (then pads), and ``num_frames`` F forces that end code at step F + 1
            (the length limit); absent / False: only codebook 0 holds the end code, the other
            codebooks are padded after their last frame, and ``num_frames`` just pads after F frames.
        input_names: the conditioning inputs :meth:`start` / :meth:`forward_steps` read.
    """

    num_codebooks: int
    codebook_size: int
    pad_token_id: int
    end_code: int | None

    def new_cache(self) -> Any:
        """An empty KV cache (cropped in steps)."""

    def start(self, cache: Any, conditioning: dict[str, Any]) -> int:
        """Feed what precedes the steps (a text prefix) into ``cache`` (and put what the steps
        need, e.g. encoder states, into ``conditioning``); return its cache entries."""

    def forward_steps(self, steps: torch.Tensor, cache: Any, conditioning: dict[str, Any],
                      want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """steps LongTensor [n, K] (the model's input ids, appended after the cache) -> logits
        [n, K, codebook_size] of the following steps, and the last hidden states [n, D] when
        ``want_hidden``."""

    # optional, for batched decoding (absent: the target decodes one sequence at a time):
    # forward_step_rows(steps [B, n, K], first_steps, cache, conditionings, want_hidden, attention_mask,
    #                   position_ids) -> (logits [B, n, K, codebook_size], hidden [B, n, D] or None)


class MusicgenSteps:
    """transformers' ``MusicgenForCausalLM`` (the MusicGen / Parler-TTS decoder), conditioned by
    ``encoder_hidden_states`` [1, T, D] (text encoder output, already projected to the decoder's
    width) through cross-attention."""

    def __init__(self, model) -> None:
        config = model.config
        if getattr(config, "audio_channels", 1) != 1:
            raise ValueError("stereo MusicGen (audio_channels=2) is not supported; use a mono checkpoint")
        self.model = model
        self.num_codebooks = config.num_codebooks
        self.codebook_size = config.vocab_size
        self.pad_token_id = model.generation_config.decoder_start_token_id
        if self.pad_token_id is None:
            self.pad_token_id = config.pad_token_id
        self.end_code = None  # MusicGen generates a fixed number of frames
        self.input_names = ("encoder_hidden_states", "encoder_attention_mask")

    #: (its decoder takes no position_ids: a row's positions would follow the shared cache's slots)
    batch_size_one_reason = "numbers positions by cache slot (its decoder takes no position ids)"

    def new_cache(self):
        return EncoderDecoderCache(make_cache(self.model.config), DynamicCache(config=self.model.config))

    def start(self, cache, conditioning) -> int:
        return 0  # the conditioning enters through cross-attention

    def forward_steps(self, steps, cache, conditioning, want_hidden):
        out = self.model(input_ids=steps.T.contiguous(), **cache_kwargs(self.model, cache), use_cache=True,
                         encoder_hidden_states=conditioning.get("encoder_hidden_states"),
                         encoder_attention_mask=conditioning.get("encoder_attention_mask"),
                         output_hidden_states=want_hidden)
        logits = out.logits.view(self.num_codebooks, steps.shape[0], -1).transpose(0, 1)  # [n, K, V]
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return logits, hidden


@dataclass(frozen=True)
class DelayPattern:
    """What each position of a delay-pattern stream holds: the one place that decides it.

    Step t >= 1 holds, in codebook k, audio frame t - 1 - d_k (``first_step(k) = 1 + d_k``); an
    audio of F frames ends, when the model has an end code, with that code in codebook 0 at step
    F + 1 (and with ``delayed_end``, in codebook k at step F + 1 + d_k). Every other position of the
    audio's steps is a pad; the stream is over after :meth:`last_step`.

    Attributes:
        delays: (d_0, ..., d_{K-1}), non-negative, d_0 = 0.
        end_code: the model's end code, or None.
        delayed_end: see :class:`StepModel`.
    """

    delays: tuple[int, ...]
    end_code: int | None = None
    delayed_end: bool = False

    def __post_init__(self) -> None:
        if (not self.delays or self.delays[0] != 0
                or any(isinstance(d, bool) or int(d) != d or d < 0 for d in self.delays)):
            raise ValueError(f"delays must be non-negative integers, the first 0 (codebook 0 undelayed); "
                             f"got {self.delays}")
        if self.delayed_end and self.end_code is None:
            raise ValueError("delayed_end needs an end code")

    def first_step(self, codebook: int) -> int:
        """The step of codebook ``codebook``'s first frame."""
        return 1 + self.delays[codebook]

    def last_step(self, frames: int, ended: bool) -> int:
        """The last step holding anything but pads for an audio of ``frames`` frames, its end
        code(s) included when ``ended``."""
        last = frames + max(self.delays)
        if ended:
            last = max(last, frames + 1 + (max(self.delays) if self.delayed_end else 0))
        return last

    def kind(self, step: int, codebook: int, frames: int | None, ended: bool) -> str:
        """What (``step``, ``codebook``) holds: "free" (a frame's code, sampled; on codebook 0 the
        model's end code may be), "pad", "end" (forced: the end code) or "stop" (the stream is over).

        Args:
            frames: the audio's frame count F, or None while the model may still end it.
            ended: F is marked by the end code (emitted by the model, or forced by the length
                limit with ``delayed_end``); False with an F from ``num_frames`` otherwise.
        """
        first = self.first_step(codebook)
        if frames is None:
            return "free" if step >= first else "pad"
        if (ended or self.end_code is None) and step > self.last_step(frames, ended):
            return "stop"
        if first <= step < first + frames:
            return "free"
        if ended and step == first + frames and (codebook == 0 or self.delayed_end):
            return "end"
        return "pad"


class StepCache:
    """The model's step cache seen by the core as a cache of sub-tokens, with what else one
    generation's steps depend on.

    Attributes:
        model_cache: the model's KV cache: ``prefix_length`` entries, then one per step fed.
        pattern: the :class:`DelayPattern` (K = ``len(pattern.delays)`` codebooks).
        num_frames: F, the audio frames of this generation (with ``pattern.delayed_end``, at
            most F: the end code is forced after them), or None when the model ends the audio
            itself (codebook 0's end code, :attr:`end_index`).
        conditioning: the model's conditioning inputs (e.g. ``encoder_hidden_states``).
        stream: LongTensor [n] the sub-tokens consumed (what a token cache would hold).
        end_index: the stream index of the end code in codebook 0, or None.
        step_logits: step_logits[t] [K, C] the distributions of step t, computed when step t - 1
            was fed (index 0 unused); valid for t <= :attr:`steps_cached`.
        step_hidden: the matching last hidden states [D] (None unless a drafter asked for them).
    """

    def __init__(self, model_cache: Any, pattern: DelayPattern, num_frames: int | None, conditioning: dict[str, Any],
                 prefix_length: int = 0) -> None:
        self.model_cache = model_cache
        self.pattern = pattern
        self.num_codebooks = len(pattern.delays)
        self.num_frames = num_frames
        self.conditioning = conditioning
        self.prefix_length = prefix_length
        self.end_id = pattern.end_code  # codebook 0's stream id of the end code (its offset is 0)
        self.end_index: int | None = None
        self.stream = torch.empty(0, dtype=torch.long)
        self.step_logits: list[torch.Tensor | None] = [None]
        self.step_hidden: list[torch.Tensor | None] = [None]

    @property
    def steps_cached(self) -> int:
        return self.model_cache.get_seq_length() - self.prefix_length

    def get_seq_length(self) -> int:
        return self.stream.shape[0]

    def append(self, tokens: torch.Tensor) -> None:
        """Consume sub-tokens [n] (noting the first end code on codebook 0)."""
        start = self.stream.shape[0]
        self.stream = torch.cat([self.stream.to(tokens.device), tokens])
        if self.end_id is not None and self.end_index is None:
            ends = ((tokens == self.end_id).nonzero().flatten() + start).tolist()
            self.end_index = next((i for i in ends if i % self.num_codebooks == 0), None)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` sub-tokens; the model cache keeps only the steps
        still complete, and with them the step distributions they produced."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        self.stream = self.stream[: self.stream.shape[0] + tokens_to_remove]
        if self.end_index is not None and self.end_index >= self.stream.shape[0]:
            self.end_index = None
        complete = self.stream.shape[0] // self.num_codebooks
        if self.steps_cached > complete:
            crop_cache(self.model_cache, self.prefix_length + complete)
        del self.step_logits[self.steps_cached + 1 :]
        del self.step_hidden[self.steps_cached + 1 :]

    def compact_tree(self, start: int, indices: torch.Tensor) -> None:
        """Keep sub-tokens [0, start) and then ``start + indices`` (a tree forward's accepted path,
        :meth:`~mmspec.core.cache.SequenceState.compact`), with their model-cache entries and step
        distributions, as a chain over the path would have left them. Single-stream (K = 1) only:
        there every sub-token is a step, so a tree node is one model-cache entry."""
        if self.num_codebooks != 1:
            raise ValueError("only a single-stream (one codebook) step cache holds token trees")
        indices = indices.to(torch.long)
        kept = self.stream[start + indices.to(self.stream.device)]
        compact_cache(self.model_cache, self.prefix_length + start, indices)
        for table in (self.step_logits, self.step_hidden):  # table[t]: what step t - 1 predicted
            table[start + 1 :] = [table[start + 1 + int(i)] for i in indices]
        self.stream, end_index = self.stream[:start], self.end_index
        self.end_index = end_index if end_index is not None and end_index < start else None
        self.append(kept)

    def position(self, index: int, end_index: int | None | bool = False) -> str:
        """What stream position ``index`` (step index // K, codebook index % K) holds, from the
        sub-tokens before it (:meth:`DelayPattern.kind`): "free", "pad", "end" or "stop".
        ``end_index``: the stream index of codebook 0's end code on a tree path, or None (no end
        code), in place of the stream's own (False)."""
        step, codebook = divmod(index, self.num_codebooks)
        end_index = self.end_index if end_index is False else end_index
        if end_index is not None and end_index < index:
            frames, ended = end_index // self.num_codebooks - 1, True
        elif self.num_frames is not None:
            frames, ended = self.num_frames, self.pattern.delayed_end
        else:
            frames, ended = None, False
        return self.pattern.kind(step, codebook, frames, ended)


class _RowSteps:
    """One row's share of a batch's model cache, as its :class:`StepCache` sees it: the entries
    it holds (its prefix and the steps fed). Cropping it releases the row's last slots
    (:meth:`DelayBatchState.release`)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        self.length = self.length + max_length if max_length < 0 else min(self.length, max_length)


class DelayBatchState(BatchState):
    """A batch of delay-pattern generations (:meth:`DelayPatternTarget.prefill_rows`).

    Each row keeps its :class:`StepCache` (``rows[b].cache``: its stream, step distributions and
    delay-pattern positions, read by the step drafters) whose model cache is a :class:`_RowSteps`
    count; the model's KV cache holds one slot per fed step (and the prefix), shared by the rows,
    ``valid`` marking each row's. A row whose stream is cropped gives back its last steps' slots.
    """

    @classmethod
    def stack(cls, states: Sequence[SequenceState], device: torch.device) -> "DelayBatchState":
        cache, valid = stack_caches([s.cache.model_cache for s in states])
        rows = []
        for s in states:
            row = copy.copy(s)
            row.cache = copy.copy(s.cache)
            row.cache.model_cache = _RowSteps(s.cache.model_cache.get_seq_length())
            rows.append(row)
        return cls(rows, cache, valid.to(device))

    def release(self) -> None:
        """Keep, of each row's valid slots, only the first it still holds (after its stream was cropped)."""
        held = torch.tensor([row.cache.model_cache.length for row in self.rows], device=self.valid.device)
        self.valid &= self.valid.cumsum(dim=1) <= held[:, None]

    def commit(self, committed: Sequence[torch.Tensor]) -> None:
        """After :meth:`DelayPatternTarget.forward_rows` appended n sub-tokens to every row: keep
        the first m_b (the pending token and the accepted drafts) of row b's, and their steps."""
        for row, tokens in zip(self.rows, committed):
            row.cache.crop(row.tokens.shape[1] - 1 + tokens.shape[1] - row.cache.get_seq_length())
            row.tokens = torch.cat([row.tokens, tokens.to(row.tokens)], dim=1)
        self.release()
        self._squeeze()


class DelayPatternTarget:
    """A delay-pattern codec LM as the core's :class:`~mmspec.core.target.Target` (module doc).

    model_inputs: ``num_frames`` (F, the audio frames to generate: the stream then holds
    :meth:`stream_length` sub-tokens after the begin step, the finished codebooks padded as
    MusicGen's ``build_delay_pattern_mask`` does; optional for a model with an end code, which then
    decides the length, F being at most a limit for Dia) and the model's conditioning (MusicGen:
    ``encoder_hidden_states`` [1, T, D], ``encoder_attention_mask`` [1, T]; the embedded codec LM:
    ``phoneme_ids`` [1, P]; Dia: ``input_ids`` [1, T], ``attention_mask``, ``guidance_scale``).

    The stream's ids: codebook k's code c is ``k * C + c`` (C = the heads' outputs), then the pad
    ``K * C`` and the stop id ``K * C + 1`` (:attr:`eos_token_ids`), emitted where the audio is over.

    Args:
        model: a ``MusicgenForCausalLM``, a ``DiaForConditionalGeneration``, an mmspec ``CodecLM``,
            or a :class:`StepModel`.
    """

    def __init__(self, model) -> None:
        self.steps = model if hasattr(model, "forward_steps") else _step_model_for(model)
        self.num_codebooks = self.steps.num_codebooks
        self.codebook_size = self.steps.codebook_size
        self.end_code = self.steps.end_code
        delays = tuple(getattr(self.steps, "delays", None) or range(self.num_codebooks))
        if len(delays) != self.num_codebooks:
            raise ValueError(f"{len(delays)} delays for {self.num_codebooks} codebooks")
        self.pattern = DelayPattern(delays, self.end_code, bool(getattr(self.steps, "delayed_end", False)))
        self.delays = delays
        self.pad_id = self.num_codebooks * self.codebook_size
        self.stop_id = self.pad_id + 1
        self.vocab_size = self.pad_id + 2
        self.eos_token_ids = [self.stop_id]
        self._offsets = torch.arange(self.num_codebooks) * self.codebook_size
        self.input_names = ("num_frames", *getattr(self.steps, "input_names", ()))

    @property
    def model(self):
        return getattr(self.steps, "model", self.steps)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def stream_ids(self, codes: torch.Tensor) -> torch.Tensor:
        """Audio codes [K, F] -> the generated stream [:meth:`stream_length` (F)] (delayed, offset,
        padded; for a model with an end code, ended by it)."""
        k, frames = codes.shape
        ended = self.end_code is not None
        ids = []
        for step in range(1, self.pattern.last_step(frames, ended) + 1):
            for c in range(k):
                kind = self.pattern.kind(step, c, frames, ended)
                if kind == "free":
                    ids.append(int(codes[c, step - self.pattern.first_step(c)]) + c * self.codebook_size)
                else:
                    ids.append(c * self.codebook_size + self.end_code if kind == "end" else self.pad_id)
        return torch.tensor(ids, dtype=torch.long, device=codes.device)

    def stream_length(self, num_frames: int) -> int:
        """Generated sub-tokens for an audio of ``num_frames`` frames (its end code included, for a
        model with one): the steps up to :meth:`DelayPattern.last_step`, K sub-tokens each (the
        stop id follows when the model has an end code)."""
        return self.pattern.last_step(num_frames, self.end_code is not None) * self.num_codebooks

    # ---- the core's Target ---------------------------------------------------------------------
    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[SequenceState, TargetOutput]:
        num_frames = model_inputs.get("num_frames")
        if num_frames is None and self.end_code is None:
            raise ValueError(f"{type(self.model).__name__} does not end the audio itself: pass num_frames, a positive "
                             "integer (audio frames to generate)")
        if num_frames is not None and (isinstance(num_frames, bool) or int(num_frames) != num_frames or num_frames < 1):
            raise ValueError(f"num_frames must be a positive integer (audio frames to generate), got {num_frames!r}")
        if hidden_layer not in (None, -1):
            raise ValueError("delay-pattern targets give the last hidden states only (hidden_layer=-1)")
        conditioning = {name: value.to(self.device) if isinstance(value, torch.Tensor) else value
                        for name, value in model_inputs.items() if name != "num_frames" and value is not None}
        model_cache = self.steps.new_cache()
        prefix = self.steps.start(model_cache, conditioning)
        cache = StepCache(model_cache, self.pattern, None if num_frames is None else int(num_frames), conditioning,
                          prefix_length=prefix)
        begin = torch.full((1, self.num_codebooks), self.pad_id, dtype=torch.long, device=self.device)
        state = SequenceState(begin, cache, prompt_length=self.num_codebooks)
        self._consume(cache, begin[0], hidden_layer is not None)
        logits, hidden = self._next_distributions(cache, [self.num_codebooks], hidden_layer is not None)
        return state, TargetOutput(logits[None], None if hidden is None else hidden[None])

    def forward(self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None,
                tree: TokenTree | None = None) -> TargetOutput:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"tokens must be [1, n], got {tuple(tokens.shape)}")
        if tree is not None:
            return self._forward_tree(state, tokens[0].to(self.device), tree, hidden_layer is not None)
        cache, want_hidden = state.cache, hidden_layer is not None
        start = cache.get_seq_length()
        fed = self._consume(cache, tokens[0].to(self.device), want_hidden)
        logits, hidden = self._next_distributions(cache, range(start + 1, start + tokens.shape[1] + 1), want_hidden, fed)
        return TargetOutput(logits[None], None if hidden is None else hidden[None])

    @property
    def supports_trees(self) -> bool:
        """Token trees verify only on a single stream (K = 1: a VALL-E-style AR stage), where a node
        is a whole step, and through a step model that takes tree masks (``forward_step_rows``)."""
        return self.num_codebooks == 1 and hasattr(self.steps, "forward_step_rows")

    def _forward_tree(self, state: SequenceState, tokens: torch.Tensor, tree: TokenTree, want_hidden: bool) -> TargetOutput:
        """A tree forward over [pending, node_0 .. node_{N-1}] (``tree`` rooted at the pending
        token): node j at depth d_j (the root 0) is step ``start + d_j``, fed at that step's
        position and alignment, attending to the cache and its ancestors; every node is appended
        (the core's commit compacts the accepted path, :meth:`StepCache.compact_tree`). Logits
        [1, N + 1, V]: node j's next position, its path's end code (if any) deciding what it holds."""
        if not self.supports_trees:
            raise ValueError("token trees are not supported on delay-pattern targets of several codebooks: a tree node "
                             "would have to carry a partial step; use a chain drafter (trees need a single-stream LM, "
                             "e.g. a VALL-E-style voice)")
        if tree.size != tokens.shape[0]:
            raise ValueError(f"tree has {tree.size} nodes for {tokens.shape[0]} input tokens")
        cache = state.cache
        start = cache.get_seq_length()  # the root's stream index (= its step: K = 1)
        depth = (tree.depth - 1).to(self.device)  # the root 0
        cache.stream = torch.cat([cache.stream.to(tokens.device), tokens])  # (end codes on a branch: per node, below)
        steps = self.model_ids(tokens[:, None], first_step=start)  # (K = 1: the root's step is >= 1)
        index = start + depth
        dtype = next(self.model.parameters()).dtype
        mask = tree_attention_mask(tree, cache.model_cache.get_seq_length(), dtype=dtype, device=self.device)
        logits, hidden = self.steps.forward_step_rows(steps[None], [start], cache.model_cache, [cache.conditioning], want_hidden,
                                                      attention_mask=mask, position_ids=(cache.prefix_length + index)[None],
                                                      step_index=index[None])
        self._record(cache, logits[0], hidden[0] if want_hidden else None)
        ends: list[int | None] = []  # per node: the stream index of an end code on its path, itself included
        for j, parent in enumerate(tree.parents.tolist()):
            end = cache.end_index if parent < 0 else ends[parent]
            if end is None and int(tokens[j]) == self.pattern.end_code:
                end = start + int(depth[j])
            ends.append(end)
        depths = depth.tolist()
        rows = self._constrain([cache.position(start + depths[j] + 1, ends[j]) for j in range(tree.size)],
                               torch.stack(cache.step_logits[start + 1 : start + 1 + tree.size])[:, 0], [0] * tree.size)
        return TargetOutput(rows[None], hidden if want_hidden else None)

    @property
    def batch_size_one_reason(self) -> str | None:
        """Why this target cannot decode a batch (the step model's reason), or None: the step model
        runs rows together (``forward_step_rows``)."""
        if hasattr(self.steps, "forward_step_rows"):
            return None
        reason = getattr(self.steps, "batch_size_one_reason", "has no forward_step_rows")
        return f"over {type(self.model).__name__}, which {reason}"

    def prefill_rows(self, rows: Sequence[dict[str, Any]], hidden_layer: int | None = None) -> tuple[DelayBatchState, list[TargetOutput]]:
        """Prefill B generations (each as :meth:`prefill` takes its inputs) one at a time and stack
        them (:class:`DelayBatchState`); each row's TargetOutput."""
        return DelayBatchState.prefill(self, rows, hidden_layer)

    def forward_rows(self, state: DelayBatchState, tokens: torch.Tensor, hidden_layer: int | None = None) -> TargetOutput:
        """Append sub-tokens [B, n] to every row's stream; logits [B, n, V] (hidden [B, n, D]).

        Row b's newly completed steps (s_b of them, from 0 to n / K + 1) run in one model forward
        over [B, max s_b, K], each row attending to its own valid slots at its own positions; the
        padding steps of shorter rows are never valid.
        """
        k, want_hidden = self.num_codebooks, hidden_layer is not None
        starts = [row.cache.get_seq_length() for row in state.rows]
        firsts, steps = zip(*(self._append(row.cache, row_tokens) for row, row_tokens in zip(state.rows, tokens.to(self.device))))
        counts = torch.tensor([s.shape[0] for s in steps], device=state.valid.device)
        width = int(counts.max())
        if width:
            padded = torch.stack([torch.cat([s, s.new_full((width - s.shape[0], k), self.steps.pad_token_id)]) for s in steps])
            logits, hidden = self.steps.forward_step_rows(
                padded, list(firsts), state.cache, [row.cache.conditioning for row in state.rows], want_hidden,
                attention_mask=state.attention_mask(width), position_ids=state.position_ids(width))
            state.valid = torch.cat([state.valid, torch.arange(width, device=counts.device)[None, :] < counts[:, None]], dim=1)
            for b, (row, count) in enumerate(zip(state.rows, counts.tolist())):
                row.cache.model_cache.length += count
                self._record(row.cache, logits[b, :count], hidden[b, :count] if want_hidden else None)
        n = tokens.shape[1]
        rows = [self._next_distributions(row.cache, range(start + 1, start + n + 1), want_hidden)
                for row, start in zip(state.rows, starts)]
        logits = torch.stack([r[0] for r in rows])
        return TargetOutput(logits, torch.stack([r[1] for r in rows]) if want_hidden else None)

    def known_distributions(self, state: SequenceState) -> torch.Tensor:
        """Logits [n, V] of the next sub-tokens whose distributions are already known without a
        model forward: the rest of the current step (n = 0 when the next sub-token starts a step,
        whose distribution needs the pending step fed first)."""
        cache, following = state.cache, state.length  # the next sub-token's stream index
        if following % self.num_codebooks == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        end = (following // self.num_codebooks + 1) * self.num_codebooks
        # the positions' masks read the stream before them, pending token included; it does not
        # complete a step here, so appending and cropping it again feeds nothing
        cache.append(state.tokens[0, -1:].to(self.device))
        try:
            return self._next_distributions(cache, range(following, end), False)[0]
        finally:
            cache.crop(-1)

    def draft_logits(self, state: SequenceState, first_step: int, step_logits: torch.Tensor) -> torch.Tensor:
        """A drafter's guesses for whole steps -> stream logits [n * K, V]: ``step_logits`` [n, K, C]
        for steps ``first_step`` .. ``first_step + n - 1``, the delay pattern applied as the stream
        stands now (an end code among the guesses is not followed: drafts need not be exact)."""
        cache, k = state.cache, self.num_codebooks
        indices = range(first_step * k, (first_step + step_logits.shape[0]) * k)
        return self._constrain([cache.position(index) for index in indices], step_logits.reshape(-1, step_logits.shape[-1]),
                               [index % k for index in indices])

    # ---- the flattened stream -------------------------------------------------------------------
    def _append(self, cache: StepCache, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Append sub-tokens [n] to the stream -> (the index of the first step not yet fed, the
        model's input ids [s, K] of the s steps the stream now completes after it)."""
        k = self.num_codebooks
        cache.append(tokens)
        complete, fed = cache.stream.shape[0] // k, cache.steps_cached
        return fed, self.model_ids(cache.stream[fed * k : complete * k].view(-1, k), first_step=fed)

    @staticmethod
    def _record(cache: StepCache, logits: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """Keep the distributions [s, K, C] (and hidden states [s, D]) the fed steps predicted;
        returns them as kept (float32 [s, K, C])."""
        logits = logits.float()
        cache.step_logits.extend(logits.unbind(0))
        cache.step_hidden.extend(hidden.unbind(0) if hidden is not None else [None] * logits.shape[0])
        return logits

    def _consume(self, cache: StepCache, tokens: torch.Tensor, want_hidden: bool) -> torch.Tensor | None:
        """Append sub-tokens [n] to the stream and feed the model every step they complete ->
        those steps' distributions as :meth:`_record` keeps them (None when no step completed)."""
        _, steps = self._append(cache, tokens)
        if not steps.shape[0]:
            return None
        return self._record(cache, *self.steps.forward_steps(steps, cache.model_cache, cache.conditioning, want_hidden))

    def _next_distributions(self, cache: StepCache, indices, want_hidden: bool, fed: torch.Tensor | None = None):
        """Logits [n, V] of the stream's sub-tokens at ``indices`` (each in a step already
        predicted), delay pattern applied; the hidden states [n, D] that predicted them. ``fed``:
        the distributions the last :meth:`_consume` kept (a single stream whose ``indices`` are
        exactly those steps reads them as they are, without restacking the kept rows)."""
        k = self.num_codebooks
        indices = list(indices)
        steps = [index // k for index in indices]
        codebooks = [index % k for index in indices]
        last = len(cache.step_logits)
        if k == 1 and fed is not None and fed.shape[0] == len(steps) and steps == list(range(last - len(steps), last)):
            stacked = fed[:, 0]
        else:
            stacked = torch.stack([cache.step_logits[step][codebook] for step, codebook in zip(steps, codebooks)])
        rows = self._constrain([cache.position(index) for index in indices], stacked, codebooks)
        if not want_hidden:
            return rows, None
        hidden = [cache.step_hidden[step] for step in steps]
        if any(h is None for h in hidden):
            raise ValueError("hidden states were asked for after steps fed without them; ask from the prefill on")
        return rows, torch.stack(hidden)

    def _constrain(self, positions: list[str], logits: torch.Tensor, codebooks: list[int]) -> torch.Tensor:
        """The heads' logits [n, C] of n stream positions -> [n, V]: row r in its codebook's range
        at a free position (-inf elsewhere, and on the end code except in codebook 0); all mass on
        one id otherwise: the pad, the codebook's end code ("end") or the stop id. ``positions``:
        each row's :meth:`StepCache.position`; ``codebooks``: each row's codebook."""
        n, size = len(positions), self.codebook_size
        out = torch.full((n, self.vocab_size), -torch.inf, dtype=torch.float32, device=logits.device)
        if not n:
            return out
        free = [r for r, position in enumerate(positions) if position == "free"]
        if len(free) == n and min(codebooks) == max(codebooks):  # one codebook: one slice
            out[:, codebooks[0] * size : (codebooks[0] + 1) * size] = logits
        elif free:
            rows = torch.tensor(free, device=logits.device)
            columns = torch.tensor([codebooks[r] * size for r in free], device=logits.device)[:, None]
            out[rows[:, None], columns + torch.arange(size, device=logits.device)] = logits[rows].to(out.dtype)
        if self.end_code is not None:
            ended = [r for r in free if codebooks[r] > 0]  # only codebook 0 ends the audio
            if ended:
                out[ended, [codebooks[r] * size + self.end_code for r in ended]] = -torch.inf
        forced = [r for r, position in enumerate(positions) if position != "free"]
        if forced:
            ids = [self.pad_id if positions[r] == "pad" else self.stop_id if positions[r] == "stop"
                   else codebooks[r] * size + self.end_code for r in forced]  # "end": the codebook's end code
            out[forced, ids] = 0.0
        return out

    def model_ids(self, steps: torch.Tensor, first_step: int = 0) -> torch.Tensor:
        """Stream ids [n, K] of steps ``first_step`` .. ``first_step + n - 1`` -> the model's input
        ids [n, K]: codes (end codes included), and for the stream's pad and any id outside its
        codebook's range the model's begin token up to the codebook's delay (step t <= d_k) and
        its pad after (a draft such id can only be rejected, since the target gives it
        probability 0, so what follows it is never used)."""
        codes = steps - self._offsets.to(steps.device)
        valid = (codes >= 0) & (codes < self.codebook_size)
        if first_step > max(self.delays):  # past every codebook's delay: the filler is the pad
            return torch.where(valid, codes, self.steps.pad_token_id)
        step = torch.arange(first_step, first_step + steps.shape[0], device=steps.device)[:, None]
        before = step <= torch.tensor(self.delays, device=steps.device)
        filler = torch.where(before, getattr(self.steps, "begin_token_id", self.steps.pad_token_id),
                             self.steps.pad_token_id)
        return torch.where(valid, codes, filler)

    def codes(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """The generated stream [S * K] (or [1, S * K]) -> audio codes [K, F]: the delay and the
        codebook offsets undone, up to the end code or the last frame every codebook holds (a
        stream cut by the token budget), whichever comes first, and no stop."""
        k = self.num_codebooks
        stream = new_tokens.flatten()
        stream = stream[: stream.shape[0] // k * k]
        steps = stream.view(-1, k) - self._offsets.to(stream.device)  # row r: step r + 1
        frames = steps.shape[0] - max(self.delays)  # the frames every codebook holds
        if self.end_code is not None:
            ends = (steps[:, 0] == self.end_code).nonzero()
            if len(ends):  # a stream cut short by the token budget may end before its delayed codebooks do
                frames = min(frames, int(ends[0]))
        if frames < 0:
            raise ValueError(f"a stream of {steps.shape[0]} steps holds no complete frame (delays {list(self.delays)})")
        return torch.stack([steps[d : d + frames, c] for c, d in enumerate(self.delays)])  # [K, 0]: ended at once


#: model class name -> its StepModel
STEP_MODELS = {"MusicgenForCausalLM": MusicgenSteps, "DiaForConditionalGeneration": DiaSteps, "CodecLM": CodecLMSteps}


def _step_model_for(model) -> StepModel:
    family = STEP_MODELS.get(type(model).__name__)
    if family is None:
        raise ValueError(f"{type(model).__name__} is not a supported delay-pattern codec LM; supported: "
                         f"{', '.join(STEP_MODELS)} (or pass a StepModel)")
    return family(model)
