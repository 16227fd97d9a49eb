"""Logits -> probabilities, in one place for draft and target.

Speculative sampling is exact only if the draft distribution q and the target distribution p are
produced by the *same* transform of their logits (temperature, top-k, top-p, classifier-free
guidance). Everything in mmspec that turns logits into probabilities goes through
:func:`logits_to_probs`, and everything that draws a token goes through :func:`sample_from_probs`
with a uniform passed in, so the acceptance rules stay pure functions of their random numbers.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution.

    Args:
        do_sample: False means greedy decoding (argmax; the remaining fields are ignored).
        temperature: divides the logits; must be > 0 when sampling.
        top_k: keep the k most likely tokens (None or 0: all).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (None or 1.0: all).
        guidance_scale: classifier-free guidance g for models that run a conditional and an
            unconditional half: logits = u + g (c - u) (see :func:`cfg_combine`). None: no CFG.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    guidance_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "guidance_scale"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number (got {value!r})")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral)):
            raise ValueError(f"top_k must be an integer (got {self.top_k!r})")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when sampling (got {self.temperature}); "
                "use do_sample=False for greedy decoding"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.guidance_scale is not None and self.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (got {self.guidance_scale})")


def cfg_combine(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: logits = u + g (c - u) (Ho & Salimans 2022).

    Args:
        cond_logits, uncond_logits: [..., V] logits of the conditional and unconditional halves.
        guidance_scale: g >= 1.
    """
    return uncond_logits + guidance_scale * (cond_logits - uncond_logits)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Turn logits [..., V] into probabilities [..., V] (float32) with temperature, top-k and top-p.

    Order as in transformers' logits processors: temperature, then top-k, then top-p.
    For ``do_sample=False`` the result is the one-hot distribution of the argmax, so greedy
    decoding is speculative sampling with a point-mass target.
    """
    if not config.do_sample:  # (max: argmax's first-of-ties index, faster on CPUs; see verify.exact_argmax)
        return torch.nn.functional.one_hot(logits.max(-1).indices, logits.shape[-1]).float()
    logits = logits.float()
    if config.temperature != 1.0:
        logits = logits / config.temperature
    if config.top_k:
        k = min(config.top_k, logits.shape[-1])
        kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1.0 - config.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row by inversion of the CDF.

    Args:
        probs: [..., V] non-negative weights (need not be normalised).
        uniforms: [...] numbers in [0, 1), one per row.
    Returns:
        LongTensor [...]: the smallest index i with cdf(i) > u * total. Zero-weight tokens are
        never returned (their cdf step is empty).
    """
    cdf = probs.double().cumsum(-1)
    threshold = (uniforms.double() * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)
