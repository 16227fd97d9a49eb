"""Bark's two autoregressive stages (transformers' ``BarkSemanticModel`` and ``BarkCoarseModel``) as
core Targets, so that every lossless drafter speeds them up with Bark's own output distribution.

Bark turns text into speech in three token stages: the *semantic* GPT maps text to semantic tokens,
the *coarse* GPT maps semantic tokens to the first two EnCodec codebooks (interleaved in one
stream), and the non-autoregressive *fine* model fills in the other codebooks. The two GPTs are
ordinary causal LMs once Bark's input construction and logits processors are reproduced, which is
what these targets do:

:class:`BarkSemanticTarget` (``BarkSemanticModel.generate``)
    The prompt is Bark's 257 input embeddings: embed(text ids + ``text_encoding_offset``, pads
    (``attention_mask`` = 0) replaced by ``text_pad_token``, truncated / padded to
    ``max_input_semantic_length``) + embed(speaker semantic history, its last
    ``max_input_semantic_length`` tokens padded with ``semantic_pad_token``), then
    embed(``semantic_infer_token``). Every returned logit row has Bark's suppression applied as
    -inf (only the ``semantic_vocab_size`` semantic tokens and the EOS ``semantic_pad_token`` stay
    allowed) and, with ``min_eos_p``, Bark's EOS prioritiser (when softmax(allowed logits)[EOS] >
    min_eos_p, everything but EOS is -inf). Temperature / top-k / top-p come after, in the core,
    as transformers' generate applies its warpers after custom processors. Generation stops after
    EOS (kept, as Bark returns it). Token trees are supported (Bark's attention adds a 4-D mask).

:class:`BarkCoarseTarget` (``BarkCoarseModel.generate``)
    Bark generates N = round(floor(#semantic tokens * ratio / 2) * 2) coarse tokens (ratio =
    coarse_rate_hz / semantic_rate_hz * 2) in windows of ``sliding_window_len`` tokens; window w
    re-encodes its own prompt: the semantic tokens from ``base + round(w * W / ratio) -
    max_semantic_history`` (at least 0), truncated / padded to ``max_coarse_input_length`` with
    ``coarse_semantic_pad_token``, ``coarse_infer_token``, and the last ``max_coarse_history``
    coarse tokens (speaker history + everything generated so far). The next-token distribution at
    stream index p is therefore a deterministic function of the tokens before p (window
    floor(p / W)'s prompt is built from tokens < floor(p / W) * W), i.e. an ordinary
    autoregressive distribution, so speculation across window boundaries is **exact**: a forward
    whose tokens cross a boundary prefills the next window's prompt (made of the committed and
    drafted tokens) and continues in its KV cache. :class:`CoarseWindowCache` holds the windows'
    KV caches behind the core's cache interface, so :class:`~mmspec.core.cache.SequenceState`'s
    commit / rollback restores everything (a rollback into a window whose cache was released
    re-prefills it). Within window w, Bark's ``AlternatingCodebooksLogitsProcessor`` is
    reproduced: the o-th token of the window (o = p - w * W) allows [svs, svs + codebook_size) for
    even o and [svs + codebook_size, output_vocab_size) for odd o. After N tokens the target puts
    all mass on an extra stop id (``output_vocab_size``, :attr:`BarkCoarseTarget.eos_token_ids`),
    so the core stops exactly where Bark does. Token trees are refused (a tree crossing a window
    boundary would need one re-encoded prompt per branch).

The prompt tokens a :class:`SequenceState` shows drafters are: for the semantic stage the padded
speaker history and, in place of the infer token (outside the output vocabulary), the pad id; for
the coarse stage window 0's input exactly as Bark builds it. :meth:`BarkSemanticTarget.semantic_output`
and :meth:`BarkCoarseTarget.coarse_output` turn ``mmspec.generate``'s sequences into what
``BarkCoarseModel.generate`` and ``BarkFineModel.generate`` take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.bark.generation_configuration_bark import (
    BarkCoarseGenerationConfig,
    BarkSemanticGenerationConfig,
)

from ...core.batch import BatchState
from ...core.cache import SequenceState, crop_cache, make_cache
from ...core.target import TargetOutput
from ...core.tree import TokenTree, tree_attention_mask, tree_position_ids
from ...modeling.hf_compat import cache_kwargs


def bark_targets(bark_model, min_eos_p: float | None = None) -> tuple["BarkSemanticTarget", "BarkCoarseTarget"]:
    """The semantic and coarse targets of a transformers ``BarkModel``, with the generation settings
    ``BarkModel.generate`` uses (its ``generation_config``'s semantic / coarse sub-configs and
    ``codebook_size``)."""
    missing = [name for name in ("generation_config", "semantic", "coarse_acoustics") if not hasattr(bark_model, name)]
    if missing:  # (the targets read its sub-models and generation sub-configs)
        raise ValueError(f"bark_targets takes a transformers BarkModel (BarkModel.from_pretrained(...)), got "
                         f"{type(bark_model).__name__} (no {', '.join(missing)})")
    config = bark_model.generation_config
    semantic_config = _sub_config(config.semantic_config, BarkSemanticGenerationConfig)
    coarse_config = _sub_config(config.coarse_acoustics_config, BarkCoarseGenerationConfig)
    semantic = BarkSemanticTarget(bark_model.semantic, semantic_config, min_eos_p=min_eos_p)
    coarse = BarkCoarseTarget(bark_model.coarse_acoustics, semantic_config, coarse_config, config.codebook_size)
    return semantic, coarse


def _check_model(model: Any, kind: str) -> None:
    """Refuse a model that is not transformers' ``Bark{kind}Model`` (one line naming where it is)."""
    import transformers

    if not isinstance(model, getattr(transformers, f"Bark{kind}Model")):
        raise ValueError(f"expected a transformers Bark{kind}Model (BarkModel's .{kind.lower()}"
                         f"{'_acoustics' if kind == 'Coarse' else ''}), got {type(model).__name__}")


def _sub_config(value: Any, config_class: type):
    """A ``BarkGenerationConfig`` sub-config (a dict, or already a config object) as ``config_class``."""
    if isinstance(value, config_class):
        return value
    if isinstance(value, Mapping):
        return config_class(**value)
    raise ValueError(f"expected Bark's generation sub-config (a dict or {config_class.__name__}), got {type(value).__name__}")


def _token_tensor(value: Any, name: str, hint: str) -> torch.Tensor:
    """``value`` as one integer sequence [1, L] (L >= 1); ValueError otherwise."""
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be an integer tensor [1, L] ({hint}), got {type(value).__name__}") from None
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be one non-empty integer sequence [1, L] ({hint}), got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    return ids.long()


def _history_part(history_prompt: Any, key: str, dims: int) -> torch.Tensor | None:
    """history_prompt[key] as an integer tensor of ``dims`` dimensions, or None without a history."""
    if history_prompt is None:
        return None
    if not isinstance(history_prompt, Mapping) or key not in history_prompt:
        raise ValueError(f"history_prompt must be Bark's speaker prompt, a dict with {key!r} (as BarkProcessor's "
                         f"voice_preset gives), got {type(history_prompt).__name__}")
    part = torch.as_tensor(history_prompt[key])
    if part.dim() != dims or part.dtype.is_floating_point:
        raise ValueError(f"history_prompt[{key!r}] must be an integer tensor of {dims} dimension(s), got shape "
                         f"{tuple(part.shape)} and dtype {part.dtype}")
    return part.long()


def _check_hidden_layer(hidden_layer: int | None, num_layers: int) -> None:
    if hidden_layer is not None and not -1 <= hidden_layer <= num_layers:
        raise ValueError(f"hidden_layer must be None, -1 or 0..{num_layers}, got {hidden_layer}")


def _check_step_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [1, n] with n >= 1, got {tuple(tokens.shape)}")
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(f"tokens must be ids in [0, {vocab_size}), got {tokens.tolist()}")


class BarkSemanticTarget:
    """``BarkSemanticModel`` (text -> semantic tokens) as a core Target (module doc).

    model_inputs: ``input_ids`` [1, T] (BarkProcessor's text ids, without the offset),
    ``attention_mask`` [1, T] (optional; 0 marks pads) and ``history_prompt`` (optional; Bark's
    speaker prompt, a dict whose ``semantic_prompt`` [S] is read).

    Args:
        model: a ``BarkSemanticModel`` (or ``BarkModel.semantic``).
        generation_config: its ``BarkSemanticGenerationConfig`` (default: Bark's defaults, those of
            the suno checkpoints; :func:`bark_targets` takes a ``BarkModel``'s).
        min_eos_p: Bark's early-stop threshold (default: the config's).

    Attributes:
        vocab_size: the model's ``output_vocab_size``.
        eos_token_ids: [the EOS / semantic pad id].
        max_new_tokens: Bark's cap on generated tokens (the config's ``max_new_tokens``); pass it
            to ``mmspec.generate`` to stop where Bark stops.
        prompt_length: ``max_input_semantic_length`` + 1, the prompt positions of every sequence.
    """

    input_names = ("input_ids", "attention_mask", "history_prompt")

    def __init__(self, model, generation_config: BarkSemanticGenerationConfig | None = None,
                 min_eos_p: float | None = None) -> None:
        _check_model(model, "Semantic")
        config = generation_config if generation_config is not None else BarkSemanticGenerationConfig()
        self.model = model
        self.generation_config = config
        self.context = int(config.max_input_semantic_length)
        self.vocab_size = int(model.config.output_vocab_size)
        self.input_vocab_size = int(model.config.input_vocab_size)
        self.block_size = int(model.config.block_size)
        self.eos_id = int(config.eos_token_id)
        self.pad_id = int(config.semantic_pad_token)
        self.min_eos_p = config.min_eos_p if min_eos_p is None else min_eos_p
        if self.min_eos_p is not None and not self.min_eos_p > 0:
            raise ValueError(f"min_eos_p must be a positive probability (or None), got {self.min_eos_p}")
        self.eos_token_ids = [self.eos_id]
        self.max_new_tokens = config.max_new_tokens
        self.prompt_length = self.context + 1
        for name in ("text_pad_token", "semantic_infer_token"):
            if not 0 <= getattr(config, name) < self.input_vocab_size:
                raise ValueError(f"{name}={getattr(config, name)} is outside the model's input vocabulary "
                                 f"({self.input_vocab_size}); use the generation config of this checkpoint")
        if not 0 <= self.pad_id < self.vocab_size or self.eos_id != self.pad_id:
            raise ValueError(f"the EOS / semantic pad id {self.pad_id} must be one id inside the output vocabulary "
                             f"({self.vocab_size}); use the generation config of this checkpoint")
        if self.prompt_length >= self.block_size:
            raise ValueError(f"max_input_semantic_length + 1 = {self.prompt_length} leaves no position of the "
                             f"model's block_size {self.block_size} to generate in")
        # Bark's SuppressTokensLogitsProcessor: [semantic_vocab_size, pad) and (pad, output_vocab_size)
        suppressed = torch.zeros(self.vocab_size, dtype=torch.bool)
        suppressed[config.semantic_vocab_size : self.pad_id] = True
        suppressed[self.pad_id + 1 :] = True
        self._suppressed = suppressed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- Bark's inputs and logits processors -------------------------------------------------
    def text_ids(self, input_ids: Any, attention_mask: Any = None) -> torch.Tensor:
        """Bark's text part: LongTensor [L] (L = max_input_semantic_length) of ids + offset, pads
        (mask 0, and the padding to L that BarkProcessor adds) as ``text_pad_token``."""
        config = self.generation_config
        ids = _token_tensor(input_ids, "input_ids", "BarkProcessor's text ids")
        limit = self.input_vocab_size - config.text_encoding_offset
        if bool(((ids < 0) | (ids >= limit)).any()):
            raise ValueError(f"input_ids must be text token ids in [0, {limit}) (BarkProcessor's tokenizer), "
                             f"got values {int(ids.min())}..{int(ids.max())}")
        ids = ids + config.text_encoding_offset
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask)
            if tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(f"attention_mask has shape {list(mask.shape)} but input_ids {list(ids.shape)}; pass "
                                 "BarkProcessor's attention_mask unchanged, or none")
            ids = ids.masked_fill((1 - mask.long()).bool(), config.text_pad_token)
        ids = ids[0, : self.context]
        return F.pad(ids, (0, self.context - ids.shape[0]), value=config.text_pad_token)

    def semantic_history(self, history_prompt: Any = None) -> torch.Tensor:
        """Bark's semantic history: LongTensor [L], the speaker prompt's last L semantic tokens
        padded on the right with the semantic pad (all pads without a speaker prompt)."""
        history = _history_part(history_prompt, "semantic_prompt", 1)
        if history is None:
            return torch.full((self.context,), self.pad_id, dtype=torch.long)
        if bool(((history < 0) | (history >= self.vocab_size)).any()):
            raise ValueError(f"history_prompt['semantic_prompt'] holds ids outside the semantic vocabulary "
                             f"[0, {self.vocab_size}); pass Bark's speaker prompt")
        history = history[-self.context :] if self.context else history[:0]
        return F.pad(history, (0, self.context - history.shape[0]), value=self.pad_id)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw logits [n, V] -> float logits [n, V] with Bark's suppression and EOS prioritiser as -inf."""
        logits = logits.float().masked_fill(self._suppressed.to(logits.device), -torch.inf)
        if self.min_eos_p:
            eos_probs = torch.softmax(logits, dim=-1)[:, self.eos_id]
            only_eos = torch.full_like(logits, -torch.inf)
            only_eos[:, self.eos_id] = logits[:, self.eos_id]
            logits = torch.where((eos_probs > self.min_eos_p)[:, None], only_eos, logits)
        return logits

    # ---- the core's Target ---------------------------------------------------------------------
    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[SequenceState, TargetOutput]:
        _check_hidden_layer(hidden_layer, self.model.config.num_layers)
        device = self.device
        text = self.text_ids(model_inputs.get("input_ids"), model_inputs.get("attention_mask")).to(device)
        history = self.semantic_history(model_inputs.get("history_prompt")).to(device)
        embed = self.model.input_embeds_layer
        infer = torch.tensor([self.generation_config.semantic_infer_token], device=device)
        embeds = torch.cat([embed(text) + embed(history), embed(infer)])[None]  # [1, L + 1, H]
        cache = make_cache(self.model.config)
        out = self.model(inputs_embeds=embeds, **cache_kwargs(self.model, cache), use_cache=True,
                         output_hidden_states=hidden_layer is not None, return_dict=True)
        tokens = torch.cat([history, history.new_full((1,), self.pad_id)])[None]  # the infer slot shows the pad id
        state = SequenceState(tokens, cache, prompt_length=self.prompt_length)
        hidden = None if hidden_layer is None else out.hidden_states[hidden_layer][:, -1:]
        return state, TargetOutput(self.constrain(out.logits[0, -1:])[None], hidden)

    def forward(self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None,
                tree: TokenTree | None = None) -> TargetOutput:
        _check_hidden_layer(hidden_layer, self.model.config.num_layers)
        _check_step_tokens(tokens, self.vocab_size)
        past, n = state.cache_length, tokens.shape[1]
        if past + n > self.block_size:
            raise ValueError(f"{past + n} positions exceed Bark's block_size of {self.block_size}: lower "
                             f"max_new_tokens to at most {self.block_size - self.prompt_length + 1}")
        extra = {}
        if tree is not None:
            if tree.size != n:
                raise ValueError(f"tree has {tree.size} nodes for {n} input tokens")
            extra = {"attention_mask": tree_attention_mask(tree, past, dtype=self.model.dtype, device=self.device),
                     "position_ids": tree_position_ids(tree, past, device=self.device)}
        out = self.model(input_ids=tokens.to(self.device), **cache_kwargs(self.model, state.cache), use_cache=True,
                         output_hidden_states=hidden_layer is not None, return_dict=True, **extra)
        hidden = None if hidden_layer is None else out.hidden_states[hidden_layer]
        return TargetOutput(self.constrain(out.logits[0])[None], hidden)

    # ---- batches (mmspec.core.batch) ------------------------------------------------------------
    def prefill_rows(self, rows: list[dict[str, Any]], hidden_layer: int | None = None) -> tuple[BatchState, list[TargetOutput]]:
        """Prefill B texts (each as :meth:`prefill` takes its inputs), one at a time, and stack
        them: every row's prompt is the same L + 1 positions, so no row is padded."""
        return BatchState.prefill(self, rows, hidden_layer)

    def forward_rows(self, state: BatchState, tokens: torch.Tensor, hidden_layer: int | None = None) -> TargetOutput:
        """Append ``tokens`` [B, n] to every row; logits [B, n, V] (hidden [B, n, H]): each row
        attends to its valid cache slots (a 2-D mask, which Bark's attention combines with its own
        causal mask) at its own positions (``state.position_ids``)."""
        _check_hidden_layer(hidden_layer, self.model.config.num_layers)
        if tokens.dim() != 2 or tokens.shape[0] != state.size or bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(f"tokens must be [{state.size}, n] ids in [0, {self.vocab_size}), got {tuple(tokens.shape)}")
        b, n = tokens.shape
        positions = state.position_ids(n)
        if int(positions.max()) >= self.block_size:
            raise ValueError(f"{int(positions.max()) + 1} positions exceed Bark's block_size of {self.block_size}: lower "
                             f"max_new_tokens to at most {self.block_size - self.prompt_length + 1}")
        out = self.model(input_ids=tokens.to(self.device), **cache_kwargs(self.model, state.cache), use_cache=True,
                         attention_mask=state.attention_mask(n).to(self.device), position_ids=positions.to(self.device),
                         output_hidden_states=hidden_layer is not None, return_dict=True)
        hidden = None if hidden_layer is None else out.hidden_states[hidden_layer]
        return TargetOutput(self.constrain(out.logits.flatten(0, 1)).view(b, n, -1), hidden)

    # ---- output --------------------------------------------------------------------------------
    def semantic_output(self, sequences: torch.Tensor) -> torch.Tensor:
        """``mmspec.generate(...).sequences`` [1, prompt + n] -> the semantic tokens [1, n] (EOS
        kept), what ``BarkSemanticModel.generate`` returns and :class:`BarkCoarseTarget` takes."""
        if sequences.dim() != 2 or sequences.shape[0] != 1 or sequences.shape[1] < self.prompt_length:
            raise ValueError(f"sequences must be [1, {self.prompt_length} + n] (a semantic generation), got "
                             f"{tuple(sequences.shape)}")
        return sequences[:, self.prompt_length :]


@dataclass
class CoarsePlan:
    """What Bark's coarse generation derives from its inputs before the first window.

    Attributes:
        semantic: LongTensor [S] speaker semantic history + semantic tokens, semantic pads replaced
            by ``coarse_semantic_pad_token``.
        coarse_history: LongTensor [H] the speaker's coarse history (offset, interleaved, trimmed
            as ``BarkCoarseModel.preprocess_histories`` does).
        base_semantic_index: length of the speaker semantic history in ``semantic``.
        num_tokens: N, the coarse tokens Bark generates.
    """

    semantic: torch.Tensor
    coarse_history: torch.Tensor
    base_semantic_index: int
    num_tokens: int


@dataclass
class _Window:
    """One window's KV cache: ``prompt_length`` entries, then the window's tokens fed so far.

    Attributes:
        first_logits: [V_out] raw logits of the window's first token (its prompt's last position).
        first_hidden: [layers + 1, H] the hidden states of that position.
    """

    cache: Any
    prompt_length: int
    first_logits: torch.Tensor
    first_hidden: torch.Tensor


class CoarseWindowCache:
    """The coarse sequence's KV state behind the core's cache interface.

    The core sees one cache of ``prompt_length`` + (generated tokens fed) entries
    (``get_seq_length`` / ``crop``); underneath, window w's model cache holds window w's prompt and
    the window's tokens fed so far. Only the current window and the one before it keep their model
    caches (a verification crosses at most one boundary per window of tokens); a crop reaching
    further back re-prefills that window when it is next needed.

    Attributes:
        plan: the generation's :class:`CoarsePlan`.
        prompt_length: window 0's prompt length (the sequence's prompt).
        stream: LongTensor [j] the generated tokens fed so far.
        windows: window index -> :class:`_Window`.
    """

    def __init__(self, plan: CoarsePlan, prompt_length: int, window_length: int) -> None:
        self.plan = plan
        self.prompt_length = prompt_length
        self.window_length = window_length
        self.stream = torch.empty(0, dtype=torch.long)
        self.windows: dict[int, _Window] = {}

    def get_seq_length(self) -> int:
        return self.prompt_length + self.stream.shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` generated tokens, in every window."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        self.stream = self.stream[: self.stream.shape[0] + tokens_to_remove]
        self.sync()

    def sync(self) -> None:
        """Make every kept window hold no more than the stream's tokens; release windows that are
        not open yet at this length and windows older than the one before the current."""
        fed, width = self.stream.shape[0], self.window_length
        current = fed // width
        for index in list(self.windows):
            if index * width > fed or index < current - 1:
                del self.windows[index]
                continue
            window = self.windows[index]
            count = min(fed - index * width, width - 1)
            if window.cache.get_seq_length() > window.prompt_length + count:
                crop_cache(window.cache, window.prompt_length + count)


class BarkCoarseTarget:
    """``BarkCoarseModel`` (semantic -> the first two EnCodec codebooks, interleaved) as a core
    Target, exact across Bark's sliding windows (module doc).

    model_inputs: ``semantic_output`` [1, S] (the semantic stage's tokens, EOS / pads included, as
    ``BarkSemanticModel.generate`` returns them) and ``history_prompt`` (optional; Bark's speaker
    prompt, a dict whose ``semantic_prompt`` [S'] and ``coarse_prompt`` [2, T] are read).

    Args:
        model: a ``BarkCoarseModel`` (or ``BarkModel.coarse_acoustics``).
        semantic_generation_config / coarse_generation_config: Bark's generation configs (default:
            Bark's defaults; :func:`bark_targets` takes a ``BarkModel``'s).
        codebook_size: codes per EnCodec codebook (``BarkModel.generation_config.codebook_size``).

    Attributes:
        vocab_size: ``output_vocab_size`` + 1: the model's outputs and the stop id.
        stop_id: ``output_vocab_size``, all the mass once the N coarse tokens are generated.
        eos_token_ids: [stop_id].
    """

    input_names = ("semantic_output", "history_prompt")
    #: (a row's cache is a sliding window of Bark's, re-prefilled at each window's start)
    batch_size_one_reason = "re-prefills a sliding window of each row's own at Bark's window boundaries"

    def __init__(self, model, semantic_generation_config: BarkSemanticGenerationConfig | None = None,
                 coarse_generation_config: BarkCoarseGenerationConfig | None = None, codebook_size: int = 1024) -> None:
        _check_model(model, "Coarse")
        self.model = model
        self.semantic_config = semantic_generation_config or BarkSemanticGenerationConfig()
        self.coarse_config = config = coarse_generation_config or BarkCoarseGenerationConfig()
        self.codebook_size = int(codebook_size)
        self.output_vocab_size = int(model.config.output_vocab_size)
        self.input_vocab_size = int(model.config.input_vocab_size)
        self.block_size = int(model.config.block_size)
        self.stop_id = self.output_vocab_size
        self.vocab_size = self.output_vocab_size + 1
        self.eos_token_ids = [self.stop_id]
        self.window_length = int(config.sliding_window_len)
        self.ratio = config.coarse_rate_hz / self.semantic_config.semantic_rate_hz * config.n_coarse_codebooks
        self.max_semantic_history = int(np.floor(config.max_coarse_history / self.ratio))
        if config.n_coarse_codebooks != 2:
            raise ValueError(f"Bark's coarse stage alternates two codebooks; n_coarse_codebooks={config.n_coarse_codebooks}")
        if self.window_length < 1:
            raise ValueError(f"sliding_window_len must be >= 1, got {self.window_length}")
        first = self.semantic_config.semantic_vocab_size
        if first + 2 * self.codebook_size > self.output_vocab_size:
            raise ValueError(f"semantic_vocab_size + 2 * codebook_size = {first + 2 * self.codebook_size} exceeds the "
                             f"model's output vocabulary ({self.output_vocab_size}); check codebook_size")
        for name in ("coarse_semantic_pad_token", "coarse_infer_token"):
            if not 0 <= getattr(config, name) < min(self.input_vocab_size, self.vocab_size):
                raise ValueError(f"{name}={getattr(config, name)} is outside the model's vocabulary; use the "
                                 "generation config of this checkpoint")
        # AlternatingCodebooksLogitsProcessor: even window offsets -> codebook 0, odd -> codebook 1 (and above)
        allowed = torch.zeros(2, self.vocab_size, dtype=torch.bool)
        allowed[0, first : first + self.codebook_size] = True
        allowed[1, first + self.codebook_size : self.output_vocab_size] = True
        self._blocked = ~allowed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- Bark's inputs ---------------------------------------------------------------------------
    def coarse_length(self, semantic_output: Any) -> int:
        """N, the coarse tokens Bark generates for ``semantic_output`` [1, S] (as ``generate`` computes
        its ``output_lengths``: floor(non-pad tokens * ratio / 2), times 2)."""
        semantic = self._semantic_tokens(semantic_output)
        config = self.coarse_config
        lengths = (semantic != config.coarse_semantic_pad_token).sum(1)
        lengths = torch.floor(lengths * self.ratio / config.n_coarse_codebooks)
        return int(torch.round(lengths * config.n_coarse_codebooks).int().max())

    def _semantic_tokens(self, semantic_output: Any) -> torch.Tensor:
        """[1, S] with semantic pads (EOS) replaced by the coarse semantic pad, as Bark does (on a copy)."""
        semantic = _token_tensor(semantic_output, "semantic_output", "the semantic stage's tokens")
        semantic = semantic.masked_fill(semantic == self.semantic_config.semantic_pad_token,
                                        self.coarse_config.coarse_semantic_pad_token)
        if bool(((semantic < 0) | (semantic >= self.input_vocab_size)).any()):
            raise ValueError(f"semantic_output holds ids outside the coarse model's input vocabulary "
                             f"[0, {self.input_vocab_size}); pass the semantic stage's output")
        return semantic

    def _histories(self, history_prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Bark's own ``preprocess_histories``: semantic [S'] and offset coarse history [H]."""
        if history_prompt is not None:
            semantic = _history_part(history_prompt, "semantic_prompt", 1)
            coarse = _history_part(history_prompt, "coarse_prompt", 2)
            if coarse.shape[0] != self.coarse_config.n_coarse_codebooks:
                raise ValueError(f"history_prompt['coarse_prompt'] must be [{self.coarse_config.n_coarse_codebooks}, T], "
                                 f"got {tuple(coarse.shape)}")
            if bool(((coarse < 0) | (coarse >= self.codebook_size)).any()):
                raise ValueError(f"history_prompt['coarse_prompt'] holds codes outside [0, {self.codebook_size}) "
                                 "(codebook_size); pass Bark's speaker prompt")
            if bool(((semantic < 0) | (semantic >= self.input_vocab_size)).any()):
                raise ValueError(f"history_prompt['semantic_prompt'] holds ids outside the coarse model's input "
                                 f"vocabulary [0, {self.input_vocab_size}); pass Bark's speaker prompt")
            history_prompt = {"semantic_prompt": semantic, "coarse_prompt": coarse}
        semantic, coarse = self.model.preprocess_histories(
            max_coarse_history=self.coarse_config.max_coarse_history, semantic_to_coarse_ratio=self.ratio, batch_size=1,
            semantic_generation_config=self.semantic_config, codebook_size=self.codebook_size,
            history_prompt=history_prompt)
        return semantic[0].long().cpu(), coarse[0].long().cpu()

    def plan(self, semantic_output: Any, history_prompt: Any = None) -> CoarsePlan:
        """Everything Bark derives from the inputs before its first window (:class:`CoarsePlan`)."""
        semantic = self._semantic_tokens(semantic_output)
        num_tokens = self.coarse_length(semantic_output)
        semantic_history, coarse_history = self._histories(history_prompt)
        return CoarsePlan(torch.cat([semantic_history, semantic[0].cpu()]), coarse_history,
                          semantic_history.shape[0], num_tokens)

    def window_prompt(self, plan: CoarsePlan, generated: torch.Tensor, window: int) -> torch.Tensor:
        """Window ``window``'s input, exactly as Bark builds it: LongTensor [P].

        Args:
            generated: LongTensor [>= window * W] the coarse tokens generated before the window.
        """
        config = self.coarse_config
        total = window * self.window_length
        semantic_index = plan.base_semantic_index + int(round(total / self.ratio))
        semantic = plan.semantic[max(0, semantic_index - self.max_semantic_history) :][: config.max_coarse_input_length]
        semantic = F.pad(semantic, (0, config.max_coarse_input_length - semantic.shape[0]),
                         value=config.coarse_semantic_pad_token)
        coarse = torch.cat([plan.coarse_history, generated[:total].cpu()])[-config.max_coarse_history :]
        return torch.cat([semantic, torch.tensor([config.coarse_infer_token]), coarse])

    def prompt_length(self, history_prompt: Any = None) -> int:
        """Length of window 0's prompt, the prompt of the sequences ``mmspec.generate`` returns."""
        config = self.coarse_config
        history = self._histories(history_prompt)[1][-config.max_coarse_history :]
        return config.max_coarse_input_length + 1 + history.shape[0]

    def _check_positions(self, plan: CoarsePlan) -> None:
        config, width = self.coarse_config, self.window_length
        for window in range(-(-plan.num_tokens // width)):
            history = plan.coarse_history.shape[0] + window * width
            history = min(history, config.max_coarse_history) if config.max_coarse_history else history
            needed = config.max_coarse_input_length + 1 + history + min(width, plan.num_tokens - window * width) - 1
            if needed > self.block_size:
                raise ValueError(f"window {window} needs {needed} positions, more than the coarse model's block_size "
                                 f"of {self.block_size}; lower max_coarse_history or sliding_window_len")

    # ---- the core's Target ---------------------------------------------------------------------
    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[SequenceState, TargetOutput]:
        _check_hidden_layer(hidden_layer, self.model.config.num_layers)
        if model_inputs.get("semantic_output") is None:
            raise ValueError("BarkCoarseTarget needs semantic_output=[1, S], the semantic stage's tokens")
        plan = self.plan(model_inputs["semantic_output"], model_inputs.get("history_prompt"))
        self._check_positions(plan)
        prompt = self.window_prompt(plan, torch.empty(0, dtype=torch.long), 0)
        if int(prompt.max()) >= self.vocab_size:
            raise ValueError(f"the coarse prompt holds id {int(prompt.max())}, outside the model's output vocabulary "
                             f"({self.vocab_size}); check the generation configs")
        cache = CoarseWindowCache(plan, prompt.shape[0], self.window_length)
        state = SequenceState(prompt[None].to(self.device), cache, prompt_length=prompt.shape[0])
        if plan.num_tokens == 0:
            logits, hidden = self._stop_row(), self._hidden_rows([None], hidden_layer)
        else:
            window = self._window(cache, 0, 0)
            logits = self._constrain(window.first_logits, 0)
            hidden = self._hidden_rows([window.first_hidden], hidden_layer)
        return state, TargetOutput(logits[None, None], None if hidden is None else hidden[None])

    def forward(self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None,
                tree: TokenTree | None = None) -> TargetOutput:
        """Logits [1, n, V] of the tokens following each of ``tokens`` [1, n]; crossing a window
        boundary prefills the next window (made of the committed and drafted tokens)."""
        if tree is not None:
            raise ValueError("token trees are not supported on Bark's coarse stage: a tree crossing a sliding-window "
                             "boundary would need one re-encoded window per branch; use a chain drafter")
        _check_hidden_layer(hidden_layer, self.model.config.num_layers)
        _check_step_tokens(tokens, self.vocab_size)
        cache: CoarseWindowCache = state.cache
        width, total = self.window_length, cache.plan.num_tokens
        start, n = cache.stream.shape[0], tokens.shape[1]
        cache.stream = torch.cat([cache.stream, tokens[0].cpu()])
        rows, hidden_rows, i = [], [], 0
        while i < n:
            predicted = start + i + 1  # stream index of the token this row predicts
            window, offset = divmod(predicted, width)
            if predicted >= total:
                rows.append(self._stop_row())
                hidden_rows.append(None)
                i += 1
            elif offset == 0:
                opened = self._window(cache, window, 0)
                rows.append(self._constrain(opened.first_logits, 0))
                hidden_rows.append(opened.first_hidden)
                i += 1
            else:  # a run of tokens predicting positions inside this window
                end = i + 1
                while end < n and start + end + 1 < total and (start + end + 1) % width:
                    end += 1
                current = self._window(cache, window, offset - 1)
                logits, hidden = self._run(current.cache, tokens[0, i:end], hidden_layer is not None)
                rows.extend(self._constrain(logits[r], offset + r) for r in range(end - i))
                hidden_rows.extend([None] * (end - i) if hidden is None else hidden.unbind(1))
                i = end
        cache.sync()
        hidden = self._hidden_rows(hidden_rows, hidden_layer)
        return TargetOutput(torch.stack(rows)[None], None if hidden is None else hidden[None])

    # ---- windows ---------------------------------------------------------------------------------
    def _window(self, cache: CoarseWindowCache, index: int, count: int) -> _Window:
        """Window ``index`` holding its prompt and its first ``count`` tokens of ``cache.stream``
        (prefilled when not kept, cropped or fed as needed)."""
        first = index * self.window_length
        tokens = cache.stream[first : first + count]
        window = cache.windows.get(index)
        if window is None:
            prompt = self.window_prompt(cache.plan, cache.stream, index)
            model_cache = make_cache(self.model.config)
            out = self.model(input_ids=self._model_ids(torch.cat([prompt, tokens]))[None], **cache_kwargs(self.model, model_cache),
                             use_cache=True, output_hidden_states=True, return_dict=True)
            last = prompt.shape[0] - 1
            hidden = torch.stack([h[0, last] for h in out.hidden_states])
            window = cache.windows[index] = _Window(model_cache, prompt.shape[0], out.logits[0, last], hidden)
            return window
        have = window.cache.get_seq_length() - window.prompt_length
        if have > count:
            crop_cache(window.cache, window.prompt_length + count)
        elif have < count:
            self._run(window.cache, tokens[have:], False)
        return window

    def _run(self, model_cache: Any, tokens: torch.Tensor, want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens [m] -> raw logits [m, V_out] and, when asked, hidden states [layers + 1, m, H]."""
        out = self.model(input_ids=self._model_ids(tokens)[None], **cache_kwargs(self.model, model_cache), use_cache=True,
                         output_hidden_states=want_hidden, return_dict=True)
        hidden = torch.stack([h[0] for h in out.hidden_states]) if want_hidden else None
        return out.logits[0], hidden

    def _model_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stream ids [m] -> model input ids: ids outside the input vocabulary (the stop id, which
        the target gives probability 0 wherever it feeds the model) become the coarse pad."""
        tokens = tokens.to(self.device)
        return torch.where(tokens < self.input_vocab_size, tokens, self.coarse_config.coarse_semantic_pad_token)

    def _constrain(self, logits: torch.Tensor, offset: int) -> torch.Tensor:
        """Raw logits [V_out] of the window's ``offset``-th token -> [V], Bark's alternating mask as -inf."""
        out = F.pad(logits.float(), (0, 1), value=-torch.inf)
        return out.masked_fill(self._blocked[offset % 2].to(out.device), -torch.inf)

    def _stop_row(self) -> torch.Tensor:
        row = torch.full((self.vocab_size,), -torch.inf, dtype=torch.float32, device=self.device)
        row[self.stop_id] = 0.0
        return row

    def _hidden_rows(self, rows: list[torch.Tensor | None], hidden_layer: int | None) -> torch.Tensor | None:
        """Per-row hidden states [layers + 1, H] (None past the end: zeros) -> [n, H] of ``hidden_layer``."""
        if hidden_layer is None:
            return None
        config = self.model.config
        picked = [torch.zeros(config.hidden_size, device=self.device, dtype=self.model.dtype) if row is None
                  else row[hidden_layer] for row in rows]
        return torch.stack(picked)

    # ---- output --------------------------------------------------------------------------------
    def coarse_output(self, sequences: torch.Tensor, history_prompt: Any = None) -> torch.Tensor:
        """``mmspec.generate(...).sequences`` -> the coarse tokens [1, N] (stop id removed), what
        ``BarkCoarseModel.generate`` returns and ``BarkFineModel.generate`` takes.

        Args:
            history_prompt: the speaker prompt of the generation (it sets the prompt's length).
        """
        prompt = self.prompt_length(history_prompt)
        if sequences.dim() != 2 or sequences.shape[0] != 1 or sequences.shape[1] < prompt:
            raise ValueError(f"sequences must be [1, {prompt} + n] (a coarse generation with this history_prompt), "
                             f"got {tuple(sequences.shape)}")
        new = sequences[:, prompt:]
        stops = (new[0] == self.stop_id).nonzero()
        return new[:, : int(stops[0])] if len(stops) else new
