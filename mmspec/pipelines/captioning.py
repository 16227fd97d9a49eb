"""Image captioning / VQA with speculative decoding: ``mmspec.pipeline("image-captioning")``.

The pipeline only composes: load a VLM and its processor, turn (image, prompt) into the
processor's model inputs, decode with :func:`mmspec.generate`, detokenise. With
``compare_baseline=True`` plain AR decoding runs in the same call (after a short warm-up), so
``stats.speedup`` compares like with like.

``drafter="auto"`` chooses as follows:

1. If the model directory holds ``mmspec_drafters.json`` -- written by ``mmspec bench caption
   --write-drafters-file``: the machine it was measured on and a list ``"drafters"`` of
   ``{"drafter": <spec or path>, "speedup": <float>}`` entries (optionally with
   ``"num_draft_tokens": K``; a bare list of entries is read too) -- the entry with the highest
   ``speedup`` is used. ``drafter`` is
   a spec ("prompt-lookup", "prompt-lookup:10", "layer-skip:8", "ar") or the path of a draft model
   directory, relative to the model directory (a text-only causal LM sharing the target's
   tokenizer: the SPD setting; or a smaller VLM of a supported family).
2. Otherwise "prompt-lookup": training-free, never slower than a few percent, and captions often
   repeat words of the prompt and of themselves.

When sampling (``do_sample=True``), a file that measured a temperature > 0 (entries with
``"sampled_speedup_per_token"``) gives the entry fastest per token there instead (a head trained
for sampling accepts more of the target's samples than the greedy-trained one); batches use the
file's ``"batches"`` table (:func:`choose_batch_drafter`). A drafter path in the file, alone or as
a spec's argument ("eagle:../smolcap-eagle-t1"), is relative to the model directory.

The choice and why are recorded in ``pipeline.chosen_drafter`` / ``pipeline.drafter_reason`` and in
every result's ``stats.config["drafter"]`` / ``stats.config["drafter_choice"]``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..adapters.hf import VLM_FAMILIES, CapturedTransformersTarget, TransformersTarget
from ..api import generate
from ..core.stats import DictAccess, SpecStats
from ..drafters import NO_DRAFTER, Drafter, is_drafter_spec, resolve_drafter, spec_drafter_names
from ..hub import dtype_name, resolve_dtype
from ..api import generate_rows, generate_with_baseline, optimize_components
from ..hub import resolve_device
from .images import ImageInput, load_image

DEFAULT_PROMPT = "Describe the image."
#: benchmarked drafters of a checkpoint, read by drafter="auto"
DRAFTERS_FILE = "mmspec_drafters.json"
#: drafter="auto" without a DRAFTERS_FILE
AUTO_FALLBACK = "prompt-lookup"


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
        prompt: the user prompt the caption answers.
    """

    text: str
    stats: SpecStats
    baseline_text: str | None = None
    baseline_stats: SpecStats | None = None
    identical_to_baseline: bool | None = None
    prompt: str = DEFAULT_PROMPT

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the stats become dicts (with tau, acceptance rate, tokens/s)."""
        return {
            "text": self.text,
            "prompt": self.prompt,
            "stats": self.stats.to_dict(),
            "baseline_text": self.baseline_text,
            "baseline_stats": self.baseline_stats.to_dict() if self.baseline_stats is not None else None,
            "identical_to_baseline": self.identical_to_baseline,
        }


def check_prompt(prompt: str) -> str:
    """Raise ValueError for an empty or whitespace-only prompt; return it unchanged otherwise."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"the prompt is empty ({prompt!r}); give the question or instruction about the image")
    return prompt


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


def check_drafter_name(drafter: str | os.PathLike) -> Path | None:
    """A ``drafter=`` string checked without loading anything: None for "auto", "ar" and specs,
    else the draft model directory it names.

    Raises:
        ValueError: an unknown drafter name.
        FileNotFoundError: a path that is not a directory.
    """
    if drafter == "auto" or drafter in NO_DRAFTER or is_drafter_spec(drafter):
        return None
    path = Path(drafter).expanduser()
    if not path.is_dir():
        if isinstance(drafter, str) and os.sep not in drafter and "/" not in drafter:
            raise ValueError(
                f"unknown drafter {drafter!r}; use 'auto', one of {spec_drafter_names()} "
                "(e.g. 'layer-skip:8'), 'ar', or a draft model directory"
            )
        raise FileNotFoundError(f"draft model directory not found: {drafter}")
    return path


def load_captioning_model(
    name_or_path: str | os.PathLike, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False
) -> tuple[nn.Module, Any]:
    """A local checkpoint directory or hub id -> (VLM in eval mode on ``device``, processor).

    Loaded with ``AutoProcessor`` and ``AutoModelForImageTextToText``, so any family of
    :data:`~mmspec.adapters.hf.VLM_FAMILIES` works (LLaVA-1.5, LLaVA-NeXT, Mistral3/Pixtral,
    Idefics3, SmolVLM, Gemma3).

    Raises:
        FileNotFoundError: no such directory, or a hub id that cannot be loaded.
        ValueError: the checkpoint is not an image-text-to-text model.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    name = str(name_or_path)
    path = Path(name).expanduser()
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"model directory not found: {name}")
    source = str(path) if path.exists() else name
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise FileNotFoundError(f"cannot load the model {name!r}: {str(error).splitlines()[0]}") from None
    return model.to(device).eval(), processor


def load_draft_model(path: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A draft model directory -> the model in eval mode: a causal LM (``AutoModelForCausalLM``),
    or a VLM of a supported family (``AutoModelForImageTextToText``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_type = getattr(AutoConfig.from_pretrained(path), "model_type", "")
    auto = AutoModelForImageTextToText if model_type in VLM_FAMILIES else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).to(device).eval()


def read_auto_table(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``model_dir/mmspec_drafters.json`` (None if there is no such file): the table drafter="auto"
    reads, written by ``mmspec bench caption --write-drafters-file``.

    Returns:
        {"drafters": [{"drafter": str, "speedup": float, ...}], "machine": {...} | None, ...}: the
        file's object, or ``{"drafters": <list>, "machine": None}`` for a bare list of entries
        (a file written by hand or by an older mmspec).
    Raises:
        ValueError: the file is not such an object or list (entries need "drafter" and "speedup").
    """
    path = Path(model_dir) / DRAFTERS_FILE
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if isinstance(table, list):
        table = {"drafters": table, "machine": None}
    entries = table.get("drafters") if isinstance(table, dict) else None
    if not isinstance(entries, list) or not entries or not all(
        isinstance(e, dict) and isinstance(e.get("drafter"), str) and isinstance(e.get("speedup"), (int, float))
        for e in entries
    ):
        raise ValueError(f'{path} must hold a non-empty list "drafters" of {{"drafter": "<spec or path>", "speedup": <number>}} '
                         "(write it with mmspec bench caption --write-drafters-file)")
    table.setdefault("machine", None)
    return table


def read_drafters_file(model_dir: str | os.PathLike) -> list[dict[str, Any]] | None:
    """The drafter entries of :func:`read_auto_table` (None if there is no file)."""
    table = read_auto_table(model_dir)
    return None if table is None else table["drafters"]


def describe_machine(machine: dict[str, Any] | None) -> str:
    """A table's "machine" record -> "bfloat16, 1 thread, AMD EPYC with avx512f avx512_bf16, torch 2.14.1"."""
    if not machine:
        return "machine not recorded"
    cpu = machine.get("cpu", "CPU not recorded")
    flags = machine.get("cpu_flags")
    if flags:
        cpu += f" with {' '.join(flags)}"
    threads = machine.get("threads")
    parts = [str(machine.get("dtype", "dtype not recorded")),
             f"{threads} thread{'s' if threads != 1 else ''}" if threads else "threads not recorded",
             cpu if machine.get("device", "cpu") == "cpu" else str(machine["device"]),
             f"torch {machine.get('torch', 'not recorded')}"]
    return ", ".join(parts)


def describe_auto_table(model_dir: str | os.PathLike) -> str:
    """One sentence on what drafter="auto" picks for the model in ``model_dir`` and why, made from
    its drafters file only (docs/captioning.md quotes the embedded captioner's; a test keeps them equal)."""
    table = read_auto_table(model_dir)
    if table is None:
        return f'`drafter="auto"` uses `{AUTO_FALLBACK}` (no {DRAFTERS_FILE} beside the model).'
    entries = table["drafters"]
    best = max(entries, key=lambda e: e["speedup"])
    text = (f'`drafter="auto"` picks `{best["drafter"]}`: {best["speedup"]:.2f}x over plain decoding at temperature 0, '
            f"measured on {describe_machine(table['machine'])}.")
    sampled = [e for e in entries if isinstance(e.get("sampled_speedup_per_token"), (int, float))]
    if sampled:
        fastest = max(sampled, key=lambda e: e["sampled_speedup_per_token"])
        temperature = table.get("sampled_temperature")
        text += (f" At temperature {temperature:g}" if isinstance(temperature, (int, float)) else " When sampling")
        text += (f", `{fastest['drafter']}` is the fastest "
                 f"per token: {fastest['sampled_speedup_per_token']:.2f}x")
        if fastest is not best and best in sampled:
            text += f" (`{best['drafter']}` {best['sampled_speedup_per_token']:.2f}x)"
        text += "; auto uses it when sampling."
    sizes = sorted({e["batch_size"] for e in table.get("batches", []) if e["batch_size"] > 1})
    if sizes:
        picks = []
        for size in sizes:
            best = max((e for e in table["batches"] if e["batch_size"] == size), key=lambda e: e["speedup"])
            picks.append(f"`{best['drafter']}` from batch size {size} ({best['speedup']:.2f}x plain decoding's throughput there)")
        machine = (table.get("batches_measured") or {}).get("machine", table["machine"])
        text += f" In batches it picks {', '.join(picks)}, measured on {describe_machine(machine)}."
    return text


def measured_elsewhere(table: dict[str, Any], machine: dict[str, Any] | None, runs_on: tuple[str, bool] | None) -> str:
    """The clause a choice's reason gets where the drafters file measured another way of running
    than the pipeline's, ``runs_on`` = (device type, CUDA graphs): the speedups of drafters over
    plain decoding differ most between a CPU, a GPU and a GPU with CUDA graphs (docs/benchmarks.md).
    "" where they match, or where the file or the caller does not say."""
    if runs_on is None or not machine or "device" not in machine:
        return ""
    measured = ("cpu" if machine["device"] == "cpu" else "cuda", bool((table.get("benchmark") or {}).get("cuda_graphs")))
    if measured == tuple(runs_on):
        return ""
    way = lambda device, graphs: device + (" with CUDA graphs" if graphs else "")
    device, graphs = runs_on
    return (f"; measured on {way(*measured)}, not on this pipeline's {way(device, graphs)}: `mmspec bench caption "
            f"--device {device}{' --cuda-graphs' if graphs else ''} --write-drafters-file` measures it there")


def choose_auto_drafter(model_dir: str | os.PathLike | None, runs_on: tuple[str, bool] | None = None) -> tuple[dict[str, Any], str]:
    """drafter="auto": the fastest benchmarked entry of the model's drafters file, else prompt lookup.

    Args:
        runs_on: (device type, CUDA graphs) of the pipeline, to say in the reason when the file
            measured another (:func:`measured_elsewhere`); the choice is the file's either way.
    Returns:
        (entry, reason): ``entry`` has "drafter" (a spec, or a path relative to ``model_dir``) and
        optionally "num_draft_tokens"; ``reason`` says how it was chosen, and on what machine.
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    if table is None:
        return {"drafter": AUTO_FALLBACK}, f"auto: no {DRAFTERS_FILE} beside the model, training-free default"
    best = max(table["drafters"], key=lambda e: e["speedup"])
    return best, (f"auto: highest measured speedup ({best['speedup']:.2f}x on {describe_machine(table['machine'])}) "
                  f"in {DRAFTERS_FILE}{measured_elsewhere(table, table['machine'], runs_on)}")


def choose_sampling_drafter(model_dir: str | os.PathLike | None, runs_on: tuple[str, bool] | None = None
                            ) -> tuple[str, int | None, str] | None:
    """drafter="auto" when sampling: the entry of the drafters file with the highest per-token
    speedup at its sampled temperature (``"sampled_speedup_per_token"``); ``runs_on`` as
    :func:`choose_auto_drafter`'s.

    Returns:
        (spec, num_draft_tokens or None, reason), or None when the file measured no temperature > 0.
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    sampled = [e for e in (table or {}).get("drafters", []) if isinstance(e.get("sampled_speedup_per_token"), (int, float))]
    if not sampled:
        return None
    best = max(sampled, key=lambda e: e["sampled_speedup_per_token"])
    temperature = table.get("sampled_temperature")
    at = f"temperature {temperature:g}" if isinstance(temperature, (int, float)) else "its sampled temperature"
    reason = (f"auto when sampling: highest measured speedup per token at {at} ({best['sampled_speedup_per_token']:.2f}x "
              f"on {describe_machine(table['machine'])}) in {DRAFTERS_FILE}{measured_elsewhere(table, table['machine'], runs_on)}")
    return best["drafter"], best.get("num_draft_tokens"), reason


def choose_batch_drafter(model_dir: str | os.PathLike | None, batch_size: int, runs_on: tuple[str, bool] | None = None
                         ) -> tuple[str, int | None, str] | None:
    """drafter="auto" for a batch: the method with the highest measured throughput at the largest
    batch size <= ``batch_size`` of the drafters file's ``"batches"`` table (written by
    ``mmspec bench caption --batch-sizes ... --write-drafters-file``), which may be "ar";
    ``runs_on`` as :func:`choose_auto_drafter`'s.

    Returns:
        (spec, num_draft_tokens or None, reason), or None when the file measured no such batch size.
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    entries = [e for e in (table or {}).get("batches", []) if e.get("batch_size", batch_size + 1) <= batch_size]
    if not entries:
        return None
    size = max(e["batch_size"] for e in entries)
    best = max((e for e in entries if e["batch_size"] == size), key=lambda e: e["speedup"])
    machine = (table.get("batches_measured") or {}).get("machine", table["machine"])
    reason = (f"auto for batch size {batch_size}: highest measured throughput at batch size {size} ({best['speedup']:.2f}x "
              f"plain decoding's there, on {describe_machine(machine)}) in {DRAFTERS_FILE}"
              f"{measured_elsewhere({}, machine, runs_on)}")
    return best["drafter"], best.get("num_draft_tokens"), reason


def check_cuda_graphs(cuda_graphs: bool, device: torch.device) -> None:
    """CUDA graphs need a CUDA device (checked before the model loads)."""
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device, got {device}; pass device='cuda' or drop cuda_graphs")


class ImageCaptioningPipeline:
    """Caption images (or answer a question about them) with speculative decoding.

    Args:
        model: None for mmspec's embedded default captioner; a local checkpoint directory or hub id
            of a VLM (LLaVA-1.5, LLaVA-NeXT, Mistral3/Pixtral, Idefics3, SmolVLM, Gemma3); or a
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
        trust_remote_code: passed to transformers' ``from_pretrained`` (off by default).
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
        self.default_prompt = check_prompt(prompt)
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        check_cuda_graphs(cuda_graphs, self.device)
        self.model, self.processor, self.model_dir = self._load(model, processor, trust_remote_code)
        self.target = CapturedTransformersTarget(self.model) if cuda_graphs else TransformersTarget(self.model)
        if not self.target.is_vlm:
            raise ValueError(
                f"{type(self.model).__name__} is a text-only model; image captioning needs a VLM "
                f"({', '.join(VLM_FAMILIES.values())})"
            )
        if getattr(self.processor, "image_processor", None) is None:
            raise ValueError(f"the processor {type(self.processor).__name__} cannot process images")
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.image_tokens = image_token_strings(self.processor, self.target.image_token_id)
        eos = self.target.eos_token_ids or [self.tokenizer.eos_token_id]
        self.eos_token_ids = [t for t in eos if t is not None]
        self.auto = isinstance(drafter, str) and drafter == "auto"
        self._auto_drafters: dict[tuple, tuple] = {}  # drafter="auto": the drafter per drafters-file choice (spec, K)
        self.drafter, self.chosen_drafter, self.drafter_reason = self.resolve_drafter(drafter, num_draft_tokens)
        # a model the pipeline loaded (a loaded one passed in is the caller's: mmspec.optimize(model) does it)
        self.optimization = optimize_components(self.model, self.drafter) if optimize and not isinstance(model, nn.Module) else None
        self._warmed_up = False

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound) without loading anything
        (presets): the drafter name, the prompt, dtype and device. Raises ValueError /
        FileNotFoundError."""
        check_prompt(values["prompt"])
        if isinstance(values["drafter"], (str, os.PathLike)):
            check_drafter_name(values["drafter"])
        device = resolve_device(values["device"]) if isinstance(values["device"], str) else values["device"]
        resolve_dtype(values["dtype"], device)
        check_cuda_graphs(values["cuda_graphs"], device)

    def _load(self, model, processor, trust_remote_code: bool) -> tuple[nn.Module, Any, Path | None]:
        """-> (model, processor, directory that may hold the drafters file)."""
        if model is None:
            from ..modeling import captioner

            model, processor = captioner.load_default_captioner(device=self.device, dtype=self.dtype)
            default_dir = getattr(captioner, "default_captioner_dir", None)
            return model, processor, default_dir() if default_dir else None
        if isinstance(model, nn.Module):
            if processor is None:
                raise ValueError("a loaded model needs its processor: pass processor=AutoProcessor.from_pretrained(...)")
            local = Path(str(getattr(model, "name_or_path", "") or ""))
            return model.eval(), processor, local if str(local) and local.is_dir() else None
        loaded, processor = load_captioning_model(model, self.device, self.dtype, trust_remote_code)
        local = Path(str(model)).expanduser()
        return loaded, processor, local if local.is_dir() else None

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
        elif isinstance(drafter, (str, os.PathLike)) and not is_drafter_spec(drafter):
            path = check_drafter_name(drafter)
            name = f"draft model {drafter}"
            drafter = load_draft_model(path, self.model.device, self.model.dtype)
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
        name, _, arg = spec.partition(":")
        if arg and is_drafter_spec(spec) and (self.model_dir / arg).is_dir():
            return f"{name}:{self.model_dir / arg}"
        return spec

    def _auto_drafter(self, choice: tuple[str, int | None, str] | None) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) of a drafters-file choice (spec, K, reason), built once (and
        optimized as the pipeline's own); the pipeline's own drafter when there is no choice."""
        if choice is None:
            return self.drafter, self.chosen_drafter, self.drafter_reason
        spec, k, reason = choice
        if (spec, k) not in self._auto_drafters:
            resolved = self._table_spec(spec)
            drafter, name, _ = self.resolve_drafter(resolved, k)
            if self.optimization is not None:
                optimize_components(drafter)
            self._auto_drafters[spec, k] = drafter, name if resolved == spec else spec  # the file's name for a path
        drafter, name = self._auto_drafters[spec, k]
        return drafter, name, reason

    def batch_drafter(self, batch_size: int) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) for a batch: the pipeline's own, or with drafter="auto" the
        fastest of the drafters file at that batch size (:func:`choose_batch_drafter`) when it
        measured one."""
        return self._auto_drafter(choose_batch_drafter(self.model_dir, batch_size, self.runs_on) if self.auto and batch_size > 1 else None)

    def sampling_drafter(self) -> tuple[Drafter | None, str, str]:
        """(drafter, name, reason) for one sampled caption: the pipeline's own, or with
        drafter="auto" the fastest per token at the drafters file's sampled temperature
        (:func:`choose_sampling_drafter`) when it measured one."""
        return self._auto_drafter(choose_sampling_drafter(self.model_dir, self.runs_on) if self.auto else None)

    # -- inputs and outputs ------------------------------------------------------------------------
    def preprocess(self, image: ImageInput, prompt: str) -> dict[str, torch.Tensor]:
        """(image, prompt) -> the processor's model inputs on the model's device.

        The prompt is one user turn of the chat template: ``[image, prompt]``, then the assistant
        turn is opened. Returns input_ids / attention_mask [1, L] and the family's pixel inputs
        (e.g. pixel_values [1, C, H, W] or [1, n_images, C, H, W], image_sizes [1, 2],
        pixel_attention_mask), floating-point tensors in the model's dtype.
        """
        pil = load_image(image)
        if getattr(self.processor, "chat_template", None) is None:
            raise ValueError(
                f"the processor of {self.model.name_or_path or type(self.model).__name__} has no chat template; "
                "set processor.chat_template (see the model card for the prompt format)"
            )
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": escape_image_tokens(prompt, self.image_tokens)}]}]
        text = self.processor.apply_chat_template(message, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=[pil], return_tensors="pt")
        return {
            k: v.to(self.device, self.model.dtype) if v.is_floating_point() else v.to(self.device)
            for k, v in inputs.items()
            if isinstance(v, torch.Tensor)
        }

    def _decode(self, sequences: torch.Tensor, prompt_length: int) -> str:
        """sequences [1, L + new] -> the new tokens' text, special tokens removed, stripped."""
        return self.tokenizer.decode(sequences[0, prompt_length:], skip_special_tokens=True).strip()

    def _annotate(self, stats: SpecStats, drafter_name: str, reason: str) -> SpecStats:
        stats.config.update(drafter=drafter_name, drafter_choice=reason, dtype=dtype_name(self.dtype),
                            linears=self.optimization.label if self.optimization else "as loaded",
                            cuda_graphs=bool(getattr(self.target, "captured", False)))
        return stats

    # -- calls -------------------------------------------------------------------------------------
    def __call__(
        self,
        images: ImageInput | Sequence[ImageInput],
        prompt: str | None = None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        seed: int | None = None,
        compare_baseline: bool = False,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        batch_size: int = 1,
    ) -> CaptionOutput | list[CaptionOutput]:
        """Caption one image, or a list of images (``batch_size`` at a time).

        Args:
            images: a PIL image, a path, a numpy array [H, W(, 3|4)] -- or a list/tuple of them.
            prompt: the instruction or question; None uses the pipeline's default prompt
                ("Describe the image." unless set at construction).
            max_new_tokens: the caption's token budget.
            do_sample, temperature, top_k, top_p: sample instead of greedy decoding.
            seed: seeds each caption's randomness (every image of a list gets the same seed, so a
                caption does not depend on its position in the list).
            compare_baseline: also run plain AR decoding on the same inputs and set
                ``stats.speedup`` = baseline wall time / speculative wall time (of the whole batch).
            batch_size: images of a list decoded together (:mod:`mmspec.core.batch`): each caption
                is the one batch size 1 gives (same tokens, same seed), its ``stats`` are its own
                row's (``wall_time_s``: until the row finished; ``config["batch_wall_time_s"]``:
                the batch's). Tree drafters draft their chain form in a batch (EAGLE-2 -> EAGLE,
                Medusa / Hydra -> the top-1 chain). With drafter="auto" and a drafters file that
                measured batches, a batch uses the fastest method measured at the largest batch size
                <= its size, plain decoding included (``stats.config["drafter_choice"]`` says so).
        Returns:
            A CaptionOutput, or a list of them (one per image, same order) for a list input.
        Raises:
            ValueError: an empty prompt, an invalid image (too large, not an image file, bad array).
            FileNotFoundError: an image path that does not exist.
        """
        prompt = check_prompt(self.default_prompt if prompt is None else prompt)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, eos_token_id=self.eos_token_ids)
        if not isinstance(images, (list, tuple)):
            return self._caption(images, prompt, compare_baseline, kwargs)
        if batch_size == 1:
            return [self._caption(image, prompt, compare_baseline, kwargs) for image in images]
        return [result for start in range(0, len(images), batch_size)
                for result in self._caption_batch(images[start : start + batch_size], prompt, compare_baseline, kwargs)]

    def _caption_batch(self, images: Sequence[ImageInput], prompt: str, compare_baseline: bool, kwargs: dict) -> list[CaptionOutput]:
        rows = [self.preprocess(image, prompt) for image in images]  # every image checked before decoding
        drafter, drafter_name, reason = self.batch_drafter(len(rows))
        if compare_baseline and not self._warmed_up:
            generate_rows(self.target, rows[:2], drafter=drafter, **{**kwargs, "max_new_tokens": 4})
            self._warmed_up = True
        out = generate_rows(self.target, rows, drafter=drafter, **kwargs)
        baseline = generate_rows(self.target, rows, drafter=None, **kwargs) if compare_baseline else None
        width = max(row["input_ids"].shape[1] for row in rows)

        def rows_of(output) -> list[tuple[torch.Tensor, SpecStats]]:
            """Each row's tokens [1, width + new] and stats (the batch's wall time noted)."""
            for stats in output.row_stats:
                stats.config["batch_wall_time_s"] = output.stats.wall_time_s
            return [(output.sequences[b : b + 1, : width + s.new_tokens], s) for b, s in enumerate(output.row_stats)]

        method_rows = rows_of(out)
        results = [CaptionOutput(text=self._decode(tokens, width), prompt=prompt, stats=self._annotate(stats, drafter_name, reason))
                   for tokens, stats in method_rows]
        if baseline is not None:
            for result, (tokens, _), (base_tokens, base_stats) in zip(results, method_rows, rows_of(baseline)):
                result.stats.speedup = baseline.stats.wall_time_s / out.stats.wall_time_s
                result.baseline_text = self._decode(base_tokens, width)
                result.baseline_stats = self._annotate(base_stats, "ar", "baseline")
                result.identical_to_baseline = bool(torch.equal(tokens, base_tokens))
        return results

    def _caption(self, image: ImageInput, prompt: str, compare_baseline: bool, kwargs: dict) -> CaptionOutput:
        inputs = self.preprocess(image, prompt)
        prompt_length = inputs["input_ids"].shape[1]
        drafter, drafter_name, reason = self.sampling_drafter() if kwargs["do_sample"] else (
            self.drafter, self.chosen_drafter, self.drafter_reason)
        if not compare_baseline:
            out = generate(self.target, drafter=drafter, **kwargs, **inputs)
            stats = self._annotate(out.stats, drafter_name, reason)
            return CaptionOutput(text=self._decode(out.sequences, prompt_length), stats=stats, prompt=prompt)
        out, baseline = generate_with_baseline(self.target, drafter, inputs, warmup=not self._warmed_up, **kwargs)
        self._warmed_up = True
        return CaptionOutput(
            text=self._decode(out.sequences, prompt_length),
            stats=self._annotate(out.stats, drafter_name, reason),
            baseline_text=self._decode(baseline.sequences, prompt_length),
            baseline_stats=self._annotate(baseline.stats, "ar", "baseline"),
            identical_to_baseline=bool(torch.equal(out.sequences, baseline.sequences)),
            prompt=prompt,
        )

    def __repr__(self) -> str:
        name = getattr(self.model, "name_or_path", "") or type(self.model).__name__
        return (f"ImageCaptioningPipeline(model={name!r}, drafter={self.chosen_drafter!r}, "
                f"device={str(self.device)!r}, dtype={str(self.dtype).removeprefix('torch.')!r})")
