"""Low-rank adapters (LoRA, Hu et al., 2021) for a frozen decoder, trained and then merged.

    y = W x + (alpha / r) B A x        A [r, in] (random), B [out, r] (zeros at the start)

Training wraps the chosen nn.Linear children of one model instance in :class:`LoRALinear`
(the model's classes are untouched). What ships is only A and B per layer
(``...q_proj.lora_a`` / ``.lora_b``) with the scale in the file's metadata; loading adds
``scale * B @ A`` into the plain weights (:func:`merge_lora_state`), so the assembled model is an
ordinary transformers model again.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: the projections of a Llama-family decoder layer that get adapters
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE_KEY = "lora_scale"


class LoRALinear(nn.Module):
    """``base`` (frozen) plus a trainable rank-``rank`` update scaled by alpha / rank."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def add_lora(module: nn.Module, rank: int, alpha: float, targets=LORA_TARGETS) -> int:
    """Wrap every nn.Linear child named in ``targets`` under ``module`` -> number wrapped."""
    wrapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, rank, alpha))
                wrapped += 1
    return wrapped


def lora_state(model: nn.Module, prefix_filter: str = "") -> dict[str, torch.Tensor]:
    """The adapters' tensors, named as in ``model`` (``...q_proj.lora_a``)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" in k and k.startswith(prefix_filter)}


def lora_scale(model: nn.Module) -> float | None:
    scales = {m.scale for m in model.modules() if isinstance(m, LoRALinear)}
    if len(scales) > 1:
        raise ValueError(f"adapters with different scales {sorted(scales)}")
    return scales.pop() if scales else None


def merge_lora_state(model: nn.Module, state: dict[str, torch.Tensor], scale: float) -> int:
    """Add ``scale * B @ A`` of each adapter in ``state`` into the matching plain nn.Linear of
    ``model`` (names without ``.lora_a``/``.lora_b`` + ``.weight``) -> number merged."""
    modules = dict(model.named_modules())
    merged = 0
    for key in [k for k in state if k.endswith(".lora_a")]:
        name = key.removesuffix(".lora_a")
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"no linear layer {name!r} to merge the adapter {key!r} into")
        a, b = state[key].float(), state[name + ".lora_b"].float()
        with torch.no_grad():
            linear.weight.add_((scale * b @ a).to(linear.weight.dtype))
        merged += 1
    return merged
