"""The parts of a continuous-token (MAR-style) text-to-image model: :class:`MARComponents`.

A directory with ``mar.json`` (the embedded default is ``models/mar``): the generator
(:class:`~mmspec.modeling.mar.MARModel`, ``mar_config.json`` + ``mar.safetensors``) behind
:class:`~mmspec.adapters.image.mar.MARTarget`, the KL autoencoder the manifest names (``kl``), the
frozen SmolLM2 text encoder of the embedded text-to-image model (``text_encoder_layers``) and the
draft MAR (``draft``) of ``method="cspd"``. The same interface as
:class:`~mmspec.pipelines.t2i_components.T2IComponents`, so the text-to-image pipeline, its methods
and ``mmspec bench t2i`` take either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..adapters.image.mar import MARTarget
from ..api import GenerateOutput, generate, make_generator
from ..core.stats import SpecStats
from ..modeling.fast_linear import OptimizesOnLoad
from ..modeling.kl_vae import KLAutoencoder
from ..modeling.mar import MARModel

MODEL_FILE = "mar.json"


def default_mar_dir() -> Path:
    from ..hub import models_dir

    return models_dir() / "mar"


def check_continuous_sampling(do_sample: bool, top_k: int | None, top_p: float | None) -> None:
    """A diffusion head always samples, and has no vocabulary to cut (one ValueError line)."""
    if not do_sample:
        raise ValueError("a continuous-token (MAR) model samples its tokens with a diffusion head; keep do_sample=True "
                         "(lower the temperature for less diverse images)")
    if top_k or (top_p is not None and top_p < 1.0):
        raise ValueError("top_k / top_p cut a token vocabulary; a continuous-token (MAR) model has none: leave them unset")


@dataclass
class MARComponents(OptimizesOnLoad):
    """A MAR-style model as components.

    Attributes:
        target: the generator as a :class:`MARTarget` (``target.model`` is the MARModel).
        autoencoder: the :class:`~mmspec.modeling.kl_vae.KLAutoencoder` (latents -> pixels).
        encode: prompt -> ``{"text": [1, 40, C]}`` caption features.
        draft: the draft MAR of ``cspd``: None, a directory, or a loaded MARTarget.
        order: the generation order, "random" (MAR) or "raster".
    """

    target: MARTarget
    autoencoder: KLAutoencoder
    encode: Callable[[str], dict[str, Any]]
    draft: Any = None
    model_dir: Path | None = None
    order: str = "random"
    optimize: bool = False
    linears: str = "as loaded"
    continuous = True

    @classmethod
    def load(cls, directory: Path, device: torch.device, optimize: bool = True) -> "MARComponents":
        from .t2i_components import shared_text_encoder

        manifest = json.loads((directory / MODEL_FILE).read_text())
        if "kl" not in manifest:
            raise ValueError(f"{directory / MODEL_FILE} names no autoencoder ('kl'); a MAR model needs one")
        model = MARModel.from_pretrained(directory).to(device)
        if not model.config.text_dim:
            raise ValueError(f"{directory} is a class-conditional MAR; the text-to-image pipeline needs a text-conditioned one")
        text_encoder = shared_text_encoder(manifest.get("text_encoder_layers", 8), device)
        null = torch.zeros(model.config.buffer_size, text_encoder.feature_dim)
        components = cls(target=MARTarget(model), autoencoder=KLAutoencoder.from_pretrained(directory / manifest["kl"]).to(device),
                         encode=lambda prompt: {"text": text_encoder.encode([prompt], null)},
                         draft=directory / manifest["draft"] if manifest.get("draft") else None, model_dir=directory,
                         optimize=optimize)
        components.prepare(model)
        return components

    @property
    def generator(self) -> torch.nn.Module:
        return self.target.model

    @property
    def image_size(self) -> int:
        return self.autoencoder.config.resolution

    def prompt_inputs(self, prompt: str) -> dict[str, Any]:
        from .t2i_components import check_prompt

        check_prompt(prompt)
        return self.encode(prompt)

    def draft_target(self) -> MARTarget:
        """The draft MAR (loaded on first use)."""
        if self.draft is None:
            raise ValueError("method 'cspd' needs a draft MAR: pass draft=DIR or name one in mar.json "
                             "(train one with `mmspec train mar --preset draft`)")
        if not isinstance(self.draft, MARTarget):
            model = self.draft if isinstance(self.draft, MARModel) else MARModel.from_pretrained(self.draft)
            self.prepare(model)
            self.draft = MARTarget(model.to(self.target.device))
        return self.draft

    def _inputs(self, model_inputs: dict[str, Any], seed: int, temperature: float, guidance_scale: float) -> dict[str, Any]:
        generator = make_generator(seed, self.target.device)
        return self.target.prepare_inputs(generator, order=self.order, chain_temperature=temperature,
                                          guidance_scale=guidance_scale, **model_inputs)

    def _raster(self, tokens: torch.Tensor, steps: list[int], order: torch.Tensor, stats: SpecStats) -> GenerateOutput:
        n = self.target.num_image_tokens
        placed = order[: tokens.shape[1]]  # fewer than N tokens when max_new_tokens cut the image short
        raster = tokens.new_zeros(1, n, tokens.shape[2])
        raster[:, placed] = tokens
        token_steps = torch.zeros(n, dtype=torch.long)
        token_steps[placed.cpu()] = torch.tensor(steps, dtype=torch.long)
        return GenerateOutput(sequences=raster, stats=stats, token_steps=token_steps)

    def generate_tokens(self, drafter, acceptance: str | None, rule_kwargs: dict | None, model_inputs: dict[str, Any],
                        seed: int, max_new_tokens: int | None = None, do_sample: bool = True, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None, guidance_scale: float | None = None) -> GenerateOutput:
        """One image through :func:`mmspec.generate`: order and chain noise drawn from ``seed``;
        ``sequences`` [1, N, D] in raster order."""
        check_continuous_sampling(do_sample, top_k, top_p)
        inputs = self._inputs(model_inputs, seed, temperature, guidance_scale or 1.0)
        out = generate(self.target, drafter=drafter, seed=seed, max_new_tokens=max_new_tokens or self.target.num_image_tokens,
                       do_sample=True, acceptance=acceptance, rule_kwargs=rule_kwargs, **inputs)
        return self._raster(out.sequences, out.stats.step_of_token(), inputs["order"], out.stats)

    def generate_parallel(self, num_iter: int, model_inputs: dict[str, Any], seed: int, do_sample: bool = True,
                          temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                          guidance_scale: float | None = None) -> GenerateOutput:
        """MAR's own decoding: ``num_iter`` steps, step i predicting the tokens its cosine schedule
        gives (all tokens of a step independent given the earlier ones), with the same order and
        noise as :meth:`generate_tokens` for the seed."""
        import math
        import time

        check_continuous_sampling(do_sample, top_k, top_p)
        inputs = self._inputs(model_inputs, seed, temperature, guidance_scale or 1.0)
        n = self.target.num_image_tokens
        stats = SpecStats(method=f"mar-parallel:{num_iter}", config={"num_iter": num_iter})
        started = time.perf_counter()
        state, _ = self.target.prefill(inputs)
        steps: list[int] = []
        for i in range(num_iter):
            # MAR's schedule: after step i, floor(N cos(pi/2 (i + 1) / num_iter)) tokens stay unknown
            # (none after the last); every step predicts at least one token while any is left
            unknown_after = 0 if i == num_iter - 1 else max(math.floor(n * math.cos(math.pi / 2 * (i + 1) / num_iter)), 0)
            left = n - state.length
            count = min(max(1, left - unknown_after), left)
            if count <= 0:
                continue
            state.commit(self.target.parallel_step(state, count).sample)
            steps.extend([len(stats.committed_per_step)] * count)
            stats.committed_per_step.append(count)
            stats.target_forwards += 1
        stats.new_tokens = n
        stats.verify_steps = max(len(stats.committed_per_step) - 1, 0)
        stats.wall_time_s = time.perf_counter() - started
        return self._raster(state.tokens, steps, inputs["order"], stats)

    def decode(self, tokens: torch.Tensor) -> list:
        """[B, N, D] tokens in raster order -> B PIL images."""
        from .images import to_pil

        with torch.inference_mode():
            return to_pil(self.autoencoder.decode(self.target.unpatchify(tokens.to(self.target.device))))
