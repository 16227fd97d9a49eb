"""What every text-to-image model's components share: the prompt check and the frozen text
encoder (mmspec's own layouts, discrete and continuous, share one per process)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch


def check_prompt(prompt: Any) -> None:
    """Refuse an empty prompt (one ValueError line)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("empty prompt: describe the image to generate, e.g. 'a red circle above a blue square'")


@lru_cache(maxsize=2)
def shared_text_encoder(num_layers: int, device: torch.device):
    """One frozen text encoder per (depth, device) and process (pipelines share it)."""
    from ...modeling.text_encoder import SmolTextEncoder

    return SmolTextEncoder(num_layers).to(device)

