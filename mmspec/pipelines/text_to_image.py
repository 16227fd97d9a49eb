"""Text-to-image with discrete image tokens: ``mmspec.pipeline("text-to-image", method=...)``.

The pipeline composes a text encoder (prompt -> conditioning), an image-token generator behind
:class:`~mmspec.adapters.image_gen.GuidedImageTarget` (classifier-free guidance on both halves of
one cache), a method (a drafter + the core's acceptance rule) and the image tokenizer (tokens ->
pixels). ``model=None`` is the embedded default in ``models/``: ``t2i`` (LlamaGen-style generator,
text encoder = the first layers of the installed SmolLM2), ``t2i-vq`` (its VQ tokenizer) and
``t2i-draft`` (the small draft generator of ``method="spec"``) and ``t2i-eagle`` (the image EAGLE
head); a path is a directory laid out the same way (``t2i.json`` names the tokenizer, draft and head
directories). ``model`` may also be a transformers Janus, Emu3 or Chameleon / Anole model (path,
hub id or object, :mod:`mmspec.adapters.hf_image`); its processor turns prompts into input ids.

Methods (:data:`METHODS`): ``ar``; ``spec`` (speculative sampling with the draft generator);
``sjd`` (speculative Jacobi decoding, ``init`` = random | horizontal | vertical); ``sjd-coupled``
(SJD whose redrafts are maximally coupled with the previous iterate); ``sjd-pac`` (coupled SJD with
a small candidate tree at the window's start); ``eagle`` / ``eagle2`` (the image EAGLE head's chains
/ dynamic trees). These are lossless: greedy variants reproduce AR token for token, sampling
variants sample AR's distribution. ``lantern``, ``lantern++`` and ``gsd`` verify a drafter's tokens
(the EAGLE head's, or the draft generator's) with the relaxed rules of :mod:`mmspec.core.relaxed`
(lossy, bounded; neighbour tables from the tokenizer's codebook, cached under
``$MMSPEC_CACHE/neighbours`` by a hash of the codebook).
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
from ..drafters.jacobi import INIT_STRATEGIES, ProactiveJacobiDrafter
from ..hub import resolve_device

#: method -> what it is (shown by the CLI)
METHODS = {
    "ar": "plain autoregressive decoding (the baseline)",
    "spec": "speculative sampling with the small draft generator",
    "sjd": "speculative Jacobi decoding (training-free)",
    "sjd-coupled": "SJD with maximally coupled redrafts (training-free)",
    "sjd-pac": "coupled SJD + proactive drafting: a small candidate tree at the window's start (training-free)",
    "eagle": "EAGLE chain drafts from the image EAGLE head (exact)",
    "eagle2": "EAGLE-2 dynamic trees from the image EAGLE head (exact)",
    "lantern": "LANTERN relaxed acceptance of a drafter's tokens (lossy, TV <= delta)",
    "lantern++": "LANTERN++ relaxed acceptance (lossy, p~(x) <= lam p(x))",
    "gsd": "grouped speculative decoding acceptance (lossy)",
}
#: methods that verify with a relaxed (lossy) rule of mmspec.core.relaxed
RELAXED_METHODS = ("lantern", "lantern++", "gsd")
#: what proposes the tokens of a relaxed method (``drafter=``): the draft generator, or the image
#: EAGLE head in chains or EAGLE-2 trees (gsd takes linear drafts only). Default: "eagle" when the
#: model has an image EAGLE head, else "draft".
RELAXED_DRAFTERS = ("draft", "eagle", "eagle2")
MODEL_FILE = "t2i.json"
#: SJD's default window L per method: measured on the embedded model on a 2-core CPU, plain SJD is
#: faster at L = 8 (1.57x vs 1.41x at 16) and coupled SJD at L = 16 (2.14x vs 1.87x at 8);
#: docs/benchmarks.md
DEFAULT_WINDOW = {"sjd": 8, "sjd-coupled": 16, "sjd-pac": 16}
#: transformers families by config.model_type -> the class to load
TRANSFORMERS_FAMILIES = {
    "janus": "JanusForConditionalGeneration",
    "emu3": "Emu3ForConditionalGeneration",
    "chameleon": "ChameleonForConditionalGeneration",
}


def _looks_local(model: str | Path) -> bool:
    """A directory, or a path (absolute, ~ or ./-relative) rather than a hub id "org/name"."""
    text = str(model)
    return isinstance(model, Path) or Path(text).expanduser().is_dir() or text.startswith(("/", "~", "."))


def default_t2i_dir() -> Path:
    from ..hub import models_dir

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
        model: None (the embedded default); a directory with ``t2i.json`` (mmspec's LlamaGen-style
            layout, see the module doc); or a transformers Janus / Emu3 / Chameleon (Anole) model:
            a local path, a hub id, or the loaded model.
        method: one of :data:`METHODS`, optionally with an argument after a colon: SJD's init
            ("sjd:vertical") or a relaxed method's drafter ("lantern:eagle2").
        device: "auto" | "cpu" | "cuda" | "cuda:N".
        processor: for transformers models, what turns a prompt into the model's inputs: a
            processor or tokenizer (default: the one saved with the model), or a callable
            prompt -> dict of model inputs.
        image_tokenizer: override the image tokenizer (e.g. Chameleon's
            :class:`~mmspec.adapters.hf_image.ChameleonImageTokenizer` with its VQGAN decoder).
        grid: Emu3's (rows, columns) of codes (its processor's ``image_sizes``; default 90 x 90).
        draft: the draft generator of ``spec`` / ``drafter="draft"``: a model of the target's family
            (path or model; default: the one ``t2i.json`` names).
        eagle_head: the image EAGLE head (``mmspec train image-drafter``) of ``eagle``, ``eagle2``
            and the relaxed methods (default: the one ``t2i.json`` names).
        drafter: who proposes for the relaxed methods: "draft" | "eagle" | "eagle2"
            (:data:`RELAXED_DRAFTERS`; default "eagle" when the model has an image EAGLE head, else
            "draft").
        window: SJD's window L (default 8 for sjd, 16 for sjd-coupled and sjd-pac: :data:`DEFAULT_WINDOW`).
        num_draft_tokens: draft length K (chains) or tree depth (eagle2); defaults 4 and 6.
        init: SJD's initialisation of new window positions: "random" | "horizontal" | "vertical".
        neighbours_k: codebook neighbours kept per code for the relaxed rules (LANTERN's k).
        delta: LANTERN's total-variation bound; lam: LANTERN++'s ratio bound; top_m: GSD's
            probability cut for cluster members. Defaults k = 100, delta = 0.05: the recommended
            setting on the embedded model (the largest relaxation measured at k = 100 whose Frechet
            distance and prompt score stayed within AR's run-to-run spread; docs/benchmarks.md).
        pac_branches, pac_depth: SJD-PAC's candidates per tree position and tree positions (2 and
            1: the faster of the measured sizes on the embedded model, docs/benchmarks.md).
        trust_remote_code: passed to transformers when loading a model by path or id.
    Raises:
        ValueError: an unknown method, init or drafter, a model without an image tokenizer, an
            unsupported model family.
        FileNotFoundError: missing model files.
    Example:
        >>> t2i = mmspec.pipeline("text-to-image", method="sjd")
        >>> r = t2i("a red circle above a blue square", guidance_scale=3.0, seed=0)
        >>> r.images[0].save("out.png"); print(r.stats.summary())
    """

    task = "text-to-image"

    def __init__(self, model: Any = None, method: str = "sjd", device: str = "auto", *, processor: Any = None,
                 image_tokenizer: Any = None, grid: tuple[int, int] | None = None, draft: Any = None,
                 eagle_head: str | Path | None = None, drafter: str | None = None,
                 window: int | None = None, num_draft_tokens: int | None = None, init: str | None = None,
                 neighbours_k: int = 100, delta: float = 0.05, lam: float = 10.0, top_m: int = 50,
                 pac_branches: int = 2, pac_depth: int = 1, trust_remote_code: bool = False) -> None:
        self.device = resolve_device(device)
        self.method, self.init, self.drafter = self._parse_method(method, init, drafter)
        self.window, self.num_draft_tokens = window, num_draft_tokens
        self.pac_branches, self.pac_depth = pac_branches, pac_depth
        self.relaxed: dict[str, dict[str, float]] = {}
        self.neighbours_k, self._neighbours = None, None
        self.set_relaxation(neighbours_k=neighbours_k, delta=delta, lam=lam, top_m=top_m)
        self._head = None
        self._draft_target = None
        self.trust_remote_code = trust_remote_code
        if model is None or (isinstance(model, (str, Path)) and (Path(model).expanduser() / MODEL_FILE).is_file()):
            self._load_mmspec(Path(model).expanduser() if model is not None else default_t2i_dir())
        elif isinstance(model, (str, Path)) and _looks_local(model) and not (Path(model).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"{model} is not a text-to-image model directory (no {MODEL_FILE} and no "
                                    "transformers config.json); pass model=None for the embedded default")
        else:
            self._load_transformers(model, processor, {} if grid is None else {"grid": tuple(grid)})
        if image_tokenizer is not None:
            self.tokenizer = image_tokenizer
        self.draft_source = draft if draft is not None else self.draft_source
        self.eagle_dir = Path(eagle_head).expanduser() if eagle_head is not None else self.eagle_dir
        if self.tokenizer.grid != self.target.grid or self.tokenizer.vocab_size != self.target.vocab_size:
            raise ValueError(f"the generator ({self.target.grid}, {self.target.vocab_size} codes) and the tokenizer "
                             f"({self.tokenizer.grid}, {self.tokenizer.vocab_size} codes) do not match")

    @staticmethod
    def _parse_method(method: str, init: str | None, drafter: str | None = None) -> tuple[str, str, str]:
        name, _, arg = (method or "").partition(":")
        if name not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)} (e.g. 'sjd:vertical')")
        if arg and not (name.startswith("sjd") or name in RELAXED_METHODS):
            raise ValueError(f"method {name!r} takes no ':{arg}' argument")
        init = init or (arg if name.startswith("sjd") else None) or "random"
        if init not in INIT_STRATEGIES:
            raise ValueError(f"unknown SJD init {init!r}; choose one of {INIT_STRATEGIES}")
        drafter = drafter or (arg if name in RELAXED_METHODS else None) or None
        if drafter is not None and drafter not in RELAXED_DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r} for {name!r}; choose one of {RELAXED_DRAFTERS}")
        if name == "gsd" and drafter == "eagle2":
            raise ValueError("gsd verifies linear drafts; use drafter='eagle' or 'draft' (or method 'lantern' on trees)")
        return name, init, drafter

    # ---- loading ------------------------------------------------------------------------------
    def _load_mmspec(self, directory: Path) -> None:
        """mmspec's layout: LlamaGen-style generator + VQ tokenizer + SmolLM2 text encoder."""
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
        self.model_dir = directory
        self.generator = LlamaGenModel.from_pretrained(directory, dtype=torch.float32).to(self.device)
        self.tokenizer = VQImageTokenizer(VQTokenizer.from_pretrained(directory / manifest["vq"]).to(self.device))
        self.text_encoder = shared_text_encoder(manifest.get("text_encoder_layers", 8), self.device)
        self.draft_source = directory / manifest["draft"] if manifest.get("draft") else None
        self.eagle_dir = directory / manifest["eagle"] if manifest.get("eagle") else None
        self.target = LlamaGenTarget(self.generator)
        uncond = self.generator.cls_embedding.uncond_embedding.detach()
        self._prompt_inputs = lambda prompt: {"caption": self.text_encoder.encode([prompt], uncond)}

    def _load_transformers(self, model: Any, processor: Any, family_kwargs: dict) -> None:
        """A transformers Janus / Emu3 / Chameleon model (object, path or hub id)."""
        import transformers

        from ..adapters.hf_image import SUPPORTED_FAMILIES, image_target_for, image_tokenizer_for

        source = model
        if isinstance(model, (str, Path)):
            config = transformers.AutoConfig.from_pretrained(str(model), trust_remote_code=self.trust_remote_code)
            family = TRANSFORMERS_FAMILIES.get(config.model_type)
            if family is None:
                raise ValueError(f"{model} is a {config.model_type!r} model, not a supported text-to-image model; "
                                 f"supported: mmspec's t2i layout, {', '.join(SUPPORTED_FAMILIES)}")
            model = getattr(transformers, family).from_pretrained(str(model), dtype=torch.float32,
                                                                  trust_remote_code=self.trust_remote_code)
            model = model.to(self.device).eval()
        self.model_dir = Path(source).expanduser() if isinstance(source, (str, Path)) else None
        self._family_kwargs = family_kwargs
        self.target = image_target_for(model, **family_kwargs)
        self.generator = model
        self.tokenizer = image_tokenizer_for(model, **family_kwargs)  # Chameleon's decodes only with a VQGAN decoder
        self.draft_source = None
        self.eagle_dir = None
        self._prompt_inputs = self._transformers_prompts(processor if processor is not None else source, model)

    def _transformers_prompts(self, processor: Any, model) -> Any:
        """prompt -> model inputs: with the family's processor (Janus' image generation mode, Emu3's
        image prefix), a plain tokenizer, or the user's function."""
        if isinstance(processor, (str, Path)):
            processor = self._load_processor(str(processor))
        if processor is None or not callable(processor):
            raise ValueError("a transformers text-to-image model needs processor=...: its processor, a tokenizer, or a "
                             "function prompt -> model inputs (none was found with the model)")
        if not hasattr(processor, "tokenizer") and not hasattr(processor, "encode"):
            return processor  # the user's function
        family = model.config.model_type
        extra = {"generation_mode": "image"} if family == "janus" else {"return_for_image_generation": True} if family == "emu3" else {}
        is_processor = hasattr(processor, "tokenizer")

        def prompt_inputs(prompt: str) -> dict:
            encoded = processor(text=[prompt], return_tensors="pt", **extra) if is_processor else processor(prompt, return_tensors="pt")
            keep = ("input_ids", "image_sizes", "negative_input_ids")
            return {k: v.to(self.device) for k, v in encoded.items() if k in keep}

        return prompt_inputs

    def _load_processor(self, source: str) -> Any:
        """The processor saved at ``source``, else its tokenizer, else None."""
        import transformers

        for auto in (transformers.AutoProcessor, transformers.AutoTokenizer):
            try:
                return auto.from_pretrained(source, trust_remote_code=self.trust_remote_code)
            except (OSError, ValueError, TypeError, KeyError):
                continue
        return None

    # ---- methods ------------------------------------------------------------------------------
    def _draft_generator(self):
        """The draft generator as a Target (loaded once)."""
        if self._draft_target is None:
            from ..modeling.llamagen import LlamaGenModel

            source = self.draft_source
            if source is None:
                raise ValueError(f"method {self.method!r} needs a draft generator: pass draft=... (a smaller model of the "
                                 f"target's family){' or name one in t2i.json' if isinstance(self.target, LlamaGenTarget) else ''}")
            if isinstance(self.target, LlamaGenTarget):
                model = source if isinstance(source, torch.nn.Module) else LlamaGenModel.from_pretrained(source, dtype=torch.float32)
                self._draft_target = LlamaGenTarget(model.to(self.device))
            else:
                from ..adapters.hf_image import image_target_for

                if not isinstance(source, torch.nn.Module):
                    import transformers

                    source = getattr(transformers, type(self.generator).__name__).from_pretrained(
                        str(source), dtype=torch.float32, trust_remote_code=self.trust_remote_code)
                self._draft_target = image_target_for(source.to(self.device).eval(), **self._family_kwargs)
        return self._draft_target

    def _eagle_head(self):
        from ..drafters.image_eagle import ImageEagleHead

        if self.eagle_dir is None:
            raise ValueError("this method drafts with an image EAGLE head: pass eagle_head=DIR (train one with "
                             "`mmspec train image-drafter --model ...`)")
        if self._head is None:
            self._head = ImageEagleHead.load(self.eagle_dir, self.target)
        return self._head

    def make_drafter(self, method: str | None = None) -> Drafter | None:
        """A fresh drafter for ``method`` (default: the pipeline's)."""
        from ..drafters.image_eagle import ImageEagle2Drafter, ImageEagleDrafter

        name, init, drafter = self._parse_method(method, None) if method else (self.method, self.init, self.drafter)
        if name == "ar":
            return None
        if name in RELAXED_METHODS:
            kind = drafter or ("eagle" if self.eagle_dir is not None else "draft")
        else:
            kind = {"spec": "draft", "eagle": "eagle", "eagle2": "eagle2"}.get(name)
        if kind == "draft":
            return ModelDrafter(self._draft_generator(), num_draft_tokens=self.num_draft_tokens or 4)
        if kind == "eagle":
            return ImageEagleDrafter(self.target, self._eagle_head(), num_draft_tokens=self.num_draft_tokens or 4)
        if kind == "eagle2":
            return ImageEagle2Drafter(self.target, self._eagle_head(), depth=self.num_draft_tokens or 6, max_nodes=48)
        window = self.window or DEFAULT_WINDOW[name]
        if name == "sjd-pac":
            return ProactiveJacobiDrafter(window, init=init, branches=self.pac_branches, depth=self.pac_depth)
        return JacobiDrafter(window, init=init, coupled=name == "sjd-coupled")

    def acceptance(self, method: str | None = None) -> tuple[str | None, dict | None]:
        """(acceptance rule, its parameters) of ``method``: the relaxed rules need the codebook's
        neighbour table (built once per process; on disk under ``$MMSPEC_CACHE/neighbours``, named by
        k and a hash of the codebook, so the model directories stay read-only)."""
        name = self._parse_method(method, None)[0] if method else self.method
        if name not in RELAXED_METHODS:
            return None, None
        if self._neighbours is None:
            from ..core.relaxed import cached_neighbour_table
            from ..hub import cache_dir

            self._neighbours = cached_neighbour_table(self.tokenizer.codebook_embeddings().cpu(), self.neighbours_k,
                                                      cache_dir() / "neighbours").to(self.device)
        return name, {"neighbours": self._neighbours, **self.relaxed[name]}

    def set_relaxation(self, neighbours_k: int | None = None, delta: float | None = None, lam: float | None = None,
                       top_m: int | None = None) -> None:
        """Change the relaxed rules' parameters (LANTERN's k and delta, LANTERN++'s lam, GSD's top_m)."""
        current = {k: v for rule in self.relaxed.values() for k, v in rule.items()}
        delta, lam, top_m = (current[k] if v is None else v for k, v in (("delta", delta), ("lam", lam), ("top_m", top_m)))
        neighbours_k = neighbours_k or self.neighbours_k
        if delta < 0 or lam < 1 or neighbours_k < 1 or top_m < 1:
            raise ValueError(f"need delta >= 0, lam >= 1, neighbours_k >= 1, top_m >= 1 (got {delta}, {lam}, {neighbours_k}, {top_m})")
        self.relaxed = {"lantern": {"delta": delta}, "lantern++": {"lam": lam}, "gsd": {"top_m": top_m}}
        if neighbours_k != self.neighbours_k:
            self.neighbours_k, self._neighbours = neighbours_k, None

    def prompt_inputs(self, prompt: str) -> dict[str, Any]:
        """prompt -> the target's model inputs (caption features, or prompt ids), without guidance."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("empty prompt: describe the image to generate, e.g. 'a red circle above a blue square'")
        return self._prompt_inputs(prompt)

    def generate_tokens(self, model_inputs: dict[str, Any], seed: int, method: str | None = None,
                        max_new_tokens: int | None = None, **sampling):
        """One image's tokens with ``method`` (default: the pipeline's): its drafter, its acceptance
        rule and parameters, through :func:`mmspec.generate`. Returns the GenerateOutput."""
        acceptance, rule_kwargs = self.acceptance(method)
        return generate(self.target, drafter=self.make_drafter(method), seed=seed,
                        max_new_tokens=max_new_tokens or self.target.num_image_tokens, acceptance=acceptance,
                        rule_kwargs=rule_kwargs, **model_inputs, **sampling)

    def _run(self, method: str | None, model_inputs: dict, seeds: list[int], progress, **sampling) -> tuple[list[SpecStats], torch.Tensor, torch.Tensor, float]:
        started = time.perf_counter()
        runs, tokens, maps = [], [], []
        n = self.target.num_image_tokens
        for seed in seeds:
            out = self.generate_tokens(model_inputs, seed, method, **sampling)
            runs.append(out.stats)
            tokens.append(out.sequences[0, -n:])
            maps.append(torch.tensor(out.stats.step_of_token()))
            if progress is not None:
                progress.update(1)
        return runs, torch.stack(tokens), torch.stack(maps).view(len(seeds), *self.target.grid), time.perf_counter() - started

    def decode(self, tokens: torch.Tensor) -> list:
        from .images import to_pil

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
        model_inputs = self.prompt_inputs(prompt)
        base_seed = 0 if seed is None else seed
        seeds = [base_seed + i for i in range(num_images)]
        sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, guidance_scale=guidance_scale)
        bar = _progress_bar(num_images * (2 if compare_baseline else 1)) if progress else None
        if compare_baseline:  # warm-up, so neither side pays first-call costs
            self.generate_tokens(model_inputs, 0, max_new_tokens=min(8, self.target.num_image_tokens), **sampling)
        runs, tokens, maps, seconds = self._run(None, model_inputs, seeds, bar, **sampling)
        stats = TextToImageStats.collect(self.method, runs, seconds)
        output = TextToImageOutput(self.decode(tokens), tokens, maps, stats)
        if compare_baseline:
            base_runs, base_tokens, _, base_seconds = self._run("ar", model_inputs, seeds, bar, **sampling)
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
