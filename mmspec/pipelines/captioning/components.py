"""The parts of an image-captioning model, loaded once: :class:`CaptioningComponents` (the VLM
and its processor, any family of :data:`~mmspec.adapters.hf.VLM_FAMILIES`, as the core's target),
the draft model loader, and the prompt helpers that keep the processor's image slots apart from
the user's text."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ...adapters.hf import VLM_FAMILIES, CapturedTransformersTarget, TransformersTarget
from ...hub import (ALIASES as TEXT_MODELS, cannot_load, check_model_path, damaged_weights, is_remote_code_refusal, mismatched_weights,
                    model_kind_error, remote_code_refused, weights_unreadable)


#: inserted after the first character of an image token in a prompt: invisible, and the processor
#: no longer finds the token there (U+2060 WORD JOINER)
WORD_JOINER = "\u2060"


def image_token_strings(processor: Any, image_token_id: int | None = None) -> list[str]:
    """The strings a VLM processor expands or counts as image slots (``<image>``, ``[IMG]``,
    ``<start_of_image>``, ``<image_soft_token>``, ``<fake_token_around_image>``, ...): the image /
    video ``*_token`` attributes of the processor and its tokenizer, and the token of
    ``image_token_id``; longest first."""
    values = set()
    for owner in (processor, getattr(processor, "tokenizer", None)):
        for name in dir(owner) if owner is not None else ():
            if name.endswith("_token") and any(word in name for word in ("image", "img", "video", "boi", "eoi")):
                values.add(getattr(owner, name, None))
    tokenizer = getattr(processor, "tokenizer", processor)
    if image_token_id is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
        values.add(tokenizer.convert_ids_to_tokens(image_token_id))
    return sorted((v for v in values if isinstance(v, str) and len(v) > 1), key=len, reverse=True)


def escape_image_tokens(prompt: str, tokens: Sequence[str]) -> str:
    """``prompt`` with every string of ``tokens`` (:func:`image_token_strings`) broken by an
    invisible character, so a prompt that *mentions* ``<image>`` asks about the one image instead
    of making the processor look for a second (which failed for every image). Other text is unchanged."""
    for token in tokens:
        prompt = prompt.replace(token, token[0] + WORD_JOINER + token[1:])
    return prompt


def no_chat_template(name: str) -> str:
    """The line refusing a VLM whose processor has no chat template (a caption is a chat turn)."""
    return (f"the processor of {name} has no chat template: add the model's template to its directory (chat_template.jinja, "
            "from the model card or the base model it was fine-tuned from), or load the model and processor yourself, set "
            "processor.chat_template and pass both to mmspec.pipeline")


def load_captioning_model(
    name_or_path: str | os.PathLike, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False
) -> tuple[nn.Module, Any]:
    """A local checkpoint directory or hub id -> (VLM in eval mode on ``device``, processor).

    Loaded with ``AutoProcessor`` and ``AutoModelForImageTextToText``, so any family of
    :data:`~mmspec.adapters.hf.VLM_FAMILIES` works (LLaVA-1.5, LLaVA-NeXT, Mistral3/Pixtral,
    Idefics3, SmolVLM, Gemma3, Gemma 4, LLaVA-OneVision, InternVL, Llama-3.2-Vision,
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, LFM2-VL).

    Raises:
        FileNotFoundError: no such directory, or a hub id that cannot be loaded.
        ValueError: the checkpoint is not an image-text-to-text model; a checkpoint with its own
            code (config.json's ``auto_map``) and ``trust_remote_code=False`` (one line saying how
            to allow it).
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    name = str(name_or_path)
    if name in TEXT_MODELS:
        raise ValueError(f"{name!r} is mmspec's built-in text model (mmspec generate --model {name}); captioning takes a "
                         "VLM checkpoint, or no --model for the embedded captioner")
    source = check_model_path(name)
    check_vlm_config(name, source, trust_remote_code)
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
        if getattr(processor, "chat_template", None) is None:  # (every caption is a chat turn: refused before the weights load)
            raise ValueError(no_chat_template(name))
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except weights_unreadable() as error:
        raise damaged_weights(name, error) from None
    except OSError as error:
        raise cannot_load("model", name, error) from None
    except RuntimeError as error:
        raise mismatched_weights(name, error) from None
    except ValueError as error:  # (a processor or model class of its own code, the config's being the library's)
        if is_remote_code_refusal(error):
            raise remote_code_refused(name) from None
        if "Unrecognized configuration class" in str(error):  # (a config of its own code, allowed: not a VLM's)
            raise model_kind_error(name, source, "an image-text-to-text model (a VLM)",
                                   f"a text model goes through mmspec generate --model {name}") from None
        raise
    return model.to(device).eval(), processor


def check_vlm_config(name: str, source: str | os.PathLike, trust_remote_code: bool = False) -> None:
    """Refuse (one ValueError line, before the processor and weights load) a checkpoint whose config
    names a model type that transformers' image-text-to-text models do not cover, e.g. a text LM, or
    whose config is its own code (``auto_map``) while ``trust_remote_code`` is off; a config that
    cannot be read, or one with its own code that is allowed, is left to the loaders. A local
    directory without a config.json (an empty one, a folder of images) is no checkpoint at all."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise ValueError(f"{name!r} holds no model (no config.json); give a VLM checkpoint directory (config.json, the "
                         "weights and the processor's files) or a hub id, or no --model for the embedded captioner")
    try:  # (never trust_remote_code=None: transformers would ask [y/N] on the terminal)
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as error:
        if is_remote_code_refusal(error) and not trust_remote_code:
            raise remote_code_refused(name) from None
        return
    if getattr(config, "auto_map", None) is None and config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise model_kind_error(name, source, "an image-text-to-text model (a VLM)",
                               f"a text model goes through mmspec generate --model {name}")


def load_draft_model(path: str | os.PathLike, device: torch.device, dtype: torch.dtype,
                     trust_remote_code: bool = False) -> nn.Module:
    """A draft model directory -> the model in eval mode: a causal LM (``AutoModelForCausalLM``),
    or a VLM of a supported family (``AutoModelForImageTextToText``); ``trust_remote_code`` as the
    target's (passed to transformers' ``from_pretrained``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        model_type = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "model_type", "")
        auto = AutoModelForImageTextToText if model_type in VLM_FAMILIES else AutoModelForCausalLM
        return auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
    except weights_unreadable() as error:
        raise damaged_weights(path, error) from None
    except ValueError as error:
        if is_remote_code_refusal(error):
            raise remote_code_refused(path) from None
        raise


def check_cuda_graphs(cuda_graphs: bool, device: torch.device) -> None:
    """CUDA graphs need a CUDA device (checked before the model loads)."""
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device, got {device}; pass device='cuda' (--device cuda) or drop "
                         "cuda_graphs (--cuda-graphs)")


@dataclass
class CaptioningComponents:
    """A VLM as the captioning pipeline's components.

    Attributes:
        model: the VLM (eval mode); processor: its processor; tokenizer: the processor's tokenizer.
        target: the model as the core's target (:class:`~mmspec.adapters.hf.TransformersTarget`,
            or :class:`~mmspec.adapters.hf.CapturedTransformersTarget` with CUDA graphs).
        model_dir: the directory that may hold the drafters file (None: none known).
        image_tokens: the processor's image-slot strings (:func:`image_token_strings`).
        eos_token_ids: the ids that end a caption.
    """

    model: nn.Module
    processor: Any
    target: TransformersTarget
    model_dir: Path | None
    tokenizer: Any
    image_tokens: list[str]
    eos_token_ids: list[int]

    @classmethod
    def load(cls, model: str | os.PathLike | nn.Module | None, device: torch.device, dtype: torch.dtype, *,
             processor: Any = None, trust_remote_code: bool = False, cuda_graphs: bool = False) -> "CaptioningComponents":
        """Load (or wrap) a VLM: None for mmspec's embedded captioner, a checkpoint directory or hub
        id, or a loaded model with its ``processor`` (used on its own device and in its own dtype).

        Raises:
            ValueError: a text-only model, a processor that cannot process images, a loaded model
                without its processor.
            FileNotFoundError: the model cannot be found.
        """
        model, processor, model_dir = _load_vlm(model, processor, device, dtype, trust_remote_code)
        target = CapturedTransformersTarget(model) if cuda_graphs else TransformersTarget(model)
        if not target.is_vlm:
            raise ValueError(
                f"{type(model).__name__} is a text-only model; image captioning needs a VLM "
                f"({', '.join(VLM_FAMILIES.values())})"
            )
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(f"the processor {type(processor).__name__} cannot process images")
        tokenizer = getattr(processor, "tokenizer", processor)
        eos = target.eos_token_ids or [tokenizer.eos_token_id]
        return cls(model=model, processor=processor, target=target, model_dir=model_dir, tokenizer=tokenizer,
                   image_tokens=image_token_strings(processor, target.image_token_id),
                   eos_token_ids=[t for t in eos if t is not None])


def _load_vlm(model, processor, device: torch.device, dtype: torch.dtype, trust_remote_code: bool
              ) -> tuple[nn.Module, Any, Path | None]:
    """-> (model, processor, directory that may hold the drafters file)."""
    from ...modeling import captioner

    if model is None:
        model, processor = captioner.load_default_captioner(device=device, dtype=dtype)
        return model, processor, captioner.default_captioner_dir()
    if isinstance(model, (str, os.PathLike)) and captioner.is_captioner_dir(model):  # the embedded kind's folder (its own,
        loaded, processor = captioner.load_default_captioner(device=device, dtype=dtype, directory=model)  # or one trained)
        return loaded, processor, Path(model).expanduser()
    if isinstance(model, nn.Module):
        if processor is None:
            raise ValueError("a loaded model needs its processor: pass processor=AutoProcessor.from_pretrained(...)")
        local = Path(str(getattr(model, "name_or_path", "") or ""))
        return model.eval(), processor, local if str(local) and local.is_dir() else None
    loaded, processor = load_captioning_model(model, device, dtype, trust_remote_code)
    local = Path(str(model)).expanduser()
    return loaded, processor, local if local.is_dir() else None
