"""``mmspec.generate``: speculative decoding of any supported transformers model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .adapters.hf import TransformersTarget
from .core.loop import speculative_decode
from .core.sampling import SamplingConfig
from .core.stats import DictAccess, SpecStats
from .drafters import resolve_drafter


@dataclass
class GenerateOutput(DictAccess):
    """Attributes:
    sequences: LongTensor [1, prompt + new], the layout transformers' ``generate()`` returns.
    stats: the generation's SpecStats.
    """

    sequences: torch.Tensor
    stats: SpecStats


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


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
        acceptance: "auto" (greedy / speculative sampling), "typical" (lossy, Medusa's rule),
            "lantern" / "lantern++" / "gsd" (lossy, relaxed for image tokens; see
            :mod:`mmspec.core.relaxed`).
        rule_kwargs: the rule's parameters (typical: posterior_threshold, posterior_alpha;
            lantern: neighbours [V, k] and delta; lantern++: neighbours and lam; gsd: neighbours, top_m).
        num_draft_tokens: K, overriding the drafter's default.
        eos_token_id: stop token(s); default: the model's generation_config.eos_token_id.
        **model_inputs: the prompt: input_ids [1, L] and, for VLMs, pixel_values and the other
            processor outputs.
    Returns:
        GenerateOutput with ``.sequences`` [1, L + new] and ``.stats``.
    Raises:
        ValueError: batch size > 1, an empty or padded prompt, an unsupported model, or a
            drafter/rule combination that cannot work.
    Example:
        >>> out = mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=64, **tok(text, return_tensors="pt"))
        >>> out.stats.mean_accepted_length
    """
    adapter = target if hasattr(target, "prefill") else TransformersTarget(target)
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    if eos_token_id is None:
        eos = getattr(adapter, "eos_token_ids", [])
    else:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    state, stats = speculative_decode(
        adapter,
        model_inputs,
        resolve_drafter(drafter, adapter, num_draft_tokens),
        sampling,
        max_new_tokens,
        eos_token_ids=eos,
        generator=make_generator(seed, adapter.device),
        acceptance=acceptance,
        rule_kwargs=rule_kwargs,
    )
    return GenerateOutput(sequences=state.tokens, stats=stats)


def chat_inputs(tokenizer, prompt: str, raw: bool = False) -> dict[str, torch.Tensor]:
    """Tokenise a user message ([1, L] tensors), wrapped in the chat template unless ``raw``."""
    if not prompt.strip():
        raise ValueError("the prompt is empty; give the text to respond to")
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
