"""``mmspec.generate``: speculative decoding of any supported transformers model."""

from __future__ import annotations

import copy
import difflib
import inspect
import operator
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from . import in_package
from .adapters.hf import TransformersTarget
from .core.arguments import check_argument_types, plain
from .core.batch import batch_stats, batched_decode, row_drafter
from .core.exclusive import exclusively
from .core.loop import speculative_decode
from .core.sampling import SamplingConfig
from .core.stats import DictAccess, SpecStats
from .core.target import eos_token_ids, input_names
from .drafters import resolve_drafter
from .modeling.fast_linear import OptimizeReport, optimize


@dataclass
class GenerateOutput(DictAccess):
    """Attributes:
    sequences: LongTensor [1, prompt + new], the layout transformers' ``generate()`` returns
        (continuous tokens: [1, new, D]).
    stats: the generation's SpecStats.
    token_steps: LongTensor [new] (a batch: [B, new]) the verification step that committed each
        token, where the tokens were reordered after generation (a MAR image in raster order);
        None: in order (``stats.step_of_token()``).
    row_stats: for a batch (B > 1 prompts), each row's SpecStats; ``stats`` then holds the
        batch's totals (:func:`mmspec.core.batch.batch_stats`).
    """

    sequences: torch.Tensor
    stats: SpecStats
    token_steps: torch.Tensor | None = None
    row_stats: list[SpecStats] | None = None


def check_seed(seed: Any) -> None:
    """An integer seed (or None) in 0 .. 2**63 - 1, the range a torch generator takes; else one
    ValueError line."""
    check_argument_types(generate, {"seed": seed})
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"seed must be between 0 and 2**63 - 1, got {seed}")


def check_callbacks(**callbacks: Any) -> None:
    """Each callback given (on_step, on_tokens, cancelled, ...) callable, else one ValueError line
    (``on_step=5`` failed after the prefill, deep in the loop)."""
    for name, function in callbacks.items():
        if function is not None and not callable(function):
            raise ValueError(f"{name} must be a function or None, got {function!r} ({type(function).__name__})")


def fresh_seed() -> int:
    """``seed=None``'s seed: drawn from the operating system (not torch's global generator), below
    2**62 so that a call's seed + i stays a valid seed; recorded in ``stats.config["seed"]``."""
    import secrets

    return secrets.randbelow(2**62)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (None: :func:`fresh_seed`)."""
    return torch.Generator(device=device).manual_seed(fresh_seed() if seed is None else seed)


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the function calling this one, of the first frame outside
    the mmspec package: a warning names the user's line, through a pipeline or ``generate`` alike."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and in_package(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def check_sampling_options(do_sample: Any, temperature: Any, top_k: Any, top_p: Any) -> None:
    """The sampling arguments' types (one ValueError line each); a temperature other than 1, a
    top-k or a top-p given without ``do_sample=True`` is warned about (greedy decoding ignores
    them; a UserWarning, as transformers' generate gives, where the CLI refuses them without
    ``--do-sample``)."""
    check_argument_types(generate, dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p))
    if not do_sample:
        given = [name for name, value, unset in (("temperature", temperature, 1.0), ("top_k", top_k, None),
                                                 ("top_p", top_p, None)) if value != unset]
        if given:
            warnings.warn(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only when sampling, and "
                          "do_sample is False: greedy decoding ignores it; pass do_sample=True to sample", UserWarning,
                          stacklevel=user_stacklevel())


@exclusively
def generate(
    target,
    drafter=None,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    *,
    acceptance: str | None = None,
    rule_kwargs: dict[str, Any] | None = None,
    num_draft_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_step: Callable[[int], None] | None = None,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    **model_inputs: Any,
) -> GenerateOutput:
    """Generate with speculative decoding; output identical (greedy) or identically distributed
    (sampling) to the target's own decoding.

    Args:
        target: a transformers causal LM or supported VLM, or any core Target (a
            TransformersTarget, or an image-token target from :mod:`mmspec.adapters.image_gen`,
            whose prompt is its conditioning plus ``guidance_scale``).
        drafter: None (plain AR), "prompt-lookup[:K]", "layer-skip:N", a transformers draft model
            with the target's tokenizer, or a :class:`mmspec.drafters.Drafter`.
        max_new_tokens: generation stops after this many new tokens ...
        do_sample, temperature, top_k, top_p: ... or, when sampling, with this distribution.
        seed: seeds every random number of the call (drafts, acceptance, residual draws).
        acceptance: "auto" (greedy / block verification), "speculative" (token by token),
            "typical" (lossy, Medusa's rule),
            "lantern" / "lantern++" / "gsd" (lossy, relaxed for image tokens; see
            :mod:`mmspec.core.relaxed`).
        rule_kwargs: the rule's parameters (typical: posterior_threshold, posterior_alpha;
            lantern: neighbours [V, k] and delta; lantern++: neighbours and lam; gsd: neighbours, top_m).
        num_draft_tokens: K, overriding the drafter's default.
        eos_token_id: stop token(s); default: the model's generation_config.eos_token_id.
        on_step: called after every verification step with the number of tokens generated so far
            (a progress bar; its time counts in the stats' wall time; batch size 1 only).
        on_tokens: called with each verification step's committed tokens [1, m] (and the first
            token), as they come (streaming; batch size 1 only).
        cancelled: called before every step; True stops the generation there with the tokens so
            far (``stats.config["cancelled"]``; batch size 1 only).
        **model_inputs: the prompt: input_ids [1, L] and, for VLMs, pixel_values and the other
            processor outputs -- inputs of the model's ``forward`` (anything else is refused).
            B > 1 prompts: input_ids [B, L] left-padded with their attention_mask [B, L], as
            transformers' generate takes them (see :func:`generate_rows`).
    Returns:
        GenerateOutput with ``.sequences`` [1, L + new] and ``.stats`` (for B > 1: [B, L + max
        new], each row right-padded with the pad token, ``.row_stats`` per row).
    Raises:
        ValueError: an empty prompt, a padded batch-1 prompt, a right-padded batch, a batch of a transformers
            model's prompts without its attention_mask, token ids outside the vocabulary,
            an attention_mask of another shape than input_ids, a prompt longer than the model's
            context, a keyword that is neither a parameter here nor a model input, a
            max_new_tokens / num_draft_tokens that is not a positive integer, an unsupported
            model, or a drafter/rule combination that cannot work.
    Warns:
        UserWarning: prompt + max_new_tokens may run past the model's context.

    A model in training mode is switched to eval mode for the call (no dropout) and back after.
    The sampling arguments and ``seed`` are checked first, before any model work: a value of
    another type (``temperature="hot"``, ``seed="x"``) is one ValueError line naming it.
    Example:
        >>> out = mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=64, **tok(text, return_tensors="pt"))
        >>> out.stats.mean_accepted_length
    """
    check_sampling_options(do_sample, temperature, top_k, top_p)
    check_seed(seed)
    check_callbacks(on_step=on_step, on_tokens=on_tokens, cancelled=cancelled)
    do_sample, temperature, top_k, top_p, seed = map(plain, (do_sample, temperature, top_k, top_p, seed))
    adapter, max_new_tokens, num_draft_tokens = _prepare(target, max_new_tokens, num_draft_tokens)
    input_ids = model_inputs.get("input_ids")
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1:
        if on_step is not None or on_tokens is not None or cancelled is not None:
            raise ValueError("on_step / on_tokens / cancelled follow one sequence; for a batch, pass on_row_done / "
                             "on_tokens / cancelled to mmspec.api.generate_rows")
        if model_inputs.get("attention_mask") is None and not hasattr(target, "prefill"):  # (a transformers model's prompts)
            raise ValueError(f"a batch of {input_ids.shape[0]} prompts needs its attention_mask [B, L]: without it the "
                             "left padding is read as prompt tokens; pass the tokenizer's output whole (tokenizer(texts, "
                             "padding=True, return_tensors='pt')), or attention_mask=torch.ones_like(input_ids) for "
                             "prompts of one length")
        return generate_rows(adapter, split_rows(model_inputs, adapter), drafter, max_new_tokens, do_sample, temperature, top_k,
                             top_p, seed, acceptance=acceptance, rule_kwargs=rule_kwargs,
                             num_draft_tokens=num_draft_tokens, eos_token_id=eos_token_id,
                             padded_prompts=model_inputs["input_ids"])
    check_target_inputs(adapter, model_inputs, max_new_tokens)
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    eos = stop_tokens(adapter, eos_token_id)
    resolved = resolve_drafter(drafter, adapter, num_draft_tokens)
    generator = make_generator(seed, adapter.device)
    with eval_mode(adapter, drafter, resolved):  # dropout off for the call, training flags restored after
        state, stats = speculative_decode(
            adapter,
            model_inputs,
            resolved,
            sampling,
            max_new_tokens,
            eos_token_ids=eos,
            generator=generator,
            acceptance=acceptance,
            rule_kwargs=rule_kwargs,
            on_step=on_step,
            on_tokens=on_tokens,
            cancelled=cancelled,
        )
    stats.config["seed"] = generator.initial_seed()  # (seed=None: the fresh one drawn, to reproduce the call)
    return GenerateOutput(sequences=state.tokens, stats=stats)


def _prepare(target, max_new_tokens: Any, num_draft_tokens: Any) -> tuple[Any, int, int | None]:
    """The call's target adapter and its checked counts (ValueError for a count that is not a
    positive integer)."""
    if isinstance(target, (str, os.PathLike)):  # (a name is the pipelines' and the CLI's, not generate's)
        raise TypeError(f"generate takes a loaded model, not the name {str(target)!r}: model, tokenizer = "
                        f"mmspec.hub.load_causal_lm({str(target)!r}) (or transformers' from_pretrained), then "
                        "mmspec.generate(model, ..., **tokenizer(text, return_tensors='pt'))")
    if not hasattr(target, "prefill") and not isinstance(target, torch.nn.Module):
        raise TypeError(f"generate takes a transformers model or an mmspec Target, got {type(target).__name__}")
    adapter = target if hasattr(target, "prefill") else TransformersTarget(target)
    return (adapter, _count("max_new_tokens", max_new_tokens),
            None if num_draft_tokens is None else _count("num_draft_tokens", num_draft_tokens))


def check_target_inputs(adapter, model_inputs: dict[str, Any], max_new_tokens: int) -> None:
    """A prompt's checks before the prefill: a transformers model's (:func:`check_model_inputs`),
    or the keywords another target's prefill names (``input_names``)."""
    if isinstance(adapter, TransformersTarget):
        check_model_inputs(adapter, model_inputs, max_new_tokens)
    elif input_names(adapter) is not None:
        check_keywords(model_inputs, input_names(adapter), f"{type(adapter).__name__}.prefill")
    frames = model_inputs.get("num_frames")
    if isinstance(frames, int) and hasattr(adapter, "stream_length") and max_new_tokens < adapter.stream_length(frames):
        warnings.warn(f"max_new_tokens={max_new_tokens} ends the stream before the {adapter.stream_length(frames)} tokens "
                      f"num_frames={frames} takes (the audio will be shorter); pass max_new_tokens="
                      f"{adapter.stream_length(frames)}", stacklevel=user_stacklevel())


def stop_tokens(adapter, eos_token_id: int | list[int] | None) -> list[int]:
    """The stop tokens: ``eos_token_id`` as a list, or by default the target's own."""
    if eos_token_id is None:
        return eos_token_ids(adapter)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    vocab = getattr(adapter, "vocab_size", None)
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i and (vocab is None or i < vocab) for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them{f' (0 to {vocab - 1})' if vocab else ''}, "
                         f"got {eos_token_id!r}; [] for none, or None for the model's own")
    return list(ids)


def split_rows(model_inputs: dict[str, Any], target=None) -> list[dict[str, Any]]:
    """A batch of prompts (input_ids [B, L], left-padded, attention_mask [B, L]; other tensors
    [B, ...], those shaped like input_ids unpadded with it; inputs indexed by image rather than by
    prompt, the Qwen-VL processors' flattened patches, split by ``target.split_items``) -> B batch-1
    prompts without their padding. Raises ValueError saying what to do."""
    input_ids = model_inputs["input_ids"]
    size = input_ids.shape[0]
    mask = model_inputs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(mask.shape)} but input_ids {list(input_ids.shape)}; pass the "
                         "tokenizer's attention_mask unchanged")
    mask = mask.bool()
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("the batch is right-padded; pad on the left (tokenizer.padding_side = 'left'), as for "
                         "transformers' generate")
    ids = [input_ids[b : b + 1, mask[b]] for b in range(size)]
    split_items = getattr(target, "split_items", None)
    items = split_items(ids, model_inputs) if split_items is not None else {}
    rows = []
    for b in range(size):
        row = {"input_ids": ids[b]}
        for name, value in model_inputs.items():
            if name in ("input_ids", "attention_mask"):
                continue
            if name in items:
                if items[name][b] is not None:
                    row[name] = items[name][b]
            elif isinstance(value, torch.Tensor):
                if value.dim() == 0 or value.shape[0] != size:
                    raise ValueError(f"{name} has shape {list(value.shape)}, not one entry per prompt ({size}); "
                                     "for prompts with several images each, call mmspec.generate once per prompt")
                row[name] = value[b : b + 1, mask[b]] if tuple(value.shape) == tuple(input_ids.shape) else value[b : b + 1]
            else:
                row[name] = value
        rows.append(row)
    return rows


@exclusively
def generate_rows(
    target,
    rows: Sequence[dict[str, Any]],
    drafter=None,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    *,
    acceptance: str | None = None,
    rule_kwargs: dict[str, Any] | None = None,
    num_draft_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_row_done: Callable | None = None,
    padded_prompts: torch.Tensor | None = None,
    on_tokens: Callable[[int, torch.Tensor], None] | None = None,
    cancelled: Callable[[int], bool] | None = None,
    admit: Callable[[], Sequence[dict[str, Any]]] | None = None,
) -> GenerateOutput:
    """Batched speculative decoding of B prompts (:func:`mmspec.core.batch.batched_decode`).

    Each row is one batch-1 prompt (a dict as :func:`generate` takes it). Every row gets its own
    drafter (a copy of ``drafter``, :func:`~mmspec.core.batch.row_drafter`) and its own
    generator seeded with ``seed`` (or ``seed[b]``: one per row), so row b's output is the output
    of ``generate(..., seed=seed, **rows[b])``: the same tokens under greedy decoding and the same
    random numbers under sampling. Other arguments as in :func:`generate`.

    Args:
        on_row_done: called with each row's :class:`~mmspec.core.batch.RowResult` as it finishes.
        on_tokens: called with (row index, tokens [1, m]) as each row commits tokens (streaming).
        cancelled: called with a row's index before every step; True takes the row out of the
            batch (its tokens so far; ``row_stats[b].config["cancelled"]``), the others unchanged.
        admit: called before every step; the prompts it returns (dicts as ``rows``) join the
            running batch (continuous batching), each with its own drafter copy and a generator
            seeded with ``seed`` (one int), indexed after every row so far. ``rows`` may then be empty.
        padded_prompts: the left-padded input_ids [B, L] the rows came from: ``sequences`` then
            keeps their layout ([B, L + max new]); without them, rows are left-padded to the longest.
    Returns:
        GenerateOutput: ``sequences`` [B, L + max new] (right-padded with the model's pad token),
        ``stats`` the batch's totals (its tokens_per_second is the throughput), ``row_stats``.
    """
    check_sampling_options(do_sample, temperature, top_k, top_p)
    for one in (seed if isinstance(seed, Sequence) and not isinstance(seed, str) else [seed]):
        check_seed(one)  # an integer or None, one per row or one for all
    check_callbacks(on_row_done=on_row_done, on_tokens=on_tokens, cancelled=cancelled, admit=admit)
    do_sample, temperature, top_k, top_p = map(plain, (do_sample, temperature, top_k, top_p))
    seed = [plain(one) for one in seed] if isinstance(seed, Sequence) and not isinstance(seed, str) else plain(seed)
    adapter, max_new_tokens, num_draft_tokens = _prepare(target, max_new_tokens, num_draft_tokens)
    if not rows and admit is None:
        raise ValueError("no prompts given")
    if admit is not None and (padded_prompts is not None or not (seed is None or isinstance(seed, int))):
        raise ValueError("admit takes one seed (an int or None) and no padded_prompts")
    for row in rows:
        check_target_inputs(adapter, row, max_new_tokens)
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    eos = stop_tokens(adapter, eos_token_id)
    resolved = resolve_drafter(drafter, adapter, num_draft_tokens)
    drafters = [None if resolved is None else row_drafter(copy.copy(resolved)) for _ in rows]
    if seed is None:
        seed = fresh_seed()
    seeds = [seed] * len(rows) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} prompts; pass one seed, or one per prompt")
    generators = [make_generator(s, adapter.device) for s in seeds]

    def joining() -> list[tuple[dict[str, Any], Any, torch.Generator]]:
        """The prompts ``admit`` gives now, checked, each with its drafter copy and generator."""
        new = list(admit())
        for row in new:
            check_target_inputs(adapter, row, max_new_tokens)
        return [(row, None if resolved is None else row_drafter(copy.copy(resolved)), make_generator(seed, adapter.device))
                for row in new]

    started = time.perf_counter()
    with eval_mode(adapter, drafter, resolved):
        results, forwards = batched_decode(adapter, rows, drafters, sampling, max_new_tokens, generators, eos,
                                           acceptance=acceptance, rule_kwargs=rule_kwargs, on_row_done=on_row_done,
                                           on_tokens=on_tokens, cancelled=cancelled,
                                           admit=None if admit is None else joining)
    wall = time.perf_counter() - started
    if not results:
        raise ValueError("no prompts given (admit gave none)")
    new = [r.tokens[0, r.prompt_length :] for r in results]
    if new[0].dim() == 2:  # continuous tokens [n, D] (no prompt tokens): zeros after a row's last
        sequences = new[0].new_zeros(len(results), max(len(n) for n in new), new[0].shape[1])
        for b, tokens in enumerate(new):
            sequences[b, : len(tokens)] = tokens
    else:
        pad = getattr(getattr(adapter, "model", None), "generation_config", None)
        pad = getattr(pad, "pad_token_id", None)
        pad = int(pad if pad is not None else (eos[0] if eos else 0))
        prompts = padded_prompts if padded_prompts is not None else [r.tokens[0, : r.prompt_length] for r in results]
        width = max(len(prompt) for prompt in prompts)
        sequences = torch.full((len(results), width + max(len(n) for n in new)), pad, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            sequences[b, width - len(prompt) : width] = prompt
            sequences[b, width : width + len(new[b])] = new[b]
    row_stats = [r.stats for r in results]
    for r in results:  # (seed=None: the fresh one drawn, to reproduce each row; rows admitted later: the one seed)
        r.stats.config["seed"] = seeds[r.index] if r.index < len(seeds) else seed
    stats = batch_stats(row_stats, wall, forwards)
    row_seeds = [s.config["seed"] for s in row_stats]
    stats.config["seed"] = row_seeds[0] if len(set(row_seeds)) == 1 else row_seeds  # (one per row where they differ)
    return GenerateOutput(sequences=sequences, stats=stats, row_stats=row_stats)


#: model inputs mmspec sets itself (the KV cache, positions, which logits to keep)
MANAGED_INPUTS = ("past_key_values", "cache", "use_cache", "logits_to_keep", "cache_position", "position_ids", "inputs_embeds", "labels")


def _count(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (Python or numpy integers, 0-d integer tensors); ValueError otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})") from None
    if count < 1:
        raise ValueError(f"{name} must be >= 1, got {count}")
    return count


def check_keywords(model_inputs: dict[str, Any], accepted: Sequence[str] | None, where: str) -> None:
    """Raise one ValueError line for the first keyword of ``model_inputs`` that mmspec manages
    (:data:`MANAGED_INPUTS`) or that ``where`` (a model's forward, a target's prefill) does not
    take (``accepted``; None: unknown), with the closest name it does take."""
    for name in model_inputs:
        if name in MANAGED_INPUTS and (accepted is None or name not in accepted):  # (a MAR's class labels are its input)
            raise ValueError(f"{name} is managed by mmspec.generate; pass only the prompt (input_ids, attention_mask, "
                             "and the processor's image inputs)")
        if accepted is not None and name not in accepted:
            known = [p for p in inspect.signature(generate).parameters if p not in ("target", "model_inputs")] + list(accepted)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its inputs: {', '.join(accepted)}"
            raise ValueError(f"unknown argument {name!r}: not a parameter of mmspec.generate nor an input of {where}{hint}")


def check_model_inputs(adapter: TransformersTarget, model_inputs: dict[str, Any], max_new_tokens: int) -> None:
    """Check a transformers model's prompt before the prefill; raise ValueError saying what to do.

    Args:
        adapter: the target.
        model_inputs: input_ids [1, L], attention_mask [1, L] (optional) and, for VLMs, the
            processor's other outputs (pixel_values, image_sizes, pixel_attention_mask, ...).
        max_new_tokens: the token budget (a warning when L + max_new_tokens exceeds the context).
    Raises:
        ValueError: a keyword that is neither a generate parameter nor a named input of the
            model's forward (or one mmspec manages: :data:`MANAGED_INPUTS`), token ids outside the
            input embedding, an attention_mask shaped unlike input_ids, or L > the model's context.
    """
    input_ids = adapter.check_inputs(model_inputs)
    model = adapter.model
    accepted = [name for name, p in inspect.signature(model.forward).parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in MANAGED_INPUTS]
    # (a generic *args / **kwargs forward names no inputs: only the managed ones can be refused)
    check_keywords(model_inputs, accepted if "input_ids" in accepted else None, f"{type(model).__name__}.forward")
    vocab = model.get_input_embeddings().num_embeddings
    outside = (input_ids < 0) | (input_ids >= vocab)
    if adapter.image_token_id is not None:
        outside &= input_ids != adapter.image_token_id
    if bool(outside.any()):
        raise ValueError(f"input_ids holds token id {int(input_ids[outside][0])}, outside the model's vocabulary "
                         f"(0 to {vocab - 1}); tokenise with this model's own tokenizer or processor")
    mask = model_inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(mask.shape)} but input_ids {list(input_ids.shape)}; pass "
                         "the tokenizer's attention_mask unchanged, or none (an unpadded prompt needs none)")
    config = getattr(model.config, "text_config", None) or model.config
    context = getattr(config, "max_position_embeddings", None)
    length = input_ids.shape[1]
    if context is not None and length > context:
        images = " (or use a smaller image resolution)" if adapter.image_token_id is not None else ""
        raise ValueError(f"the prompt has {length} tokens, more than {type(model).__name__}'s context of {context}; "
                         f"shorten it{images}")
    if context is not None and length + max_new_tokens > context:
        warnings.warn(f"prompt ({length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
                      f"{context}: tokens past position {context} are unreliable; "
                      + (f"lower max_new_tokens to {context - length}" if length < context else
                         "shorten the prompt: it fills the context"), stacklevel=user_stacklevel())


def component_modules(obj: Any, depth: int = 2) -> list[nn.Module]:
    """The modules of ``obj`` (a module; or a target / drafter: the modules among its attributes,
    and theirs, ``depth`` levels down: a draft model inside its drafter's target adapter)."""
    if isinstance(obj, nn.Module):
        return [obj]
    if depth == 0 or isinstance(obj, (str, bytes, int, float, torch.Tensor)):
        return []
    return [m for value in getattr(obj, "__dict__", {}).values() for m in component_modules(value, depth - 1)]


def optimize_components(*objects: Any, kernel: str = "auto") -> OptimizeReport:
    """:func:`mmspec.optimize` on every module of ``objects`` (a model, a drafter, a target) ->
    one report (the kernel that ran, linears replaced and left over all of them)."""
    reports = [optimize(module, kernel) for obj in objects for module in component_modules(obj)]
    kernels = [r.kernel for r in reports if r.kernel != "none"]
    variants = dict.fromkeys(v for r in reports if r.variants for v in r.variants.split(", "))
    report = OptimizeReport(kernels[0] if kernels else "none", sum(r.replaced for r in reports),
                            sum(r.skipped for r in reports), next((r.reason for r in reports if r.reason), ""),
                            ", ".join(variants), any(r.prompts for r in reports))
    report.note()
    return report


@contextmanager
def eval_mode(*objects: Any) -> Iterator[None]:
    """Put every module of ``objects`` (see :func:`component_modules`, one level down) in eval
    mode for the block, then give each submodule back the training flag it had."""
    training = [m for obj in objects for top in component_modules(obj, 1) for m in top.modules() if m.training]
    for module in training:
        module.training = False
    try:
        yield
    finally:
        for module in training:
            module.training = True


def check_text_prompt(prompt: str) -> str:
    """Raise ValueError for an empty or whitespace-only text prompt; return it unchanged otherwise."""
    if not prompt.strip():
        raise ValueError("the prompt is empty; give the text to respond to")
    return prompt


def chat_inputs(tokenizer, prompt: str, raw: bool = False) -> dict[str, torch.Tensor]:
    """Tokenise a user message ([1, L] tensors), wrapped in the chat template unless ``raw``."""
    check_text_prompt(prompt)
    if raw or tokenizer.chat_template is None:
        return dict(tokenizer(prompt, return_tensors="pt"))
    messages = [{"role": "user", "content": prompt}]
    return dict(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True))


def generate_with_baseline(model, drafter, inputs: dict, warmup: bool = True, **kwargs) -> tuple[GenerateOutput, GenerateOutput]:
    """Run plain AR decoding and the drafter on the same inputs in one process (after a short warm-up)
    and set ``stats.speedup`` = baseline wall time / method wall time on the method's output."""
    if warmup:
        generate(model, drafter=drafter, **{**kwargs, "max_new_tokens": 4}, **inputs)
    baseline = generate(model, drafter=None, **kwargs, **inputs)
    method = generate(model, drafter=drafter, **kwargs, **inputs)
    method.stats.speedup = baseline.stats.wall_time_s / method.stats.wall_time_s
    return method, baseline
