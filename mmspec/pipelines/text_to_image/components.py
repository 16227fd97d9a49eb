"""The parts of a text-to-image model, loaded once: :class:`T2IComponents`.

In the manner of diffusers' pipelines, a model is a set of components that the pipeline, the
benchmark (``mmspec bench t2i``) and the image-drafter recipe (``mmspec train image-drafter``)
share: the image-token generator behind :class:`~mmspec.adapters.image_gen.GuidedImageTarget`, the
image tokenizer (tokens <-> pixels, codebook), the prompt encoder (mmspec's SmolLM2 text encoder,
or a transformers processor) and, loaded on first use, the draft generator, the image EAGLE head
and the codebook's neighbour tables. :meth:`T2IComponents.from_pretrained` loads

* ``None``: the embedded default in ``models/`` (``t2i``, ``t2i-vq``, ``t2i-draft``, ``t2i-eagle``);
* a directory with ``t2i.json`` (mmspec's LlamaGen-style layout: the manifest names the tokenizer
  ``vq``, the ``draft`` and the ``eagle`` head directories relative to it, and
  ``text_encoder_layers``);
* a transformers Janus, Emu3 or Chameleon / Anole model: a local path, a hub id or the loaded
  model (:mod:`mmspec.adapters.image`); its processor turns prompts into input ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pathlib import Path
from typing import Any, Callable

import torch

from ...adapters.image_gen import GuidedImageTarget, LlamaGenTarget, VQImageTokenizer
from ...hub import (ALIASES as TEXT_MODELS, cannot_load, dtype_name, is_remote_code_refusal, no_models_note, remote_code_refused,
                    resolve_device, resolve_dtype)
from .prompts import ImageComponents, shared_text_encoder

MODEL_FILE = "t2i.json"
MAR_FILE = "mar.json"
#: transformers families by config.model_type -> the class to load
TRANSFORMERS_FAMILIES = {
    "janus": "JanusForConditionalGeneration",
    "emu3": "Emu3ForConditionalGeneration",
    "chameleon": "ChameleonForConditionalGeneration",
}
#: per family, the processor's keywords for an image-generation prompt
PROCESSOR_KWARGS = {"janus": {"generation_mode": "image"}, "emu3": {"return_for_image_generation": True}}


def default_t2i_dir() -> Path:
    from ...hub import models_dir

    return models_dir() / "t2i"


def looks_local(model: str | Path) -> bool:
    """A directory, or a path (absolute, ~ or ./-relative) rather than a hub id "org/name"."""
    text = str(model)
    return isinstance(model, Path) or Path(text).expanduser().is_dir() or text.startswith(("/", "~", "."))


@dataclass
class T2IComponents(ImageComponents):
    """A text-to-image model as components (see the module doc).

    Attributes:
        target: the generator as a :class:`~mmspec.adapters.image_gen.GuidedImageTarget`
            (verifies every method's drafts; ``target.model`` is the generator itself).
        tokenizer: the :class:`~mmspec.adapters.image_gen.ImageTokenizer` (tokens [B, N] <->
            images [B, 3, H, W]; its codebook gives the neighbour tables).
        encode: prompt -> the target's model inputs without the guidance scale (LlamaGen:
            ``{"caption": [1, P, C]}`` from the text encoder, which also takes ``warn_cut=False``;
            transformers: ``{"input_ids": [1, T], ...}`` from the processor).
        draft: the draft generator of ``spec`` / ``drafter="draft"``: None, a path, a model of the
            target's family, or a loaded GuidedImageTarget (:meth:`draft_target` loads it once).
        eagle_head: the image EAGLE head: None, a directory, or a loaded ImageEagleHead
            (:meth:`eagle_head_model` loads it once).
        model_dir: where the model was loaded from (None for a model object).
        load_draft: the family's loader, draft source (path or model) -> GuidedImageTarget.
        optimize: apply :func:`mmspec.optimize` to each network as it loads (the generator, the
            draft, the EAGLE head); ``linears`` says which kernel ran ("as loaded" without).
    """

    target: GuidedImageTarget
    tokenizer: Any
    encode: Callable[[str], dict[str, Any]]
    draft: Any = None
    eagle_head: Any = None
    model_dir: Path | None = None
    load_draft: Callable[[Any], GuidedImageTarget] | None = None
    optimize: bool = False
    linears: str = "as loaded"
    dtype: torch.dtype = torch.float32
    _neighbours: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    #: discrete image tokens (MARComponents: continuous)
    continuous = False

    @property
    def device(self) -> torch.device:
        """The generator's device."""
        return self.target.device

    @staticmethod
    def names_continuous(model: Any) -> bool:
        """Whether ``model`` names a continuous-token (MAR) model, read without loading it:
        ``"mar"`` or a directory with ``mar.json`` (what :meth:`from_pretrained` loads as one)."""
        return model == "mar" or (isinstance(model, (str, Path)) and (Path(model).expanduser() / MAR_FILE).is_file())

    @staticmethod
    def batch_size_one_reason(model: Any, trust_remote_code: bool = False) -> str | None:
        """Why the model ``model`` names decodes one image at a time ("Emu3 (...) inserts an
        end-of-line token ..."), read from a transformers checkpoint's config without loading its
        weights; None where it batches, or where the config cannot be read (loading then says why).
        mmspec's own layouts batch."""
        from ...adapters.image import IMAGE_FAMILIES

        if model is None or T2IComponents.names_continuous(model) or not isinstance(model, (str, Path)):
            return None
        if (Path(model).expanduser() / MODEL_FILE).is_file():
            return None
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            return None
        family = IMAGE_FAMILIES.get(getattr(config, "model_type", None))
        reason = family and family.target.batch_size_one_reason
        return f"{family.description.split(' (')[0]} {reason}" if reason else None

    @classmethod
    def from_pretrained(cls, model: Any = None, device: str | torch.device = "auto", *, processor: Any = None,
                        image_tokenizer: Any = None, grid: tuple[int, int] | None = None, draft: Any = None,
                        eagle_head: Any = None, trust_remote_code: bool = False, optimize: bool = True,
                        dtype: str | torch.dtype = "float32", cuda_graphs: bool = False) -> "T2IComponents":
        """Load a model's components.

        Args:
            model: None (the embedded default), a directory with ``t2i.json``, or a transformers
                Janus / Emu3 / Chameleon model (path, hub id or object).
            device: "auto" | "cpu" | "cuda" | "cuda:N".
            processor: transformers models: a processor or tokenizer (default: the one saved with
                the model), or a callable prompt -> dict of model inputs.
            image_tokenizer: overrides the image tokenizer (e.g. Chameleon's
                :class:`~mmspec.adapters.image.chameleon.ChameleonImageTokenizer` with its VQGAN decoder).
            grid: Emu3's (rows, columns) of codes (default 90 x 90).
            draft, eagle_head: override the draft generator and the EAGLE head ``t2i.json`` names.
            trust_remote_code: passed to transformers.
            optimize: few-row linears for the networks it loads (:func:`mmspec.optimize`; a model
                object passed in is the caller's and left as it is).
            dtype: the generator's and its draft's weights (float32 by default; "auto" = bfloat16
                where the machine computes it fast, :func:`mmspec.hub.resolve_dtype`). The text
                encoder and the image tokenizer stay float32; MAR models run in float32 only ("auto"
                is float32 for them).
            cuda_graphs: the generator and its draft verify through CUDA graphs
                (:class:`~mmspec.adapters.image_gen.LlamaGenTarget` ``captured``): mmspec's
                LlamaGen-style layout on a CUDA device only.
            A directory with ``mar.json``, or ``"mar"`` (the embedded default ``models/mar``), loads
            a continuous-token model's :class:`~mmspec.pipelines.text_to_image.mar_components.MARComponents`.
        Raises:
            FileNotFoundError: a path that is no text-to-image model.
            ValueError: an unsupported family, a manifest without tokenizer, a tokenizer that does
                not match the generator, a transformers model without processor.
        """
        if isinstance(model, str) and model in TEXT_MODELS:
            raise ValueError(f"{model!r} is mmspec's built-in text model (mmspec generate --model {model}); text-to-image "
                             "takes a t2i.json directory, a Janus / Emu3 / Chameleon checkpoint, 'mar', or no model for "
                             "the embedded one")
        for name, part in (("draft", draft), ("eagle_head", eagle_head)):  # (loaded on first use: checked now)
            if isinstance(part, (str, Path)) and not Path(part).expanduser().exists():
                raise FileNotFoundError(f"{name}={str(part)!r}: no such file or directory")
        if grid is not None:
            check_grid(grid, model)
        if isinstance(processor, (str, Path)) and looks_local(processor) and not Path(processor).expanduser().exists():
            raise FileNotFoundError(f"processor={str(processor)!r}: no such file or directory")
        device = resolve_device(device)
        # "auto" is the fast dtype where a model can take it: a MAR model runs in float32 only
        dtype = torch.float32 if dtype == "auto" and cls.names_continuous(model) else resolve_dtype(dtype, device)
        local = isinstance(model, (str, Path))
        mmspec_layout = model is None or (local and (Path(model).expanduser() / MODEL_FILE).is_file())
        if cuda_graphs and (device.type != "cuda" or not mmspec_layout):
            raise ValueError("cuda_graphs needs a CUDA device and mmspec's LlamaGen-style layout (the embedded model or a "
                             f"t2i.json directory), got device {device} and model {model!r}; drop cuda_graphs")
        if cls.names_continuous(model):
            if dtype != torch.float32:
                raise ValueError(f"MAR models run in float32 only; drop dtype={dtype_name(dtype)!r} (--dtype "
                                 f"{dtype_name(dtype)}; the diffusion chain's small variances need float32)")
            from .mar_components import MARComponents, default_mar_dir

            directory = default_mar_dir() if model == "mar" else Path(model).expanduser()
            if not (directory / MAR_FILE).is_file():
                raise FileNotFoundError((model == "mar" and no_models_note()) or f"{directory} holds no {MAR_FILE}: train "
                                        "the embedded MAR with `mmspec train kl` and `mmspec train mar`")
            components = MARComponents.load(directory, device, optimize)
            if draft is not None:
                components.draft = draft
            return components
        if mmspec_layout:
            components = _load_mmspec(Path(model).expanduser() if model is not None else default_t2i_dir(), device, dtype,
                                      cuda_graphs)
        elif local and looks_local(model) and not (Path(model).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"{model} is not a text-to-image model directory (no {MODEL_FILE} and no "
                                    "transformers config.json); pass model=None for the embedded default")
        else:
            components = _load_transformers(model, device, processor, {} if grid is None else {"grid": tuple(grid)},
                                            trust_remote_code, dtype, draft, image_tokenizer is not None)
        if image_tokenizer is not None:
            components.tokenizer = image_tokenizer
        if draft is not None:
            components.draft = draft
        if eagle_head is not None:
            components.eagle_head = Path(eagle_head).expanduser() if isinstance(eagle_head, (str, Path)) else eagle_head
        target, tokenizer = components.target, components.tokenizer
        if tokenizer.grid != target.grid or tokenizer.vocab_size != target.vocab_size:
            raise ValueError(f"the generator ({target.grid}, {target.vocab_size} codes) and the tokenizer "
                             f"({tokenizer.grid}, {tokenizer.vocab_size} codes) do not match")
        components.optimize = optimize and not isinstance(model, torch.nn.Module)
        components.prepare(target.model)
        return components

    @property
    def image_size(self) -> int:
        """Side of the images in pixels (mmspec's VQ tokenizer)."""
        return self.tokenizer.vq.config.image_size

    def draft_target(self) -> GuidedImageTarget:
        """The draft generator as a target (loaded on first use)."""
        if self.draft is None:
            named = " or name one in t2i.json" if isinstance(self.target, LlamaGenTarget) else ""
            raise ValueError(f"this method needs a draft generator: pass draft=... (a smaller model of the target's "
                             f"family){named}")
        if not isinstance(self.draft, GuidedImageTarget):
            loaded_here = not isinstance(self.draft, torch.nn.Module)
            self.draft = self.load_draft(self.draft)
            if loaded_here:
                self.prepare(self.draft.model)
        return self.draft

    def eagle_head_model(self):
        """The image EAGLE head (loaded on first use)."""
        from ...modeling.heads import ImageEagleHead

        if self.eagle_head is None:
            raise ValueError("this method drafts with an image EAGLE head: pass eagle_head=DIR (train one with "
                             "`mmspec train image-drafter --model ...`)")
        if not isinstance(self.eagle_head, ImageEagleHead):
            self.eagle_head = ImageEagleHead.load(self.eagle_head, self.target)
            self.prepare(self.eagle_head)
        return self.eagle_head

    def neighbours(self, k: int) -> torch.Tensor:
        """LongTensor [V, k]: the k nearest codes of every code in the tokenizer's codebook (built
        once per k and process; on disk under ``$MMSPEC_CACHE/neighbours``, named by k and a hash of
        the codebook, so the model directories stay read-only)."""
        if k not in self._neighbours:
            from ...core.relaxed import cached_neighbour_table
            from ...hub import cache_dir

            table = cached_neighbour_table(self.tokenizer.codebook_embeddings().cpu(), k, cache_dir() / "neighbours")
            self._neighbours[k] = table.to(self.target.device)
        return self._neighbours[k]

    def generate_tokens(self, drafter, acceptance: str | None, rule_kwargs: dict | None, model_inputs: dict[str, Any],
                        seed: int, max_new_tokens: int | None = None, **sampling: Any):
        """One image's tokens through :func:`mmspec.generate`: ``sequences[0, -N:]`` are the
        N = rows * columns codes. ``sampling``: do_sample, temperature, top_k, top_p, guidance_scale."""
        from ...api import generate

        return generate(self.target, drafter=drafter, seed=seed, max_new_tokens=max_new_tokens or self.target.num_image_tokens,
                        acceptance=acceptance, rule_kwargs=rule_kwargs, **model_inputs, **sampling)

    def decode(self, tokens: torch.Tensor) -> list:
        """LongTensor [B, rows * columns] image tokens -> B PIL images, each decoded alone: a
        convolution over a batch can round otherwise than over one image, and image i of a call
        must be the image its seed gives alone, bit for bit."""
        from ..images import to_pil

        return [image for row in tokens.to(self.target.device) for image in to_pil(self.tokenizer.decode(row[None]))]


def _load_mmspec(directory: Path, device: torch.device, dtype: torch.dtype, captured: bool = False) -> T2IComponents:
    """mmspec's layout: LlamaGen-style generator + VQ tokenizer + SmolLM2 text encoder."""
    from ...modeling.llamagen import LlamaGenModel
    from ...modeling.vq import VQTokenizer

    manifest_path = directory / MODEL_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError((directory == default_t2i_dir() and no_models_note()) or (
            f"{directory} is not a text-to-image model directory (no {MODEL_FILE}); pass model=None for the "
            "embedded default or train one with `mmspec train vq` and `mmspec train t2i`"))
    manifest = json.loads(manifest_path.read_text())
    if "vq" not in manifest:
        raise ValueError(f"{manifest_path} names no image tokenizer ('vq'); a text-to-image model needs one")
    generator = LlamaGenModel.from_pretrained(directory, dtype=dtype).to(device)
    text_encoder = shared_text_encoder(manifest.get("text_encoder_layers", 8), device)
    uncond = generator.cls_embedding.uncond_embedding.detach()

    def load_draft(source) -> LlamaGenTarget:
        model = source if isinstance(source, torch.nn.Module) else LlamaGenModel.from_pretrained(source, dtype=dtype)
        return LlamaGenTarget(model.to(device), captured=captured)

    return T2IComponents(
        target=LlamaGenTarget(generator, captured=captured),
        tokenizer=VQImageTokenizer(VQTokenizer.from_pretrained(directory / manifest["vq"]).to(device)),
        encode=lambda prompt, warn_cut=True: {"caption": text_encoder.encode([prompt], uncond, warn_cut=warn_cut)},
        draft=directory / manifest["draft"] if manifest.get("draft") else None,
        eagle_head=directory / manifest["eagle"] if manifest.get("eagle") else None,
        model_dir=directory, load_draft=load_draft, dtype=dtype)


def check_same_family(draft: str | Path, model_type: str, trust_remote_code: bool) -> None:
    """A draft checkpoint's directory or hub id: a model of the target's family ``model_type``
    (one ValueError line; transformers would build a full-size random model without a config, or
    fail on mismatched sizes after loading)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(draft), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if is_remote_code_refusal(error):
            raise remote_code_refused(draft) from None
        raise ValueError(f"draft {str(draft)!r} is no transformers checkpoint ({str(error).splitlines()[0]}); give a smaller "
                         f"{model_type} checkpoint") from None
    if config.model_type != model_type:
        raise ValueError(f"draft {str(draft)!r} is a {config.model_type!r} model; the target is {model_type!r}: give a "
                         f"smaller {model_type} checkpoint")


def load_complete(model_class, source: str | Path, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
    """``model_class.from_pretrained(source)``, refused (one ValueError line) where weights of the
    model are missing from the checkpoint: transformers would initialise them at random (a Janus
    without its VQ decoder's weights drew images from noise)."""
    model, info = model_class.from_pretrained(str(source), dtype=dtype, trust_remote_code=trust_remote_code,
                                              output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{source} lacks {len(missing)} of the model's weights ({shown}); transformers would fill them "
                         "at random: give the complete checkpoint")
    return model


def _load_transformers(model: Any, device: torch.device, processor: Any, family_kwargs: dict,
                       trust_remote_code: bool, dtype: torch.dtype, draft: Any = None, has_tokenizer: bool = False) -> T2IComponents:
    """A transformers Janus / Emu3 / Chameleon model (object, path or hub id)."""
    import transformers

    from ...adapters.image import SUPPORTED_FAMILIES, image_target_for, image_tokenizer_for

    source = model
    if isinstance(model, (str, Path)):
        try:
            config = transformers.AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
        except OSError as error:  # (offline with a hub id not cached: transformers' two lines about the connection)
            raise cannot_load("model", model, error) from None
        except ValueError as error:
            if is_remote_code_refusal(error):
                raise remote_code_refused(model) from None
            raise
        family = TRANSFORMERS_FAMILIES.get(config.model_type)
        if family is None:
            raise ValueError(f"{model} is a {config.model_type!r} model, not a supported text-to-image model; "
                             f"supported: mmspec's t2i layout, {', '.join(SUPPORTED_FAMILIES)}")
        if config.model_type == "chameleon" and not has_tokenizer:  # (found after every image was made, before)
            raise ValueError(f"{model} is a Chameleon checkpoint, whose images transformers cannot decode (it ships no VQGAN "
                             "decoder): in Python pass image_tokenizer=ChameleonImageTokenizer(vq, "
                             "ChameleonVQDecoder.from_vqgan_state_dict(...)) with Chameleon's tokenizer/vqgan.ckpt "
                             "(docs/text-to-image.md); the command line cannot load one")
        _check_grid_family(family_kwargs, config.model_type, str(model))
        if isinstance(draft, (str, Path)):  # (loaded on first use: its family checked before the target loads)
            check_same_family(draft, config.model_type, trust_remote_code)
        model = load_complete(getattr(transformers, family), model, dtype, trust_remote_code)
        model = model.to(device).eval()

    if not isinstance(source, (str, Path)):  # (a model object: its family known only now)
        _check_grid_family(family_kwargs, model.config.model_type, "this")

    def load_draft(draft) -> GuidedImageTarget:
        if not isinstance(draft, torch.nn.Module):
            check_same_family(draft, model.config.model_type, trust_remote_code)
            draft = load_complete(type(model), draft, dtype, trust_remote_code)
        return image_target_for(draft.to(device).eval(), **family_kwargs)

    if isinstance(processor, (str, Path)):  # the user's: one that does not load is refused, not "none found"
        named, processor = processor, _load_processor(str(processor), trust_remote_code)
        if processor is None:
            raise ValueError(f"processor={str(named)!r} holds no processor or tokenizer transformers can load; pass the "
                             "model's processor directory (its preprocessor/tokenizer files) or leave processor out")
    elif processor is None and isinstance(source, (str, Path)):
        processor = _load_processor(str(source), trust_remote_code)
    return T2IComponents(
        target=image_target_for(model, **family_kwargs),
        tokenizer=image_tokenizer_for(model, **family_kwargs),  # Chameleon's decodes only with a VQGAN decoder
        encode=_prompt_encoder(processor, model.config.model_type, device),
        model_dir=Path(source).expanduser() if isinstance(source, (str, Path)) else None, load_draft=load_draft,
        dtype=next(model.parameters()).dtype)


def _prompt_encoder(processor: Any, family: str, device: torch.device) -> Callable[[str], dict]:
    """prompt -> model inputs: with the family's processor (Janus' image generation mode, Emu3's
    image prefix), a plain tokenizer, or the user's function."""
    if processor is None or not callable(processor):
        raise ValueError("a transformers text-to-image model needs processor=...: its processor, a tokenizer, or a "
                         "function prompt -> model inputs (none was found with the model)")
    if not hasattr(processor, "tokenizer") and not hasattr(processor, "encode"):
        return processor  # the user's function
    is_processor = hasattr(processor, "tokenizer")
    extra = PROCESSOR_KWARGS.get(family, {})

    def encode(prompt: str) -> dict:
        encoded = processor(text=[prompt], return_tensors="pt", **extra) if is_processor else processor(prompt, return_tensors="pt")
        keep = ("input_ids", "image_sizes", "negative_input_ids")
        return {k: v.to(device) for k, v in encoded.items() if k in keep}

    return encode


def check_grid(grid: Any, model: Any) -> None:
    """Refuse a ``grid`` that is no (rows, columns) pair of positive integers, or one given for a
    model whose grid its VQ model fixes (mmspec's layout, MAR): only Emu3 generates at a chosen grid
    (a transformers checkpoint's family is checked when its config is read)."""
    try:
        rows, columns = (int(g) for g in grid)
        valid = rows > 0 and columns > 0 and all(int(g) == g for g in grid)
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"grid={grid!r}: give (rows, columns), two positive integers, e.g. grid=(32, 32)")
    local = isinstance(model, (str, Path))
    if model is None or model == "mar" or (local and ((Path(model).expanduser() / MODEL_FILE).is_file()
                                                      or (Path(model).expanduser() / MAR_FILE).is_file())):
        raise ValueError("grid= sets an Emu3 model's rows and columns of codes; this model's grid is fixed by its image "
                         "tokenizer: drop grid")


def _check_grid_family(family_kwargs: dict, model_type: str, name: str) -> None:
    if family_kwargs.get("grid") is not None and model_type != "emu3":
        raise ValueError(f"grid= sets an Emu3 model's rows and columns of codes; {name} is a {model_type!r} model, whose "
                         "grid is fixed by its VQ model: drop grid")


def _load_processor(source: str, trust_remote_code: bool) -> Any:
    """The processor saved at ``source``, else its tokenizer, else None."""
    import transformers

    for auto in (transformers.AutoProcessor, transformers.AutoTokenizer):
        try:
            return auto.from_pretrained(source, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError, KeyError) as error:
            if is_remote_code_refusal(error):  # (a processor of its own code: not "no processor found")
                raise remote_code_refused(source) from None
            continue
    return None
