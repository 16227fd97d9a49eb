"""Text-to-image with discrete image tokens: ``mmspec.pipeline("text-to-image", method=...)``.

The pipeline composes a model's components (:class:`~mmspec.pipelines.text_to_image.components.T2IComponents`:
the image-token generator behind :class:`~mmspec.adapters.image_gen.GuidedImageTarget`, with
classifier-free guidance on both halves of one cache; the prompt encoder; the image tokenizer,
tokens -> pixels; the draft generator and image EAGLE head) with a method
(:mod:`mmspec.pipelines.text_to_image.methods`: a drafter and the core's acceptance rule, registered by name).
``model=None`` is the embedded default in ``models/``; a path is a directory laid out the same way
(``t2i.json``), or a transformers Janus, Emu3 or Chameleon / Anole model (path, hub id or object).

Methods (:data:`METHODS`): ``ar``, ``spec``, ``sjd[:init]``, ``sjd-coupled[:init]``,
``sjd-pac[:init]``, ``eagle``, ``eagle2`` (lossless: greedy variants reproduce AR token for
token, sampling variants sample AR's distribution) and ``lantern``, ``lantern++``, ``gsd``
(``[:draft|eagle|eagle2]``: relaxed rules, lossy and bounded; neighbour tables from the
tokenizer's codebook, cached under ``$MMSPEC_CACHE/neighbours`` by a hash of the codebook).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Sequence

import torch

from ...api import fresh_seed
from ...core.sampling import SamplingConfig
from ...core.stats import DictAccess, SpecStats
from ...core.target import batch_size_one_reason
from ...hub import dtype_name, resolve_device, resolve_dtype
from ..base import Pipeline, ProgressCallback, register_pipeline
from ..images import png_base64
from .components import T2IComponents
from ..methods import parse_spec
from .methods import METHODS, SETTINGS, T2IMethod, make_method, register_method
from ...core import words

__all__ = ["METHODS", "SETTINGS", "T2IComponents", "T2IMethod", "TextToImageOutput", "TextToImagePipeline",
           "TextToImageStats", "check_call_arguments", "make_method", "register_method"]


#: the most images one call makes (a call's jobs are made up front: 10**9 of them filled the memory)
MAX_IMAGES = 10_000
MAX_GUIDANCE = 1000.0
"""The largest guidance scale taken: uncond + s (cond - uncond) overflows float32 logits into NaN
probabilities long before s reaches float32's range (published models use 3-10)."""


def check_call_arguments(guidance_scale: float, num_images: int = 1, do_sample: bool = True, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> SamplingConfig:
    """Check a pipeline call's arguments (one ValueError line each) -> their SamplingConfig: the
    sampling options only when sampling (a temperature other than 1, a top-k or top-p with
    ``do_sample=False``: refused, as ``--greedy`` refuses them), and image i's seed + i within
    2**63 - 1.

    Cheap, so callers (the CLI) can check before loading a model."""
    if not isinstance(guidance_scale, Real) or not math.isfinite(guidance_scale) or not 1 <= guidance_scale <= MAX_GUIDANCE:
        raise ValueError(f"guidance_scale must be a number from 1 to {MAX_GUIDANCE:g} (got {guidance_scale}); 1 means no "
                         "guidance, published models use 3-10")
    if not isinstance(num_images, Integral) or not 1 <= num_images <= MAX_IMAGES:
        raise ValueError(f"num_images must be an integer from 1 to {MAX_IMAGES}, got {num_images}; for more, call again "
                         f"with seed + {MAX_IMAGES}")
    if isinstance(seed, Integral) and seed + num_images - 1 >= 2**63:
        raise ValueError(f"seed {seed} with num_images {num_images}: image i takes seed + i, which must stay below 2**63; "
                         f"use a seed of at most {2**63 - num_images}")
    if not do_sample:
        given = [name for name, value, unset in (("temperature", temperature, 1.0), ("top_k", top_k, None),
                                                 ("top_p", top_p, None)) if value != unset]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only when sampling; drop "
                             f"{'it' if len(given) == 1 else 'them'} or pass do_sample=True")
    return SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                          guidance_scale=guidance_scale)


def check_batches(method: T2IMethod, images: int, batch_size: int, option: str = "batch_size",
                  model_reason: str | None = None) -> None:
    """Refuse (one ValueError line) to decode ``images`` images ``batch_size`` at a time with a
    method that decodes one image at a time (SJD-PAC's trees), naming the methods that batch, or
    with a model that does (``model_reason``, e.g. Emu3's: see
    :meth:`T2IComponents.batch_size_one_reason`)."""
    if batch_size > 1 and images > 1 and model_reason:
        raise ValueError(f"{model_reason}, so it decodes one image at a time; use {option} 1")
    if batch_size > 1 and images > 1 and not method.batches:
        batching = [name for name, cls in METHODS.items() if cls.batches and cls.continuous in (None, method.continuous)]
        raise ValueError(f"method {method.name!r} decodes one image at a time; for {option} > 1 use {', '.join(batching)}")


@dataclass
class TextToImageStats(DictAccess):
    """Speed of one pipeline call (all images).

    Attributes:
        method: the method's name; config: its settings (window, init, ...).
        images: images generated; tokens: image tokens generated in total.
        target_forwards: target forwards in total (prefills included).
        step_compression: tokens / target forwards (AR = 1.0; the figure SJD reports).
        tau: mean tokens committed per verification step; acceptance_rate: accepted / drafted
            tokens; each the mean of the images' (as ``per_image`` holds them).
        wall_time_s: wall time of the token generation (the prompt encoding and the pixel decoding,
            the same for every method, are not included).
        speedup: baseline wall time / wall time, with ``compare_baseline``.
        per_image: each image's SpecStats as a dict (decoded in a batch, its ``wall_time_s`` runs
            from the batch's start to that image's last token).
    """

    method: str
    config: dict[str, Any]
    images: int = 0
    tokens: int = 0
    target_forwards: int = 0
    step_compression: float = 0.0
    tau: float = 0.0
    acceptance_rate: float = 0.0
    wall_time_s: float = 0.0
    speedup: float | None = None
    baseline_wall_time_s: float | None = None
    per_image: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def collect(cls, method: str, runs: list[SpecStats], wall_time_s: float) -> "TextToImageStats":
        tokens = sum(s.new_tokens for s in runs)
        forwards = sum(s.target_forwards for s in runs)  # the prefill (which yields token 1) included
        return cls(method=method, config=dict(runs[0].config) if runs else {}, images=len(runs), tokens=tokens,
                   target_forwards=forwards, step_compression=tokens / max(forwards, 1),
                   tau=sum(s.mean_accepted_length for s in runs) / max(len(runs), 1),
                   acceptance_rate=sum(s.acceptance_rate for s in runs) / max(len(runs), 1), wall_time_s=wall_time_s,
                   per_image=[s.to_dict() for s in runs])

    def summary(self) -> str:
        line = (f"{self.method}: {words.count(self.images, 'image')}, {words.count(self.tokens, 'token')} in {self.wall_time_s:.2f}s, "
                f"step compression {self.step_compression:.2f}x, tau {self.tau:.2f}")
        return line + (f", speedup {self.speedup:.2f}x" if self.speedup is not None else "")


@dataclass
class TextToImageOutput(DictAccess):
    """:meth:`to_dict` is JSON-serialisable (images as PNG data URIs, tensors as nested lists).

    Attributes:
        images: list of PIL images.
        tokens: LongTensor [num_images, rows * columns] their image tokens.
        accepted_map: LongTensor [num_images, rows, columns]: for each token, the verification step
            that committed it (tokens committed together share a step; 0 = the prefill).
        stats: :class:`TextToImageStats`.
        baseline_images / baseline_tokens / baseline_stats: plain AR decoding with the same seeds
            (``compare_baseline=True``), else None.
    """

    images: list
    tokens: torch.Tensor
    accepted_map: torch.Tensor
    stats: TextToImageStats
    baseline_images: list | None = None
    baseline_tokens: torch.Tensor | None = None
    baseline_stats: TextToImageStats | None = None

    def json_value(self, value: Any) -> Any:
        """Images as PNG data URIs (``data:image/png;base64,...``, what the server's ``b64_json``
        holds after the prefix), the rest as :class:`~mmspec.core.stats.DictAccess` makes it."""
        from PIL import Image

        if isinstance(value, Image.Image):
            return "data:image/png;base64," + png_base64(value)
        return super().json_value(value)


@register_pipeline
class TextToImagePipeline(Pipeline):
    """``mmspec.pipeline("text-to-image", model=None, method="sjd-coupled", ...)``.

    Args:
        model: None (the embedded default); a directory with ``t2i.json``; or a transformers
            Janus / Emu3 / Chameleon (Anole) model: a local path, a hub id, or the loaded model
            (see :meth:`T2IComponents.from_pretrained`, which also takes ``processor``,
            ``image_tokenizer``, ``grid``, ``draft``, ``eagle_head`` and ``trust_remote_code``).
        method: a spec of :data:`METHODS` in the one syntax, ``name[:key=value,...]``
            ("sjd:init=vertical,window=4"), or its short form: SJD's init ("sjd:vertical"), a
            relaxed method's drafter ("lantern:eagle2"), MAR's steps ("mar-parallel:16").
        device: "auto" | "cpu" | "cuda" | "cuda:N".
        components: already loaded components (instead of ``model`` and its loading arguments).
        optimize: few-row linears for the networks the pipeline loads (:func:`mmspec.optimize`;
            ``stats.config["linears"]`` says which kernel ran); False keeps them as loaded.
        dtype: the generator's (and draft's) weights: "float32" (default), "bfloat16", or "auto"
            (bfloat16 where the machine computes it fast: GPUs, CPUs with AMX / AVX-512 BF16);
            ``stats.config["dtype"]`` says which. Lossless methods stay exact against plain
            decoding in the same dtype.
        cuda_graphs: verify (and draft with a draft generator) through CUDA graphs, one per padded
            forward size (:mod:`mmspec.core.captured`): the embedded LlamaGen-style layout on a CUDA
            device, one image at a time; ``stats.config["cuda_graphs"]`` says whether it ran.
        **settings: the methods' settings (:data:`~mmspec.pipelines.text_to_image.methods.SETTINGS`; each
            method reads its own, with its own defaults): ``window`` (SJD's L; 8), ``init`` ("random" | "horizontal" | "vertical";
            "vertical" for ``sjd-coupled``, else "random"),
            ``num_draft_tokens`` (K of chains: 4; EAGLE-2's depth: 6), ``drafter`` (who drafts for
            the relaxed methods: "draft" | "eagle" | "eagle2"; default "eagle" when the model has
            an image EAGLE head, else "draft"), ``neighbours_k`` (100), ``delta`` (LANTERN, 0.05),
            ``lam`` (LANTERN++, 10), ``top_m`` (GSD, 50), ``pac_branches`` and ``pac_depth``
            (SJD-PAC, 2 and 1). All are checked before the model loads; a setting the method
            does not read is refused (``method="cspd", window=4``). :meth:`generate_tokens` with
            another method (``method=``) hands it the pipeline's settings that it reads.
    Raises:
        ValueError: an unknown method, setting, init or drafter, an invalid value, a model without
            an image tokenizer, an unsupported model family.
        FileNotFoundError: missing model files.
    Example:
        >>> t2i = mmspec.pipeline("text-to-image")  # exact coupled SJD, vertical init
        >>> r = t2i("a red circle above a blue square", guidance_scale=3.0, seed=0)
        >>> r.images[0].save("out.png"); print(r.stats.summary())
    """

    task = "text-to-image"
    methods = METHODS

    def __init__(self, model: Any = None, method: str = "sjd-coupled", device: str = "auto", *,
                 components: T2IComponents | None = None, processor: Any = None, image_tokenizer: Any = None,
                 grid: tuple[int, int] | None = None, draft: Any = None, eagle_head: Any = None,
                 trust_remote_code: bool = False, optimize: bool = True, dtype: str | torch.dtype = "float32",
                 cuda_graphs: bool = False, **settings: Any) -> None:
        self.settings = settings
        self.method = self.make_method(method, **settings)  # every setting checked before anything loads
        if components is None:
            self.method.check_kind(T2IComponents.names_continuous(model))  # checked before the model loads
            components = T2IComponents.from_pretrained(model, device, processor=processor, image_tokenizer=image_tokenizer,
                                                       grid=grid, draft=draft, eagle_head=eagle_head,
                                                       trust_remote_code=trust_remote_code, optimize=optimize, dtype=dtype,
                                                       cuda_graphs=cuda_graphs)
        elif model is not None:
            raise ValueError("pass either model=... or components=..., not both")
        self.method.check_components(components)
        self.components = components

    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound) without loading anything
        (presets): the method and its settings (and that it fits a model named as continuous-token),
        the device. Raises ValueError / TypeError."""
        method = make_method(values["method"], **values["settings"])
        if values["components"] is None:  # the model's token kind, read from its name
            method.check_kind(T2IComponents.names_continuous(values["model"]))
        resolve_device(values["device"])
        resolve_dtype(values["dtype"])

    @classmethod
    def check_task_values(cls, values: dict[str, Any]) -> None:
        """guidance_scale, num_images, the sampling options only when sampling, and seed + i for
        every image within range (:meth:`Pipeline.check_call_values`, :func:`check_call_arguments`)."""
        check_call_arguments(values["guidance_scale"], values["num_images"], values.get("do_sample", True),
                             values.get("temperature", 1.0), values.get("top_k"), values.get("top_p"), values.get("seed"))

    @property
    def target(self):
        """The generator as a GuidedImageTarget."""
        return self.components.target

    @property
    def tokenizer(self):
        """The image tokenizer."""
        return self.components.tokenizer

    def method_for(self, method: str | T2IMethod | None = None) -> T2IMethod:
        """``method`` (a spec string, with the pipeline's settings that it reads; default: the
        pipeline's method)."""
        if method is None or isinstance(method, T2IMethod):
            return method or self.method
        return self.make_method(method, **METHODS.resolve(parse_spec(method).name).reads(self.settings))

    def prompt_inputs(self, prompt: str) -> dict[str, Any]:
        """prompt -> the target's model inputs (caption features, or prompt ids), without guidance."""
        return self.components.prompt_inputs(prompt)

    def generate_tokens(self, model_inputs: dict[str, Any], seed: int, method: str | T2IMethod | None = None,
                        max_new_tokens: int | None = None, **sampling):
        """One image's tokens with ``method`` (default: the pipeline's): its drafter, its acceptance
        rule and parameters, through :func:`mmspec.generate`. Returns the GenerateOutput."""
        return self.method_for(method).generate(self.components, model_inputs, seed, max_new_tokens, **sampling)

    def _run(self, method: T2IMethod, jobs: list[tuple[dict, int]], advance=None, batch_size: int = 1,
             **sampling) -> tuple[list[SpecStats], list[torch.Tensor], list[torch.Tensor], list[float]]:
        """Decode each job (model inputs, seed), ``batch_size`` at a time -> per job its stats, tokens
        [N], step map [N] and seconds (a batch's wall time shared equally by its rows);
        ``advance(n)`` after each chunk of n images."""
        runs, tokens, maps, seconds = [], [], [], []
        n = self.target.num_image_tokens
        for _, chunk in self.chunks(jobs, batch_size):
            started = time.perf_counter()
            if batch_size == 1:
                out = method.generate(self.components, chunk[0][0], chunk[0][1], **sampling)
                rows = [(out.sequences[0, -n:], out.stats, out.token_steps)]
            else:
                out = method.generate_batch(self.components, [inputs for inputs, _ in chunk], [seed for _, seed in chunk], **sampling)
                rows = [(out.sequences[b, -n:], stats, None if out.token_steps is None else out.token_steps[b])
                        for b, stats in enumerate(out.row_stats)]
            share = (time.perf_counter() - started) / len(chunk)
            for row_tokens, stats, steps in rows:
                runs.append(stats)
                tokens.append(row_tokens)
                maps.append((steps if steps is not None else torch.tensor(stats.step_of_token())).view(*self.target.grid))
                seconds.append(share)
            if advance is not None:
                advance(len(chunk))
        return runs, tokens, maps, seconds

    def decode(self, tokens: torch.Tensor) -> list:
        """LongTensor [B, rows * columns] -> B PIL images."""
        return self.components.decode(tokens)

    @torch.inference_mode()
    def __call__(self, prompt: str | Sequence[str], *, guidance_scale: float = 3.0, seed: int | None = 0, num_images: int = 1,
                 do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 compare_baseline: bool = False, progress: bool | ProgressCallback | None = False,
                 batch_size: int = 1) -> TextToImageOutput | list[TextToImageOutput]:
        """Generate ``num_images`` images for ``prompt`` (image i uses seed + i; ``seed=None``: a fresh
        random seed, as in every pipeline), or for each prompt
        of a list (one output per prompt, in order), ``batch_size`` images at a time.

        Args:
            guidance_scale: classifier-free guidance g >= 1 (logits = u + g (c - u)).
            do_sample, temperature, top_k, top_p: the sampling of image tokens (official defaults:
                sampling at temperature 1.0, CFG 3.0).
            compare_baseline: also run AR with the same seeds (``baseline_images``, ``stats.speedup``).
            progress: called with the number of images done (the baseline's included) after each
                batch; True shows a terminal bar over images.
            batch_size: images decoded together, across the prompts of a list too
                (:mod:`mmspec.core.batch`; LlamaGen-style, Janus, Chameleon, MAR): each image is the one batch size 1
                gives with its seed, up to float rounding (a batch verifies its rows in one wider
                forward). A batch's wall time is shared equally by its images. EAGLE-2 drafts its
                chain in a batch, so a sampled EAGLE-2 image is then an exact sample but not the
                batch-size-1 image of its seed; SJD-PAC and Emu3 need batch size 1.
        """
        # (guidance_scale, num_images, the sampling options and batch_size are checked before the call)
        prompts = self.strings(prompt, "prompt")
        if not prompts:
            raise ValueError("no prompts given")
        family_reason = batch_size_one_reason(self.target)  # (Emu3's end-of-line tokens: before any prompt is encoded)
        check_batches(self.method, len(prompts) * num_images, batch_size,
                      model_reason=family_reason and f"{type(self.target).__name__} {family_reason}")
        inputs = []
        for number, one in enumerate(prompts, 1):  # every prompt checked before decoding
            with self.naming_item(number, len(prompts), "prompt"):
                inputs.append(self.prompt_inputs(one))
        base_seed = fresh_seed() if seed is None else seed  # (None: a fresh random seed)
        jobs = [(model_inputs, base_seed + i) for model_inputs in inputs for i in range(num_images)]
        sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, guidance_scale=guidance_scale)
        report, close = self.progress_reporter(progress, len(jobs) * (2 if compare_baseline else 1), "image")
        done = [0]  # images so far, the baseline's included

        def advance(count: int) -> None:
            done[0] += count
            report(done[0])

        baseline = self.make_method("ar")
        try:
            (runs, tokens, maps, seconds), base = self.with_baseline(
                lambda: self._run(self.method, jobs, report and advance, batch_size, **sampling),
                (lambda: self._run(baseline, jobs, report and advance, batch_size, **sampling)) if compare_baseline else None,
                warm_up=lambda: self.method.generate(self.components, inputs[0], 0, min(8, self.target.num_image_tokens),
                                                     **sampling),
                key=self.method.name)
        finally:
            close()
        if base is not None:
            base_runs, base_tokens, _, base_seconds = base
        outputs = []
        for i in range(len(prompts)):
            part = slice(i * num_images, (i + 1) * num_images)
            stats = TextToImageStats.collect(self.method.name, runs[part], sum(seconds[part]))
            # (image j: seed + j; seed=None: the one drawn); exact: plain decoding's output (False: relaxed or approximate);
            # method: the method that ran (its drafter, in the config too, is "sjd" for sjd and sjd-coupled alike)
            stats.config.update(self.run_config(), seed=base_seed, exact=self.method.exact, method=self.method.name)
            image_tokens = torch.stack(tokens[part])
            output = TextToImageOutput(self.decode(image_tokens), image_tokens, torch.stack(maps[part]), stats)
            if compare_baseline:
                output.baseline_stats = TextToImageStats.collect(baseline.name, base_runs[part], sum(base_seconds[part]))
                output.baseline_tokens = torch.stack(base_tokens[part])
                output.baseline_images = self.decode(output.baseline_tokens)
                stats.baseline_wall_time_s = output.baseline_stats.wall_time_s
                stats.speedup = stats.baseline_wall_time_s / stats.wall_time_s
            outputs.append(output)
        return outputs[0] if isinstance(prompt, str) else outputs

    def run_config(self) -> dict[str, Any]:
        """The linears' kernel, the dtype and whether CUDA graphs ran (every result's stats.config)."""
        return {"linears": self.components.linears, "dtype": dtype_name(self.components.dtype),
                "cuda_graphs": bool(getattr(self.components.target, "captured", False))}
