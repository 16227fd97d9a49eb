"""Saving and loading mmspec's own model classes: a JSON config + safetensors weights.

:func:`save_module` / :func:`read_config` / :func:`load_weights` are the one implementation every
mmspec model and draft head uses; :func:`save_model` / :func:`load_model` wrap them for classes
whose config is a dataclass.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn


def save_module(module: nn.Module, directory: str | Path, config: dict[str, Any], config_file: str, weights_file: str,
                dtype: torch.dtype | None = None) -> None:
    """Write ``config`` as JSON and the state dict (cast to ``dtype`` unless None) as safetensors,
    both readable by everyone."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach() if dtype is None else v.detach().to(dtype)).contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(directory / weights_file))
    (directory / weights_file).chmod(0o644)  # safetensors writes owner-only files
    (directory / config_file).write_text(json.dumps(config, indent=1))


def read_config(directory: str | Path, config_file: str, missing: str) -> dict[str, Any]:
    """The JSON config saved by :func:`save_module`.

    Raises:
        FileNotFoundError: with the message ``missing`` when ``directory`` has no ``config_file``.
    """
    path = Path(directory) / config_file
    if not path.is_file():
        raise FileNotFoundError(missing)
    return json.loads(path.read_text())


def load_weights(module: nn.Module, directory: str | Path, weights_file: str, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """Load the weights saved by :func:`save_module` into ``module``; moved to ``device`` /
    ``dtype`` (None: kept) and put in eval mode."""
    from safetensors.torch import load_file

    module.load_state_dict(load_file(str(Path(directory) / weights_file)))
    return module.to(device=device, dtype=dtype).eval()


def save_model(model: nn.Module, config, directory: str | Path, config_file: str, weights_file: str, dtype: torch.dtype) -> None:
    """Write ``config`` (a dataclass) as JSON and the state dict in ``dtype`` as safetensors."""
    save_module(model, directory, asdict(config), config_file, weights_file, dtype)


def load_model(cls, config_cls, directory: str | Path, config_file: str, weights_file: str, dtype: torch.dtype, what: str):
    """``cls(config_cls(**config))`` with the saved weights, in ``dtype`` and eval mode."""
    config = read_config(directory, config_file, f"{directory} has no {config_file}; is it an mmspec {what} directory?")
    return load_weights(cls(config_cls(**config)), directory, weights_file, dtype=dtype)
