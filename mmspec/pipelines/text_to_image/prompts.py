"""What every text-to-image model's components share: the prompt check, the frozen text encoder
(mmspec's own layouts, discrete and continuous, share one per process) and the base class
:class:`ImageComponents`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from ...modeling.fast_linear import OptimizesOnLoad


def check_prompt(prompt: Any) -> None:
    """Refuse an empty prompt (one ValueError line)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("empty prompt: describe the image to generate, e.g. 'a red circle above a blue square'")


@lru_cache(maxsize=2)
def shared_text_encoder(num_layers: int, device: torch.device):
    """One frozen text encoder per (depth, device) and process (pipelines share it), in float32
    whatever the generator's dtype: a prompt's features, so an image, do not depend on whether this
    CPU computes bf16 fast (it was "auto": bf16 on AVX-512-BF16 / AMX CPUs, fp32 elsewhere)."""
    from ...modeling.text_encoder import SmolTextEncoder

    return SmolTextEncoder(num_layers, dtype=torch.float32).to(device)


class ImageComponents(OptimizesOnLoad):
    """What :class:`~mmspec.pipelines.text_to_image.components.T2IComponents` and
    :class:`~mmspec.pipelines.text_to_image.mar_components.MARComponents` share: a ``target`` whose
    ``model`` is the generator, and ``encode`` (prompt -> the target's model inputs)."""

    @property
    def generator(self) -> torch.nn.Module:
        """The generator model itself, ``target.model`` (mmspec's LlamaGenModel or MARModel, or the transformers model)."""
        return self.target.model

    def prompt_inputs(self, prompt: str, warn_cut: bool = True) -> dict[str, Any]:
        """prompt -> the target's model inputs (caption features, or prompt ids), without guidance.
        ``warn_cut=False``: no UserWarning for a prompt longer than the text encoder's positions
        (mmspec's own layouts, whose encoder cuts it; a training recipe's long scene descriptions,
        cut knowingly); a transformers model's processor cuts nothing, and takes no such flag."""
        check_prompt(prompt)
        return self.encode(prompt) if warn_cut else self.encode(prompt, warn_cut=False)
