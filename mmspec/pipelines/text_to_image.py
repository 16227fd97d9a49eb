"""Text-to-image with discrete image tokens: ``mmspec.pipeline("text-to-image", method=...)``.

The pipeline composes a text encoder (prompt -> conditioning), an image-token generator behind
:class:`~mmspec.adapters.image_gen.GuidedImageTarget` (classifier-free guidance on both halves of
one cache), a method (a drafter + the core's acceptance rule) and the image tokenizer (tokens ->
pixels). ``model=None`` is the embedded default in ``models/``: ``t2i`` (LlamaGen-style generator,
text encoder = the first layers of the installed SmolLM2), ``t2i-vq`` (its VQ tokenizer) and
``t2i-draft`` (the small draft generator of ``method="spec"``); a path is a directory laid out the
same way (``t2i.json`` names the tokenizer and draft directories).

Methods (:data:`METHODS`): ``ar``; ``spec`` (speculative sampling with the draft generator);
``sjd`` (speculative Jacobi decoding, ``init`` = random | horizontal | vertical); ``sjd-coupled``
(SJD whose redrafts are maximally coupled with the previous iterate). These are lossless: greedy
variants reproduce AR token for token, sampling variants sample AR's distribution. ``lantern``,
``lantern++`` and ``gsd`` verify the draft generator's tokens with the relaxed rules of
:mod:`mmspec.core.relaxed` (lossy, bounded; neighbour tables from the tokenizer's codebook, cached
next to it).
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapters.image_gen import LlamaGenTarget, VQImageTokenizer
from ..api import generate
from ..core.stats import DictAccess, SpecStats
from ..drafters import Drafter, JacobiDrafter, ModelDrafter
from ..drafters.jacobi import INIT_STRATEGIES
from ..textgen import resolve_device

#: method -> what it is (shown by the CLI)
METHODS = {
    "ar": "plain autoregressive decoding (the baseline)",
    "spec": "speculative sampling with the small draft generator",
    "sjd": "speculative Jacobi decoding (training-free)",
    "sjd-coupled": "SJD with maximally coupled redrafts (training-free)",
    "lantern": "draft generator + LANTERN relaxed acceptance (lossy, TV <= delta)",
    "lantern++": "draft generator + LANTERN++ relaxed acceptance (lossy, p~(x) <= lam p(x))",
    "gsd": "draft generator + grouped speculative decoding acceptance (lossy)",
}
#: methods that verify with a relaxed (lossy) rule of mmspec.core.relaxed
RELAXED_METHODS = ("lantern", "lantern++", "gsd")
MODEL_FILE = "t2i.json"
#: SJD's default window L (plain, coupled): measured on the embedded model on a 2-core CPU, plain SJD
#: is faster at L = 8 (1.57x vs 1.41x at 16) and coupled SJD at L = 16 (2.14x vs 1.87x at 8);
#: docs/benchmarks.md
DEFAULT_WINDOW = {False: 8, True: 16}


def default_t2i_dir() -> Path:
    from ..modeling.captioner import models_dir

    return models_dir() / "t2i"


@dataclass
class TextToImageStats(DictAccess):
    """Speed of one pipeline call (all images).

    Attributes:
        method: the method's name; config: its settings (window, init, ...).
        images: images generated; tokens: image tokens generated in total.
        target_forwards: target forwards in total (prefills included).
        step_compression: tokens / target forwards (AR = 1.0; the figure SJD reports).
        tau: mean tokens committed per verification step.
        wall_time_s: wall time of the token generation (the prompt encoding and the pixel decoding,
            the same for every method, are not included).
        speedup: baseline wall time / wall time, with ``compare_baseline``.
        per_image: each image's SpecStats as a dict.
    """

    method: str
    config: dict[str, Any]
    images: int = 0
    tokens: int = 0
    target_forwards: int = 0
    step_compression: float = 0.0
    tau: float = 0.0
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
                   tau=sum(s.mean_accepted_length for s in runs) / max(len(runs), 1), wall_time_s=wall_time_s,
                   per_image=[s.to_dict() for s in runs])

    def summary(self) -> str:
        line = (f"{self.method}: {self.images} image(s), {self.tokens} tokens in {self.wall_time_s:.2f}s, "
                f"step compression {self.step_compression:.2f}x, tau {self.tau:.2f}")
        return line + (f", speedup {self.speedup:.2f}x" if self.speedup is not None else "")


@dataclass
class TextToImageOutput(DictAccess):
    """Attributes:
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


class TextToImagePipeline:
    """``mmspec.pipeline("text-to-image", model=None, method="sjd", ...)``.

    Args:
        model: None (the embedded default), or a directory with ``t2i.json`` (see the module doc).
        method: one of :data:`METHODS`, optionally with its init after a colon ("sjd:vertical").
        device: "auto" | "cpu" | "cuda" | "cuda:N".
        window: SJD's window L (default 8 for plain SJD, 16 for coupled SJD: :data:`DEFAULT_WINDOW`).
        num_draft_tokens: the draft generator's draft length K (spec and the relaxed methods; default 4).
        init: SJD's initialisation of new window positions: "random" | "horizontal" | "vertical".
        neighbours_k: codebook neighbours kept per code for the relaxed rules (LANTERN's k).
        delta: LANTERN's total-variation bound; lam: LANTERN++'s ratio bound; top_m: GSD's
            probability cut for cluster members.
    Raises:
        ValueError: an unknown method or init, a model directory without an image tokenizer.
        FileNotFoundError: missing model files.
    Example:
        >>> t2i = mmspec.pipeline("text-to-image", method="sjd")
        >>> r = t2i("a red circle above a blue square", guidance_scale=3.0, seed=0)
        >>> r.images[0].save("out.png"); print(r.stats.summary())
    """

    task = "text-to-image"

    def __init__(self, model: str | Path | None = None, method: str = "sjd", device: str = "auto", *,
                 window: int | None = None, num_draft_tokens: int | None = None, init: str | None = None, neighbours_k: int = 1000, delta: float = 0.1,
                 lam: float = 10.0, top_m: int = 50, trust_remote_code: bool = False) -> None:
        self.device = resolve_device(device)
        self.method, self.init = self._parse_method(method, init)
        self.window, self.num_draft_tokens = window, num_draft_tokens
        if delta < 0 or lam < 1 or neighbours_k < 1 or top_m < 1:
            raise ValueError(f"need delta >= 0, lam >= 1, neighbours_k >= 1, top_m >= 1 (got {delta}, {lam}, {neighbours_k}, {top_m})")
        self.relaxed = {"lantern": {"delta": delta}, "lantern++": {"lam": lam}, "gsd": {"top_m": top_m}}
        self.neighbours_k = neighbours_k
        self._neighbours = None
        self.model_dir = Path(model).expanduser() if model is not None else default_t2i_dir()
        self._load(self.model_dir)

    @staticmethod
    def _parse_method(method: str, init: str | None) -> tuple[str, str]:
        name, _, arg = (method or "").partition(":")
        if name not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)} (e.g. 'sjd:vertical')")
        init = init or arg or "random"
        if init not in INIT_STRATEGIES:
            raise ValueError(f"unknown SJD init {init!r}; choose one of {INIT_STRATEGIES}")
        if arg and not name.startswith("sjd"):
            raise ValueError(f"method {name!r} takes no ':{arg}' argument")
        return name, init

    def _load(self, directory: Path) -> None:
        from ..modeling.llamagen import LlamaGenModel
        from ..modeling.vq import VQTokenizer

        manifest_path = directory / MODEL_FILE
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{directory} is not a text-to-image model directory (no {MODEL_FILE}); pass model=None for the "
                "embedded default or train one with `mmspec train vq` and `mmspec train t2i`")
        manifest = json.loads(manifest_path.read_text())
        if "vq" not in manifest:
            raise ValueError(f"{manifest_path} names no image tokenizer ('vq'); a text-to-image model needs one")
        dtype = torch.float32
        self.generator = LlamaGenModel.from_pretrained(directory, dtype=dtype).to(self.device)
        self.tokenizer = VQImageTokenizer(VQTokenizer.from_pretrained(directory / manifest["vq"]).to(self.device))
        self.text_encoder = shared_text_encoder(manifest.get("text_encoder_layers", 8), self.device)
        self.draft_dir = directory / manifest["draft"] if manifest.get("draft") else None
        self.tokenizer_dir = directory / manifest["vq"]
        self._draft_model = None
        self.target = LlamaGenTarget(self.generator)
        if self.tokenizer.grid != self.target.grid or self.tokenizer.vocab_size != self.target.vocab_size:
            raise ValueError(f"the generator ({self.target.grid}, {self.target.vocab_size} codes) and the tokenizer "
                             f"({self.tokenizer.grid}, {self.tokenizer.vocab_size} codes) do not match")

    def make_drafter(self, method: str | None = None) -> Drafter | None:
        """A fresh drafter for ``method`` (default: the pipeline's)."""
        name, init = self._parse_method(method, None) if method else (self.method, self.init)
        if name == "ar":
            return None
        if name == "spec" or name in RELAXED_METHODS:
            if self._draft_model is None:
                from ..modeling.llamagen import LlamaGenModel

                if self.draft_dir is None:
                    raise ValueError(f"method {name!r} needs a draft generator; {self.model_dir / MODEL_FILE} names none")
                self._draft_model = LlamaGenModel.from_pretrained(self.draft_dir, dtype=torch.float32).to(self.device)
            return ModelDrafter(LlamaGenTarget(self._draft_model), num_draft_tokens=self.num_draft_tokens or 4)
        coupled = name == "sjd-coupled"
        return JacobiDrafter(self.window or DEFAULT_WINDOW[coupled], init=init, coupled=coupled)

    def acceptance(self, method: str | None = None) -> tuple[str | None, dict | None]:
        """(acceptance rule, its parameters) of ``method``: the relaxed rules need the codebook's
        neighbour table (built once, cached in the tokenizer's directory)."""
        name = self._parse_method(method, None)[0] if method else self.method
        if name not in RELAXED_METHODS:
            return None, None
        if self._neighbours is None:
            from ..core.relaxed import cached_neighbour_table

            self._neighbours = cached_neighbour_table(self.tokenizer.codebook_embeddings().cpu(), self.neighbours_k,
                                                      self.tokenizer_dir).to(self.device)
        return name, {"neighbours": self._neighbours, **self.relaxed[name]}

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """prompt -> caption features [1, P, C]."""
        return self.text_encoder.encode([prompt], self.generator.cls_embedding.uncond_embedding.detach())

    def generate_tokens(self, caption: torch.Tensor, seed: int, method: str | None = None,
                        max_new_tokens: int | None = None, **sampling):
        """One image's tokens with ``method`` (default: the pipeline's): its drafter, its acceptance
        rule and parameters, through :func:`mmspec.generate`. Returns the GenerateOutput."""
        acceptance, rule_kwargs = self.acceptance(method)
        return generate(self.target, drafter=self.make_drafter(method), seed=seed, caption=caption,
                        max_new_tokens=max_new_tokens or self.target.num_image_tokens, acceptance=acceptance,
                        rule_kwargs=rule_kwargs, **sampling)

    def _run(self, method: str | None, caption: torch.Tensor, seeds: list[int], progress, **sampling) -> tuple[list[SpecStats], torch.Tensor, torch.Tensor, float]:
        started = time.perf_counter()
        runs, tokens, maps = [], [], []
        for seed in seeds:
            out = self.generate_tokens(caption, seed, method, **sampling)
            runs.append(out.stats)
            tokens.append(out.sequences[0, caption.shape[1]:])
            maps.append(torch.tensor(out.stats.step_of_token()))
            if progress is not None:
                progress.update(1)
        return runs, torch.stack(tokens), torch.stack(maps).view(len(seeds), *self.target.grid), time.perf_counter() - started

    def decode(self, tokens: torch.Tensor) -> list:
        from ..train.t2i_data import to_pil

        return to_pil(self.tokenizer.decode(tokens.to(self.device)))

    @torch.inference_mode()
    def __call__(self, prompt: str, *, guidance_scale: float = 3.0, seed: int | None = None, num_images: int = 1,
                 do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 compare_baseline: bool = False, progress: bool = False) -> TextToImageOutput:
        """Generate ``num_images`` images for ``prompt`` (image i uses seed + i).

        Args:
            guidance_scale: classifier-free guidance g >= 1 (logits = u + g (c - u)).
            do_sample, temperature, top_k, top_p: the sampling of image tokens (official defaults:
                sampling at temperature 1.0, CFG 3.0).
            compare_baseline: also run AR with the same seeds (``baseline_images``, ``stats.speedup``).
            progress: show a progress bar over images.
        """
        if guidance_scale is None or guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (got {guidance_scale}); 1 means no guidance")
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        caption = self.encode_prompt(prompt)
        base_seed = 0 if seed is None else seed
        seeds = [base_seed + i for i in range(num_images)]
        sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, guidance_scale=guidance_scale)
        bar = _progress_bar(num_images * (2 if compare_baseline else 1)) if progress else None
        if compare_baseline:  # warm-up, so neither side pays first-call costs
            self.generate_tokens(caption, 0, max_new_tokens=8, **sampling)
        runs, tokens, maps, seconds = self._run(None, caption, seeds, bar, **sampling)
        stats = TextToImageStats.collect(self.method, runs, seconds)
        output = TextToImageOutput(self.decode(tokens), tokens, maps, stats)
        if compare_baseline:
            base_runs, base_tokens, _, base_seconds = self._run("ar", caption, seeds, bar, **sampling)
            output.baseline_stats = TextToImageStats.collect("ar", base_runs, base_seconds)
            output.baseline_images, output.baseline_tokens = self.decode(base_tokens), base_tokens
            stats.baseline_wall_time_s = base_seconds
            stats.speedup = base_seconds / seconds
        if bar is not None:
            bar.close()
        return output


@lru_cache(maxsize=2)
def shared_text_encoder(num_layers: int, device: torch.device):
    """One frozen text encoder per (depth, device) and process (pipelines share it)."""
    from ..modeling.text_encoder import SmolTextEncoder

    return SmolTextEncoder(num_layers).to(device)


def _progress_bar(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; stay silent without it
        return None
    return tqdm(total=total, unit="image")
