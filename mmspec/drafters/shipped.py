"""Trained drafters shipped in ``models/`` for mmspec's embedded models, found by name.

``drafter="eagle2"`` (no path) on SmolLM2-135M-Instruct or on the embedded captioner loads the
head trained for it: ``models/<model>-<kind>``, where the captioner (whose decoder *is* SmolLM2)
falls back to the SmolLM2 head when it has no fine-tuned one of its own.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..adapters.hf import text_decoder

#: (model_type, text width, layers, vocabulary) -> names under models/, most specific first
EMBEDDED = {
    ("llama", 576, 30, 49152): ("smollm2",),
    ("smolvlm", 576, 30, 49155): ("smolcap", "smollm2"),
}


def embedded_names(model: nn.Module) -> tuple[str, ...]:
    """The ``models/`` prefixes that may hold drafters for ``model`` (empty for other models)."""
    config = text_decoder(model).config
    key = (model.config.model_type, config.hidden_size, config.num_hidden_layers, model.get_output_embeddings().weight.shape[0])
    return EMBEDDED.get(key, ())


def shipped_drafter_dir(model: nn.Module, kind: str, marker: str, spec: str | None = None, train: str | None = None) -> Path:
    """The directory of the shipped ``kind`` drafter for ``model`` (holding file ``marker``);
    ``spec`` is the drafter name the user gave (default ``kind``) and ``train`` the command that
    trains one (default ``mmspec train drafter --method KIND``), for the error message.

    Raises:
        ValueError: the model is not one of mmspec's embedded models, or nothing is shipped for it.
    """
    from ..hub import models_dir

    names = embedded_names(model)
    for name in names:
        directory = models_dir() / f"{name}-{kind}"
        if (directory / marker).is_file():
            return directory
    where = f"models/{names[0]}-{kind}" if names else f"a trained {kind} drafter"
    raise ValueError(
        f"no trained {kind} drafter for {type(model).__name__} ({where} not found); pass drafter='{spec or kind}:PATH' "
        f"with a trained one (`{train or f'mmspec train drafter --method {kind}'}`)"
    )
