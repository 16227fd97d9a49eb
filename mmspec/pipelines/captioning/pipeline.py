"""Image captioning / VQA with speculative decoding: ``mmspec.pipeline("image-captioning")``.

The pipeline only composes: load a VLM and its processor, turn (image, prompt) into the
processor's model inputs, decode with :func:`mmspec.generate`, detokenise. With
``compare_baseline=True`` plain AR decoding runs in the same call (after a short warm-up), so
``stats.speedup`` compares like with like.

A call can follow and steer its rows while they decode (:class:`CaptionStream`: each row's text
as each verification step accepts it, rows cancelled between steps, rows joining a running batch),
and an item can be a :class:`Conversation` (system / user / assistant turns over several images,
through the processor's chat template) instead of an image.

``drafter="auto"`` reads the model's table of benchmarked drafters
(:mod:`mmspec.pipelines.captioning.auto_drafter`); a drafter path in the file, alone or as a
spec's argument ("eagle:../smolcap-eagle-t1"), is relative to the model directory. The choice and
why are recorded in ``pipeline.chosen_drafter`` / ``pipeline.drafter_reason`` and in every
result's ``stats.config["drafter"]`` / ``stats.config["drafter_choice"]``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...api import generate, generate_rows, optimize_components
from ...core.arguments import check_argument_types
from ...core.batch import RowResult, row_drafter
from ...core.stats import DictAccess, SpecStats
from ...core.target import RowTarget, batch_size_one_reason
from ...drafters import NO_DRAFTER, Drafter, check_draft_length_use, resolve_drafter
from ...drafters.model import check_draft_vocabulary, config_vocab_size
from ...hub import dtype_name, resolve_device, resolve_dtype
from ..base import Pipeline, ProgressCallback, register_pipeline
from ..images import ImageInput, check_image, load_image
from .auto_drafter import choose_auto_drafter, choose_batch_drafter, choose_sampling_drafter
from .components import CaptioningComponents, check_cuda_graphs, escape_image_tokens, load_draft_model, no_chat_template
from .methods import METHODS, check_drafter_name, check_tree_drafter, is_caption_spec, make_caption_method

DEFAULT_PROMPT = "Describe the image."


@dataclass
class CaptionOutput(DictAccess):
    """One caption.

    Attributes:
        text: the caption (new tokens decoded without special tokens, stripped).
        stats: the speculative generation's SpecStats; ``stats.speedup`` is set when a baseline
            ran, ``stats.config["drafter"]`` names the drafter used.
        baseline_text: plain AR decoding's caption (None unless ``compare_baseline``).
        baseline_stats: plain AR decoding's SpecStats (None unless ``compare_baseline``).
        identical_to_baseline: whether the two token sequences are equal (None unless
            ``compare_baseline``; True for greedy decoding, up to float rounding in bf16).
        prompt: the user prompt the caption answers (a Conversation's last user text).
        prompt_tokens: the model's prompt length in tokens (image tokens included).
        ended_with_eos: whether the caption ended on one of the model's end tokens (False: it
            used up ``max_new_tokens``, or a stream cancelled it), so whether the budget cut it.
    """

    text: str
    stats: SpecStats
    baseline_text: str | None = None
    baseline_stats: SpecStats | None = None
    identical_to_baseline: bool | None = None
    prompt: str = DEFAULT_PROMPT
    prompt_tokens: int | None = None
    ended_with_eos: bool = False

    @property
    def cancelled(self) -> bool:
        """Whether a :class:`CaptionStream` stopped this caption before its end (``text`` holds what came)."""
        return bool(self.stats.config.get("cancelled", False))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the stats become dicts (with tau, acceptance rate, tokens/s)."""
        return {
            "text": self.text,
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
            "baseline_text": self.baseline_text,
            "baseline_stats": self.baseline_stats.to_dict() if self.baseline_stats is not None else None,
            "identical_to_baseline": self.identical_to_baseline,
            "ended_with_eos": self.ended_with_eos,
        }


#: the roles a :class:`Conversation` may use
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    """A chat about one or more images, as one item of a captioning call: the answer is the
    assistant's next turn.

    Attributes:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str | [part, ...]}]`` with
            parts ``{"type": "text", "text": str}`` and ``{"type": "image"}`` (transformers' chat
            shape); the last message is the user's. Rendered by the processor's chat template.
        images: one image (a PIL image, path or array) per image part, in order; at least one.
    Raises:
        ValueError: another role, a last message that is not the user's, a part of another type,
            image parts and images that do not match in number, no image, no text at all.
    Example:
        >>> cap(Conversation([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
        ...                   {"type": "text", "text": "What differs?"}]}], [first, second]))
    """

    messages: list[dict[str, Any]]
    images: list[Any]

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("a Conversation needs a non-empty list of messages")
        images = 0
        for i, message in enumerate(self.messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in CHAT_ROLES:
                raise ValueError(f"message {i} has role {role!r}; use one of {', '.join(CHAT_ROLES)}")
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list):
                raise ValueError(f"message {i}'s content must be a string or a list of text / image parts")
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    if role != "user":
                        raise ValueError(f"message {i} ({role}) has an image; images go in user messages")
                    images += 1
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"message {i} has a part {part!r}; parts are {{'type': 'text', 'text': ...}} or {{'type': 'image'}}")
        if self.messages[-1].get("role") != "user":
            raise ValueError("the last message must be the user's (the answer is the assistant's next turn)")
        if not isinstance(self.images, (list, tuple)) or images != len(self.images) or not images:
            raise ValueError(f"the messages have {images} image part(s) for {len(self.images) if isinstance(self.images, (list, tuple)) else '?'} "
                             "image(s); give one image per {'type': 'image'} part, at least one")
        if not self.prompt.strip() and not any(isinstance(m.get("content"), str) and m["content"].strip() for m in self.messages):
            raise ValueError("the conversation has no text; ask something about the image(s)")

    @property
    def prompt(self) -> str:
        """The last user message's text (what the answer answers)."""
        content = self.messages[-1]["content"]
        if isinstance(content, str):
            return content
        return "\n".join(part["text"] for part in content if part.get("type") == "text")

    def escaped(self, image_tokens: Sequence[str]) -> list[dict[str, Any]]:
        """The messages with every text's image-token strings escaped (:func:`escape_image_tokens`)
        and string contents as one text part (how chat templates take images beside text)."""
        out = []
        for message in self.messages:
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            out.append({"role": message["role"], "content": [
                {"type": "text", "text": escape_image_tokens(part["text"], image_tokens)} if part["type"] == "text"
                else {"type": "image"} for part in parts]})
        return out


class CaptionStream:
    """Follows and steers a captioning call while it decodes (what a server gives each call);
    override what you need. Row indices are the items' positions in the call, then joined items'.

    Attributes:
        admits: whether :meth:`more` may hand over items; the call then decodes through the
            batched path even for one item (so that rows can join it).
    """

    admits: bool = False

    def text(self, index: int, piece: str) -> None:
        """Row ``index``'s new text after a verification step (the pieces, joined, are its final
        ``text``; a step whose tokens end inside a character or in spaces sends them later)."""

    def done(self, index: int, output: "CaptionOutput") -> None:
        """Row ``index`` finished (or was cancelled): its output, before the call returns."""

    def cancelled(self, index: int) -> bool:
        """True takes row ``index`` out before its next step (its output holds the text so far)."""
        return False

    def more(self) -> list[Any]:
        """Items (images or Conversations) that join the running batch now (continuous batching;
        asked before every step while :attr:`admits`); each is indexed after every row so far."""
        return []

    def error(self, index: int, error: Exception) -> None:
        """A joined item ``index`` that could not be prepared (a bad image): it does not run."""


class TextPieces:
    """A row's text as its tokens come: each :meth:`push` returns the new text since the last one,
    such that the pieces joined equal the whole tokens' ``decode(...).strip()``. Text that may still
    change is held back: trailing spaces (stripped at the end), a character cut in the middle
    (U+FFFD), anything that is not an extension of what was sent."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.tokens, self.sent = decode, [], ""

    def push(self, tokens: Sequence[int]) -> str:
        self.tokens += list(tokens)
        text = self.decode(self.tokens).strip()
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def finish(self, final: str) -> str:
        """What is left of ``final`` (the row's whole text) after the pieces sent."""
        piece = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent = final
        return piece


def check_prompt(prompt: str) -> str:
    """Raise ValueError for an empty or whitespace-only prompt (TypeError for another type);
    return it unchanged otherwise."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {prompt!r} ({type(prompt).__name__})")
    if not prompt.strip():
        raise ValueError(f"the prompt is empty ({prompt!r}); give the question or instruction about the image")
    return prompt


@register_pipeline
class ImageCaptioningPipeline(Pipeline):
    """Caption images (or answer a question about them) with speculative decoding.

    Args:
        model: None for mmspec's embedded default captioner; a local checkpoint directory or hub id
            of a VLM (any family of docs/families.md: LLaVA, Pixtral, Idefics3, SmolVLM, Gemma 3 / 4, Qwen-VL, Qwen3.5, ...); or a
            loaded transformers VLM (then pass ``processor`` too; it is used as it is, on its own
            device and in its own dtype).
        drafter: "auto" (see the module doc), a spec ("prompt-lookup[:K]", "layer-skip:N", "ar"),
            the path of a draft model directory, a loaded draft model, or a
            :class:`~mmspec.drafters.Drafter`.
        device: "auto" (CUDA if available, else CPU), "cpu", "cuda", "cuda:N".
        dtype: "auto" (bfloat16 where it is fast: GPUs, CPUs with AMX; else float32), "bf16", "fp16", "fp32" or a torch.dtype. Use fp32 for token-exact
            comparison with plain decoding.
        processor: the processor of a loaded ``model`` (ignored otherwise).
        prompt: the prompt used when a call gives none.
        num_draft_tokens: K, overriding the drafter's default.
        trust_remote_code: passed to transformers' ``from_pretrained`` of the model and of a draft
            model directory (off by default; ``mmspec caption --trust-remote-code``).
        optimize: replace the fp32 CPU linears of the model and its drafter by few-row linears
            (:func:`mmspec.optimize`; outputs unchanged up to fp32 rounding, a verification over a
            few tokens much cheaper); stats.config["linears"] says which kernel ran. False opts out.
            A loaded ``model`` passed in is left as it is (call :func:`mmspec.optimize` on it).
        cuda_graphs: run the target's forwards as CUDA graphs, one per padded forward size
            (:class:`~mmspec.adapters.hf.CapturedTransformersTarget`: a VLM over a Llama decoder, a
            CUDA device, one image at a time); ``stats.config["cuda_graphs"]`` says whether it ran.
    Raises:
        ValueError: an unsupported model, an unknown drafter, an invalid drafters file.
        FileNotFoundError: the model or draft model cannot be found.
    Example:
        >>> cap = mmspec.pipeline("image-captioning", model="path/to/llava-1.5-7b-hf")
        >>> r = cap("photo.jpg", compare_baseline=True)
        >>> print(r.text, r.stats.speedup)
    """

    task = "image-captioning"
    methods = METHODS

    def __init__(
        self,
        model: str | os.PathLike | nn.Module | None = None,
        drafter: Any = "auto",
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        *,
        processor: Any = None,
        prompt: str = DEFAULT_PROMPT,
        num_draft_tokens: int | None = None,
        trust_remote_code: bool = False,
        optimize: bool = True,
        cuda_graphs: bool = False,
    ) -> None:
        # every argument checked before the model loads
        self.check_arguments(dict(model=model, prompt=prompt, drafter=drafter, device=device, dtype=dtype,
                                  cuda_graphs=cuda_graphs, num_draft_tokens=num_draft_tokens,
                                  trust_remote_code=trust_remote_code, optimize=optimize))
        self.default_prompt = check_prompt(prompt)
        self.trust_remote_code = trust_remote_code  # (a draft model directory loads with the target's setting)
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        check_cuda_graphs(cuda_graphs, self.device)
        self.components = CaptioningComponents.load(model, self.device, self.dtype, processor=processor,
                                                    trust_remote_code=trust_remote_code, cuda_graphs=cuda_graphs)
        c = self.components  # its parts as the pipeline's attributes, as before
        self.model, self.processor, self.model_dir, self.target = c.model, c.processor, c.model_dir, c.target
        self.tokenizer, self.image_tokens, self.eos_token_ids = c.tokenizer, c.image_tokens, c.eos_token_ids
        self.auto = isinstance(drafter, str) and drafter == "auto"
        self._auto_drafters: dict[tuple, tuple] = {}  # drafter="auto": the drafter per drafters-file choice (spec, K)
        self.drafter, self.chosen_drafter, self.drafter_reason = self.resolve_drafter(drafter, num_draft_tokens)
        # a model the pipeline loaded (a loaded one passed in is the caller's: mmspec.optimize(model) does it)
        self.optimization = optimize_components(self.model, self.drafter) if optimize and not isinstance(model, nn.Module) else None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound) without loading anything
        (presets): the drafter name (and no draft length with plain decoding), the prompt, dtype
        and device. Raises ValueError / FileNotFoundError."""
        # (trust_remote_code="False", a string, read as True would run the checkpoint's code)
        check_argument_types(cls.__init__, {name: values[name] for name in ("trust_remote_code", "cuda_graphs", "optimize")
                                            if name in values})
        check_prompt(values["prompt"])
        k = values.get("num_draft_tokens")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_draft_tokens must be a positive integer or None (the drafter's own), got {k!r}")
        check_draft_length_use(values["drafter"], k)
        if isinstance(values["drafter"], (str, os.PathLike)):
            draft_dir = check_drafter_name(values["drafter"])
            check_tree_drafter(values["model"], values["drafter"], values["trust_remote_code"])
            if draft_dir is not None and isinstance(values["model"], (str, os.PathLike)):  # both configs, no weights
                check_draft_vocabulary(config_vocab_size(draft_dir), config_vocab_size(values["model"]))
        device = resolve_device(values["device"]) if isinstance(values["device"], str) else values["device"]
        resolve_dtype(values["dtype"], device)
        check_cuda_graphs(values["cuda_graphs"], device)

    @property
    def runs_on(self) -> tuple[str, bool]:
        """(device type, CUDA graphs): the way of running a drafters file's speedups depend on."""
        return self.device.type, bool(getattr(self.target, "captured", False))

    def resolve_drafter(self, drafter: Any, num_draft_tokens: int | None = None) -> tuple[Drafter | None, str, str]:
        """-> (the Drafter passed to generate, or None for plain AR; its name; how it was chosen)."""
        reason, auto_key = "given", None
        if isinstance(drafter, str) and drafter == "auto":
            entry, reason = choose_auto_drafter(self.model_dir, self.runs_on)
            drafter = self._table_spec(entry["drafter"])
            if num_draft_tokens is None:
                num_draft_tokens = entry.get("num_draft_tokens")
            auto_key = entry["drafter"], num_draft_tokens
        name = drafter.name if isinstance(drafter, Drafter) else str(drafter)
        if drafter in NO_DRAFTER:
            name = "ar"
        elif is_caption_spec(drafter):  # checked, then the drafter registry's short form
            if auto_key is not None:
                name = auto_key[0]  # the file's spec, its path as written there (relative to the model)
            drafter = make_caption_method(drafter).drafter_spec()
        elif isinstance(drafter, (str, os.PathLike)):
            path = check_drafter_name(drafter)
            name = f"draft model {drafter}"
            check_draft_vocabulary(config_vocab_size(path), self.target.vocab_size)  # (before its weights load)
            drafter = load_draft_model(path, self.model.device, self.model.dtype, self.trust_remote_code)
        elif isinstance(drafter, nn.Module):
            name = f"draft model {getattr(drafter, 'name_or_path', '') or type(drafter).__name__}"
        resolved = resolve_drafter(drafter, self.target, num_draft_tokens)
        if auto_key is not None:  # a batch or sampling choice of the same entry reuses it (_auto_drafter)
            self._auto_drafters[auto_key] = resolved, name
        return resolved, name, reason

    def _table_spec(self, spec: str) -> str:
        """A drafters-file entry with its path (the entry itself, or a spec's argument) made
        relative to the model directory, where that directory holds it."""
        if self.model_dir is None:
            return spec
        if (self.model_dir / spec).is_dir():
            return str(self.model_dir / spec)
        if is_caption_spec(spec):  # "eagle:../dir" or "eagle:path=../dir"
            method = make_caption_method(spec)
            value = method.settings.get(method.argument) if method.argument else None
            if isinstance(value, str) and (self.model_dir / value).is_dir():
                return f"{method.name}:{self.model_dir / value}"
        return spec

    def _auto_drafter(self, choice: tuple[str, int | None, str] | None) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) of a drafters-file choice (spec, K, reason), built once (and
        optimized as the pipeline's own); the pipeline's own drafter when there is no choice."""
        if choice is None:
            return self.drafter, self.chosen_drafter, self.drafter_reason
        spec, k, reason = choice
        if (spec, k) not in self._auto_drafters:
            drafter, name = self._table_drafter(spec, k)
            if self.optimization is not None:
                optimize_components(drafter)
            self._auto_drafters[spec, k] = drafter, name
        drafter, name = self._auto_drafters[spec, k]
        return drafter, name, reason

    def _table_drafter(self, spec: str, k: int | None) -> tuple[Drafter | None, str]:
        """(drafter, name) of a drafters-file entry, built as written there (its path relative to
        the model directory) and named as the file names it, not optimized or kept."""
        resolved = self._table_spec(spec)
        drafter, name, _ = self.resolve_drafter(resolved, k)
        return drafter, name if resolved == spec else spec  # the file's name for a path

    def batch_drafter(self, batch_size: int, do_sample: bool = False) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) for a batch: the pipeline's own, or with drafter="auto" the
        fastest of the drafters file at that batch size (:func:`choose_batch_drafter`) when it
        measured one; else an image alone's choice (a sampled batch: :meth:`sampling_drafter`'s, so
        that a sampled caption does not depend on the batch it falls in)."""
        choice = choose_batch_drafter(self.model_dir, batch_size, self.runs_on, do_sample) if self.auto and batch_size > 1 else None
        if choice is None and do_sample:
            return self.sampling_drafter()
        return self._auto_drafter(choice)

    def sampling_drafter(self) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) for one sampled caption: the pipeline's own, or with
        drafter="auto" the fastest per token at the drafters file's sampled temperature
        (:func:`choose_sampling_drafter`) when it measured one."""
        return self._auto_drafter(choose_sampling_drafter(self.model_dir, self.runs_on) if self.auto else None)

    def auto_choice(self, do_sample: bool = False) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) that ``drafter="auto"`` runs for one caption, greedy or sampled
        (the drafters file's per-token choice where it measured one, as :meth:`sampling_drafter`),
        whatever this pipeline's own drafter: what ``mmspec bench caption --methods auto`` times."""
        choice = choose_sampling_drafter(self.model_dir, self.runs_on) if do_sample else None
        if choice is None:
            return self.resolve_drafter("auto")
        spec, k, reason = choice
        return *self._table_drafter(spec, k), reason

    def drafter_for(self, do_sample: bool, batch_size: int = 1) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) that a call runs: a batch's (:meth:`batch_drafter`), else a sampled
        caption's (:meth:`sampling_drafter`), else the pipeline's own."""
        if batch_size > 1:
            return self.batch_drafter(batch_size, do_sample)
        return self.sampling_drafter() if do_sample else (self.drafter, self.chosen_drafter, self.drafter_reason)

    def check_batch(self, batch_size: int, do_sample: bool = False) -> None:
        """Refuse (one ValueError line, before any image is read) a batch of ``batch_size`` images
        that this pipeline cannot decode together: a target that decodes one sequence at a time, or
        a drafter that runs at batch size 1 only (Gemma 4's assistant); nothing for batch size 1."""
        if batch_size < 2:
            return
        reason = batch_size_one_reason(self.target)
        if reason or not isinstance(self.target, RowTarget):
            raise ValueError(f"{type(self.model).__name__} {reason or 'decodes one sequence at a time'}; use batch size 1")
        drafter, _, _ = self.batch_drafter(batch_size, do_sample)
        if drafter is not None:
            row_drafter(copy.copy(drafter))  # (each row's drafter, as generate_rows makes it; raises where it cannot)

    # -- inputs and outputs ------------------------------------------------------------------------
    def preprocess(self, image: ImageInput, prompt: str) -> dict[str, torch.Tensor]:
        """(image, prompt) -> the processor's model inputs on the model's device.

        The prompt is one user turn of the chat template: ``[image, prompt]``, then the assistant
        turn is opened; a :class:`Conversation` (``prompt`` unused) is its messages through the chat
        template, its images in order, then the assistant turn. Returns input_ids / attention_mask [1, L] and the family's pixel inputs
        (e.g. pixel_values [1, C, H, W] or [1, n_images, C, H, W], image_sizes [1, 2],
        pixel_attention_mask), floating-point tensors in the model's dtype.
        """
        if isinstance(image, Conversation):
            pils, message = [load_image(x) for x in image.images], image.escaped(self.image_tokens)
        else:
            pils = [load_image(image)]
            message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": escape_image_tokens(prompt, self.image_tokens)}]}]
        if getattr(self.processor, "chat_template", None) is None:  # (a processor passed in, or its template removed)
            raise ValueError(no_chat_template(self.model.name_or_path or type(self.model).__name__))
        text = self.processor.apply_chat_template(message, add_generation_prompt=True)
        try:
            inputs = self.processor(text=[text], images=pils, return_tensors="pt")
        except (ValueError, TypeError, IndexError) as error:  # e.g. a family that takes one image per prompt
            first = (str(error).splitlines() or [type(error).__name__])[0]
            sizes = ", ".join(f"{p.width}x{p.height}" for p in pils)
            what = (f"this conversation ({len(pils)} image(s): {sizes})" if isinstance(image, Conversation)
                    else f"the image{f' {image}' if isinstance(image, (str, os.PathLike)) else ''} ({sizes})")
            raise ValueError(f"the {type(self.processor).__name__} could not take {what}: {first}; "
                             "resize or crop the image to a size and shape the model takes") from None
        return {
            k: v.to(self.device, self.model.dtype) if v.is_floating_point() else v.to(self.device)
            for k, v in inputs.items()
            if isinstance(v, torch.Tensor)
        }

    def _decode(self, sequences: torch.Tensor, prompt_length: int) -> str:
        """sequences [1, L + new] -> the new tokens' text, special tokens removed, stripped."""
        return self.tokenizer.decode(sequences[0, prompt_length:], skip_special_tokens=True).strip()

    def _ended(self, sequences: torch.Tensor, prompt_length: int) -> bool:
        """Whether the new tokens of sequences [1, L + new] end on an end token (the loops keep it)."""
        return sequences.shape[1] > prompt_length and int(sequences[0, -1]) in self.eos_token_ids

    def run_config(self) -> dict[str, Any]:
        """The dtype, the linears' kernel and whether CUDA graphs ran (every result's stats.config)."""
        return {"dtype": dtype_name(self.dtype), "linears": self.optimization.label if self.optimization else "as loaded",
                "cuda_graphs": bool(getattr(self.target, "captured", False))}

    def _annotate(self, stats: SpecStats, drafter_name: str, reason: str) -> SpecStats:
        stats.config.update(drafter=drafter_name, drafter_choice=reason, **self.run_config())
        return stats

    # -- calls -------------------------------------------------------------------------------------
    def __call__(
        self,
        images: ImageInput | Conversation | Sequence[ImageInput | Conversation],
        prompt: str | None = None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        seed: int | None = 0,
        compare_baseline: bool = False,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        batch_size: int = 1,
        progress: bool | ProgressCallback | None = None,
        stream: CaptionStream | None = None,
    ) -> CaptionOutput | list[CaptionOutput]:
        """Caption one image, or a list of images (``batch_size`` at a time).

        Args:
            images: a PIL image, a path, a numpy array [H, W(, 3|4)], a :class:`Conversation`
                (a chat over several images) -- or a list/tuple of them.
            prompt: the instruction or question; None uses the pipeline's default prompt
                ("Describe the image." unless set at construction). A Conversation brings its own.
            max_new_tokens: the caption's token budget.
            do_sample, temperature, top_k, top_p: sample instead of greedy decoding.
            seed: seeds each caption's randomness (every image of a list gets the same seed, so a
                caption does not depend on its position in the list); None: a fresh random seed
                (as in every pipeline and ``mmspec.generate``).
            compare_baseline: also run plain AR decoding on the same inputs and set
                ``stats.speedup`` = baseline wall time / speculative wall time (of the whole batch).
            batch_size: images of a list decoded together (:mod:`mmspec.core.batch`): each caption
                is the one batch size 1 gives (same tokens, same seed; in float32, or in bf16 where
                the C kernels and batch-invariant attention run every row alone: elsewhere bf16
                rows may round differently, docs/usage.md "Batches"), its ``stats`` are its own
                row's (``wall_time_s``: until the row finished; ``config["batch_wall_time_s"]``:
                the batch's). Tree drafters draft their chain form in a batch (EAGLE-2 -> EAGLE,
                Medusa / Hydra -> the top-1 chain): greedy, the same caption; sampled, an exact
                sample of the chain form's draws, not the batch-size-1 caption of the seed. With drafter="auto" and a drafters file that
                measured batches, a batch uses the fastest method measured at the largest batch size
                <= its size, plain decoding included (``stats.config["drafter_choice"]`` says so).
            progress: called with the number of captions done after each caption (a batch: after
                the batch); True shows a terminal bar.
            stream: a :class:`CaptionStream`: each row's text as it is accepted, rows cancelled
                between steps, items joining the running batch (with ``stream.admits``; not with
                ``compare_baseline``, and only into the call's last batch). Joined items' outputs
                follow the call's items in the returned list.
        Returns:
            A CaptionOutput, or a list of them (one per image, same order) for a list input.
        Raises:
            ValueError: an empty prompt, an invalid image (too large, not an image file, bad array).
            FileNotFoundError: an image path that does not exist.
        """
        prompt = check_prompt(self.default_prompt if prompt is None else prompt)  # (batch_size: checked before the call)
        if stream is not None and not isinstance(stream, CaptionStream):
            raise TypeError(f"stream must be a CaptionStream, got {type(stream).__name__}")
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, eos_token_id=self.eos_token_ids)
        single = not isinstance(images, (list, tuple))
        items = [images] if single else list(images)
        if not items:
            raise ValueError("no images given; pass an image or a list of them")
        check_images(items)
        joins = stream is not None and stream.admits and not compare_baseline
        rows = None if stream is None else _StreamedRows(stream, lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True))
        report, close = self.progress_reporter(progress, len(items), "image")
        results: list[CaptionOutput] = []
        try:
            for first, chunk in self.chunks(items, batch_size):
                last = first + len(chunk) == len(items)
                if batch_size == 1 and not (joins and last):
                    results.append(self._caption(chunk[0], prompt, compare_baseline, kwargs, rows, first))
                else:
                    results += self._caption_batch(chunk, prompt, compare_baseline, kwargs, rows, first, joins and last)
                if report is not None:
                    report(len(results))
        finally:
            close()
        return results[0] if single and len(results) == 1 else results

    def _caption_batch(self, images: Sequence[ImageInput], prompt: str, compare_baseline: bool, kwargs: dict,
                       stream: "_StreamedRows | None" = None, first: int = 0, joins: bool = False) -> list[CaptionOutput]:
        items = list(images)
        rows = [self.preprocess(image, prompt) for image in items]  # every image checked before decoding
        # a lone last row decodes as _caption would (a sampled one with the sampling drafter); a
        # batch that others may join keeps the batch drafter
        drafter, drafter_name, reason = self.batch_drafter(len(rows), kwargs["do_sample"]) if joins else self.drafter_for(kwargs["do_sample"], len(rows))
        # batch row -> its index in the call (joined items follow the call's; one that could not be
        # prepared keeps its index and runs no row)
        index = [first + b for b in range(len(rows))]
        texts = {i: stream.on_tokens(i) for i in index} if stream is not None else {}
        outputs: dict[int, CaptionOutput] = {}

        def output_of(result: RowResult) -> CaptionOutput:
            tokens = result.tokens
            return CaptionOutput(text=self._decode(tokens, result.prompt_length), prompt=_prompt_of(items[result.index], prompt),
                                 stats=self._annotate(result.stats, drafter_name, reason), prompt_tokens=result.prompt_length,
                                 ended_with_eos=self._ended(tokens, result.prompt_length))

        def on_row_done(result: RowResult) -> None:
            if not compare_baseline:  # (with a baseline, rows are finished once both ran)
                outputs[result.index] = _finish(stream, index[result.index], output_of(result))

        offered = [len(rows)]  # items offered to this batch so far (joined or not)

        def admit() -> list[dict[str, Any]]:
            joined = []
            for item in stream.stream.more():
                at = first + offered[0]
                offered[0] += 1
                try:
                    row = self.preprocess(item, prompt)
                except (ValueError, TypeError, OSError) as error:
                    stream.stream.error(at, error)
                    continue
                items.append(item)
                index.append(at)
                texts[at] = stream.on_tokens(at)
                joined.append(row)
            return joined

        live = dict(
            on_row_done=on_row_done,
            on_tokens=None if stream is None else (lambda b, tokens: texts[index[b]](tokens)),
            cancelled=None if stream is None else (lambda b: stream.stream.cancelled(index[b])),
            admit=admit if joins else None)
        out, baseline = self.with_baseline(
            lambda: generate_rows(self.target, rows, drafter=drafter, **kwargs, **live),
            (lambda: generate_rows(self.target, rows, drafter=None, **kwargs)) if compare_baseline else None,
            warm_up=lambda: generate_rows(self.target, rows[:2], drafter=drafter, **{**kwargs, "max_new_tokens": 4}))
        if baseline is None:
            for stats in out.row_stats:
                stats.config["batch_wall_time_s"] = out.stats.wall_time_s
            return [outputs[b] for b in range(len(out.row_stats))]
        width = max(row["input_ids"].shape[1] for row in rows)

        def rows_of(output) -> list[tuple[torch.Tensor, SpecStats]]:
            """Each row's tokens [1, width + new] and stats (the batch's wall time noted)."""
            for stats in output.row_stats:
                stats.config["batch_wall_time_s"] = output.stats.wall_time_s
            return [(output.sequences[b : b + 1, : width + s.new_tokens], s) for b, s in enumerate(output.row_stats)]

        results = []
        for b, ((tokens, stats), (base_tokens, base_stats)) in enumerate(zip(rows_of(out), rows_of(baseline))):
            result = CaptionOutput(text=self._decode(tokens, width), prompt=_prompt_of(items[b], prompt),
                                   stats=self._annotate(stats, drafter_name, reason), prompt_tokens=int(rows[b]["input_ids"].shape[1]),
                                   baseline_text=self._decode(base_tokens, width),
                                   baseline_stats=self._annotate(base_stats, "ar", "baseline"),
                                   identical_to_baseline=bool(torch.equal(tokens, base_tokens)),
                                   ended_with_eos=self._ended(tokens, width))
            result.stats.speedup = baseline.stats.wall_time_s / out.stats.wall_time_s
            results.append(_finish(stream, first + b, result))
        return results

    def _caption(self, image: ImageInput, prompt: str, compare_baseline: bool, kwargs: dict,
                 stream: "_StreamedRows | None" = None, index: int = 0) -> CaptionOutput:
        inputs = self.preprocess(image, prompt)
        prompt_length = inputs["input_ids"].shape[1]
        drafter, drafter_name, reason = self.drafter_for(kwargs["do_sample"])
        live = {} if stream is None else dict(on_tokens=stream.on_tokens(index),
                                              cancelled=lambda: stream.stream.cancelled(index))
        question = _prompt_of(image, prompt)
        if not compare_baseline:
            out = generate(self.target, drafter=drafter, **kwargs, **live, **inputs)
            stats = self._annotate(out.stats, drafter_name, reason)
            return _finish(stream, index, CaptionOutput(text=self._decode(out.sequences, prompt_length), stats=stats,
                                                        prompt=question, prompt_tokens=prompt_length,
                                                        ended_with_eos=self._ended(out.sequences, prompt_length)))
        out, baseline = self.with_baseline(
            lambda: generate(self.target, drafter=drafter, **kwargs, **live, **inputs),
            lambda: generate(self.target, drafter=None, **kwargs, **inputs),
            warm_up=lambda: generate(self.target, drafter=drafter, **{**kwargs, "max_new_tokens": 4}, **inputs))
        out.stats.speedup = baseline.stats.wall_time_s / out.stats.wall_time_s
        return _finish(stream, index, CaptionOutput(
            text=self._decode(out.sequences, prompt_length),
            stats=self._annotate(out.stats, drafter_name, reason),
            baseline_text=self._decode(baseline.sequences, prompt_length),
            baseline_stats=self._annotate(baseline.stats, "ar", "baseline"),
            identical_to_baseline=bool(torch.equal(out.sequences, baseline.sequences)),
            prompt=question,
            prompt_tokens=prompt_length,
            ended_with_eos=self._ended(out.sequences, prompt_length),
        ))

    def __repr__(self) -> str:
        name = getattr(self.model, "name_or_path", "") or type(self.model).__name__
        return (f"ImageCaptioningPipeline(model={name!r}, drafter={self.chosen_drafter!r}, "
                f"device={str(self.device)!r}, dtype={str(self.dtype).removeprefix('torch.')!r})")


class _StreamedRows:
    """A call's :class:`CaptionStream` and each streamed row's :class:`TextPieces`."""

    def __init__(self, stream: CaptionStream, decode: Callable[[list[int]], str]) -> None:
        self.stream, self.decode, self.pieces = stream, decode, {}

    def on_tokens(self, index: int) -> Callable[[torch.Tensor], None]:
        """``on_tokens`` for row ``index``: its new text to ``stream.text``."""
        pieces = self.pieces[index] = TextPieces(self.decode)

        def on_tokens(tokens: torch.Tensor) -> None:
            piece = pieces.push(tokens[0].tolist())
            if piece:
                self.stream.text(index, piece)

        return on_tokens

    def finish(self, index: int, output: CaptionOutput) -> None:
        """The rest of row ``index``'s text, then its output."""
        pieces = self.pieces.pop(index, None)
        rest = pieces.finish(output.text) if pieces is not None else output.text
        if rest:
            self.stream.text(index, rest)
        self.stream.done(index, output)


def _finish(stream: _StreamedRows | None, index: int, output: CaptionOutput) -> CaptionOutput:
    if stream is not None:
        stream.finish(index, output)
    return output


def check_images(items: list) -> None:
    """Every item of a call (an image, or a Conversation's images) checked before any decoding,
    cheaply (:func:`~mmspec.pipelines.images.check_image`): a bad item late in a list would
    otherwise end the call after the captions before it, losing them. The refusal names the item
    ("image 9 of 9: ...") where the call has several."""
    for number, item in enumerate(items, 1):
        with Pipeline.naming_item(number, len(items), "image"):
            for image in item.images if isinstance(item, Conversation) else [item]:
                check_image(image)


def _prompt_of(item: Any, prompt: str) -> str:
    """The question an item answers: a Conversation's last user text, else the call's prompt."""
    return item.prompt if isinstance(item, Conversation) else prompt
