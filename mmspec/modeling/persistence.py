"""Saving and loading mmspec's own model classes: a JSON config + safetensors weights.

:func:`save_module` / :func:`read_config` / :func:`load_weights` are the one implementation every
mmspec model and draft head uses; :class:`DataclassModel` wraps them for models whose config is a
dataclass.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` as a safetensors file readable by everyone, as the process's other files
    are (safetensors itself creates it owner-only, which a serving engine run as another user
    could not read)."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
    return path


def save_module(module: nn.Module, directory: str | Path, config: dict[str, Any], config_file: str, weights_file: str,
                dtype: torch.dtype | None = None) -> None:
    """Write ``config`` as JSON and the state dict (cast to ``dtype`` unless None) as safetensors,
    both readable by everyone."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach() if dtype is None else v.detach().to(dtype)).contiguous() for k, v in module.state_dict().items()}
    save_tensors(tensors, directory / weights_file)
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

    from ..hub import damaged_weights, weights_unreadable

    try:
        module.load_state_dict(load_file(str(Path(directory) / weights_file)))
    except weights_unreadable() as error:
        raise damaged_weights(Path(directory) / weights_file, error) from None
    except RuntimeError as error:  # (missing / unexpected keys, shapes: torch's many-line report)
        first = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
        raise ValueError(f"the weights in {Path(directory) / weights_file} do not fit the {type(module).__name__} their "
                         f"config and this model make (trained for another model?): {first}") from None
    return module.to(device=device, dtype=dtype).eval()


class DataclassModel:
    """``save`` / ``from_pretrained`` for an ``nn.Module`` built as ``cls(config)`` from a dataclass
    config (mix in before ``nn.Module``). Subclasses set ``config_class``, ``config_file``,
    ``weights_file``, ``kind`` (for messages) and the default dtypes."""

    config_class: ClassVar[type]
    config_file: ClassVar[str]
    weights_file: ClassVar[str]
    kind: ClassVar[str]
    save_dtype: ClassVar[torch.dtype] = torch.bfloat16
    load_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the config as JSON and the weights in ``dtype`` (default ``save_dtype``)."""
        save_module(self, directory, asdict(self.config), self.config_file, self.weights_file, dtype or self.save_dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None):
        """The model saved by :meth:`save`, in ``dtype`` (default ``load_dtype``) and eval mode."""
        config = read_config(directory, cls.config_file,
                             f"{directory} has no {cls.config_file}; is it an mmspec {cls.kind} directory?")
        return load_weights(cls(cls.config_class(**config)), directory, cls.weights_file, dtype=dtype or cls.load_dtype)
