"""Saving and loading mmspec's own model classes: a JSON config (a dataclass) + safetensors weights."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn


def save_model(model: nn.Module, config, directory: str | Path, config_file: str, weights_file: str, dtype: torch.dtype) -> None:
    """Write ``config`` (a dataclass) as JSON and the state dict in ``dtype`` as safetensors."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / config_file).write_text(json.dumps(asdict(config), indent=1))
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}, directory / weights_file)
    (directory / weights_file).chmod(0o644)  # safetensors writes owner-only files


def load_model(cls, config_cls, directory: str | Path, config_file: str, weights_file: str, dtype: torch.dtype, what: str):
    """``cls(config_cls(**config))`` with the saved weights, in ``dtype`` and eval mode."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / config_file).exists():
        raise FileNotFoundError(f"{directory} has no {config_file}; is it an mmspec {what} directory?")
    model = cls(config_cls(**json.loads((directory / config_file).read_text())))
    model.load_state_dict(load_file(directory / weights_file))
    return model.to(dtype).eval()
