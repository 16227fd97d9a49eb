"""Trained drafters shipped in ``models/`` for mmspec's embedded models, found by name.

``drafter="eagle2"`` (no path) on SmolLM2-135M-Instruct or on the embedded captioner loads the
head trained for it: ``models/<model>-<kind>``, where the captioner (whose decoder *is* SmolLM2)
falls back to the SmolLM2 head when it has no fine-tuned one of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..adapters.hf import text_decoder
from ..core.drafter import DRAFTERS

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


def shipped_drafter_dir(model: nn.Module, kind: str, marker: str, spec: str | None = None, train: str | None = None,
                        instead: str | None = None) -> Path:
    """The directory of the shipped ``kind`` drafter for ``model`` (holding file ``marker``);
    ``spec`` is the drafter name the user gave (default ``kind``) and ``train`` the command that
    trains one (default ``mmspec train drafter --method KIND``), for the error message; ``instead``
    (what ``spec:PATH`` takes, for a model mmspec ships nothing for) replaces the training command there.

    Raises:
        ValueError: the model is not one of mmspec's embedded models, or nothing is shipped for it.
    """
    from ..hub import models_dir, no_models_note

    names = embedded_names(model)
    for name in names:
        directory = models_dir() / f"{name}-{kind}"
        if (directory / marker).is_file():
            return directory
    name, train = spec or kind, train or f"mmspec train drafter --method {kind}"
    if names:  # an embedded model whose drafter is missing (an install without models/, or one deleted)
        raise ValueError(no_models_note() or
                         f"no trained {name} drafter for {type(model).__name__} (models/{names[0]}-{kind} not found); pass "
                         f"drafter='{name}:PATH' with a trained one (`{train}`)")
    instead = instead or f"one trained for this model (`{train}`)"
    raise ValueError(f"no trained {name} drafter ships for {type(model).__name__} (mmspec ships them for its embedded models "
                     f"only); pass drafter='{name}:PATH' with {instead}")


def check_drafter_dir(name: str, argument: str | None) -> None:
    """Drafter ``name``'s trained directory ``argument`` checked before any model loads: it exists
    and holds one of the drafter's :attr:`~mmspec.core.drafter.Drafter.saved_layouts` (a directory
    holding another kind's files is named so). Nothing to check without an argument (the drafter
    shipped for the model is looked up once the model is known) or for a drafter without a directory.

    Raises:
        FileNotFoundError: no such directory. ValueError: a directory without the drafter's files.
    """
    layouts = DRAFTERS[name].saved_layouts
    if argument is None or not layouts:
        return
    path = Path(argument).expanduser()
    if not path.is_dir():
        train = DRAFTERS[name].trained_by or f"mmspec train drafter --method {name}"
        raise FileNotFoundError(f"{name}:{argument}: no such directory (give the directory of a trained {name} drafter; "
                                f"train it with `{train}`)")
    if DRAFTERS[name].holds_saved(path):
        return
    holds = sorted(other for other, cls in DRAFTERS.items()
                   if cls.image_tokens_only == DRAFTERS[name].image_tokens_only and cls.holds_saved(path))
    wanted = " or ".join(" + ".join(layout) for layout in layouts)
    hint = f"; it holds what {' / '.join(holds)} reads: use '{holds[0]}:{argument}'" if holds else ""
    raise ValueError(f"{argument} holds no {name} drafter ({wanted} missing){hint}")


#: a chain drafter's tuned settings, beside its head: per dtype of the target, per kind of
#: generation (each part optional), and what each was measured on:
#: {"bfloat16": {"greedy": {"num_draft_tokens": K, "stop_below": P}, "sampled": {...}}, "float32": {...},
#:  "measured": {"bfloat16": {"greedy": {...}}, ...}}
CHAIN_SETTINGS_FILE = "chain_settings.json"
#: the dtypes a chain_settings.json may hold settings for
SETTINGS_DTYPES = ("bfloat16", "float16", "float32")


def check_stop_below(value: float, name: str = "stop_below") -> float:
    """A chain drafter's confidence stop ``name`` (:func:`mmspec.core.draft.chain_stops`), checked:
    a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r}: give a number in [0, 1) (0 drafts the whole chain every step)")
    return float(value)


def chain_settings(directory: str | Path, num_draft_tokens: int | None = None, dtype: str | None = None) -> dict:
    """The keyword arguments of :class:`~mmspec.drafters.eagle.EagleDrafter` that the head's
    ``chain_settings.json`` gives for a target of ``dtype`` ("bfloat16"; see
    :data:`CHAIN_SETTINGS_FILE`): ``num_draft_tokens`` (the sampled chains' K),
    ``greedy_draft_tokens``, ``stop_below``, ``sampled_stop_below``; {} without the file or a part
    for that dtype (what a verified row costs differs most between dtypes: on an AVX2 CPU in
    float32 the captioner's bf16 settings measured slower than none, docs/drafters.md). A
    ``num_draft_tokens`` the user gave sets K for both kinds. Every part is checked, whatever the dtype.

    Raises:
        ValueError: a file that is not such a mapping.
    """
    path = Path(directory) / CHAIN_SETTINGS_FILE
    if not path.is_file():
        return {}
    problem = (f"{path} must map a dtype ({', '.join(SETTINGS_DTYPES)}) to greedy / sampled parts of num_draft_tokens "
               "(an integer >= 1) and stop_below (a number in [0, 1)); fix or delete it")
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not readable JSON ({error}); fix or delete it") from None
    if not isinstance(saved, dict) or set(saved) - {*SETTINGS_DTYPES, "measured"}:
        raise ValueError(problem)
    found = {}
    for name in SETTINGS_DTYPES:
        section = saved.get(name, {})
        if not isinstance(section, dict) or set(section) - {"greedy", "sampled"}:
            raise ValueError(problem)
        found[name] = {}
        for kind, length, stop in (("greedy", "greedy_draft_tokens", "stop_below"), ("sampled", "num_draft_tokens", "sampled_stop_below")):
            part = section.get(kind, {})
            k = part.get("num_draft_tokens", 1) if isinstance(part, dict) else None
            if (not isinstance(part, dict) or set(part) - {"num_draft_tokens", "stop_below"} or not isinstance(k, int)
                    or isinstance(k, bool) or k < 1):
                raise ValueError(problem)
            try:
                found[name][stop] = check_stop_below(part.get("stop_below", 0.0))
            except ValueError:
                raise ValueError(problem) from None
            if "num_draft_tokens" in part and num_draft_tokens is None:
                found[name][length] = k
    settings = {key: value for key, value in found[dtype].items() if value} if dtype in saved else {}
    if num_draft_tokens is not None:
        settings["num_draft_tokens"] = num_draft_tokens
    return settings
