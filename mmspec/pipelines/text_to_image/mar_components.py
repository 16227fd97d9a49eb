"""The parts of a continuous-token (MAR-style) text-to-image model: :class:`MARComponents`.

A directory with ``mar.json`` (the embedded default is ``models/mar``): the generator
(:class:`~mmspec.modeling.mar.MARModel`, ``mar_config.json`` + ``mar.safetensors``) behind
:class:`~mmspec.adapters.image.mar.MARTarget`, the KL autoencoder the manifest names (``kl``), the
frozen SmolLM2 text encoder of the embedded text-to-image model (``text_encoder_layers``) and the
draft MAR (``draft``) of ``method="cspd"``. The same interface as
:class:`~mmspec.pipelines.text_to_image.components.T2IComponents`, so the text-to-image pipeline, its methods
and ``mmspec bench t2i`` take either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ...adapters.image.mar import MARTarget
from ...api import GenerateOutput, generate, generate_rows, make_generator
from ...core.stats import SpecStats
from ...modeling.kl_vae import KLAutoencoder
from ...modeling.mar import MARModel
from .prompts import ImageComponents

MODEL_FILE = "mar.json"


def default_mar_dir() -> Path:
    from ...hub import models_dir

    return models_dir() / "mar"


def check_continuous_sampling(do_sample: bool, top_k: int | None, top_p: float | None) -> None:
    """A diffusion head always samples, and has no vocabulary to cut (one ValueError line)."""
    if not do_sample:
        raise ValueError("a continuous-token (MAR) model samples its tokens with a diffusion head; keep do_sample=True "
                         "(lower the temperature for less diverse images)")
    if top_k or (top_p is not None and top_p < 1.0):
        raise ValueError("top_k / top_p cut a token vocabulary; a continuous-token (MAR) model has none: leave them unset")


@dataclass
class MARComponents(ImageComponents):
    """A MAR-style model as components.

    Attributes:
        target: the generator as a :class:`MARTarget` (``target.model`` is the MARModel).
        autoencoder: the :class:`~mmspec.modeling.kl_vae.KLAutoencoder` (latents -> pixels).
        encode: prompt -> ``{"text": [1, 40, C]}`` caption features.
        draft: the draft MAR of ``cspd``: None, a directory, or a loaded MARTarget.
        order: the generation order, "random" (MAR) or "raster".
    """

    #: MAR runs in float32 only (the diffusion chain's last steps have std ~0.006)
    dtype = torch.float32

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
        from .prompts import shared_text_encoder

        manifest = json.loads((directory / MODEL_FILE).read_text())
        if "kl" not in manifest:
            raise ValueError(f"{directory / MODEL_FILE} names no autoencoder ('kl'); a MAR model needs one")
        model = MARModel.from_pretrained(directory).to(device)
        if not model.config.text_dim:
            raise ValueError(f"{directory} is a class-conditional MAR; the text-to-image pipeline needs a text-conditioned one")
        text_encoder = shared_text_encoder(manifest.get("text_encoder_layers", 8), device)
        null = torch.zeros(model.config.buffer_size, text_encoder.feature_dim)
        components = cls(target=MARTarget(model), autoencoder=KLAutoencoder.from_pretrained(directory / manifest["kl"]).to(device),
                         encode=lambda prompt, warn_cut=True: {"text": text_encoder.encode([prompt], null, warn_cut=warn_cut)},
                         draft=directory / manifest["draft"] if manifest.get("draft") else None, model_dir=directory,
                         optimize=optimize)
        components.prepare(model)
        return components

    @property
    def image_size(self) -> int:
        return self.autoencoder.config.resolution

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

    def generate_token_rows(self, drafter, acceptance: str | None, rule_kwargs: dict | None,
                            model_inputs: list[dict[str, Any]], seeds: list[int], max_new_tokens: int | None = None,
                            do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None, guidance_scale: float | None = None) -> GenerateOutput:
        """Images decoded together (:func:`mmspec.api.generate_rows`), row b from ``model_inputs[b]``
        with ``seeds[b]`` (its order, noise and generator): row b is :meth:`generate_tokens`'s image.
        ``sequences`` [B, N, D] in raster order; ``row_stats`` per image."""
        check_continuous_sampling(do_sample, top_k, top_p)
        rows = [self._inputs(inputs, seed, temperature, guidance_scale or 1.0) for inputs, seed in zip(model_inputs, seeds)]
        out = generate_rows(self.target, rows, drafter=drafter, seed=list(seeds), do_sample=True, acceptance=acceptance,
                            rule_kwargs=rule_kwargs, max_new_tokens=max_new_tokens or self.target.num_image_tokens)
        rasters = [self._raster(out.sequences[b : b + 1, : s.new_tokens], s.step_of_token(), row["order"], s)
                   for b, (s, row) in enumerate(zip(out.row_stats, rows))]
        return GenerateOutput(sequences=torch.cat([r.sequences for r in rasters]), stats=out.stats, row_stats=out.row_stats,
                              token_steps=torch.stack([r.token_steps for r in rasters]))

    def generate_parallel(self, num_iter: int, model_inputs: dict[str, Any], seed: int, do_sample: bool = True,
                          temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                          guidance_scale: float | None = None) -> GenerateOutput:
        """MAR's own decoding: ``num_iter`` steps, step i predicting the tokens its cosine schedule
        gives (all tokens of a step independent given the earlier ones), with the same order and
        noise as :meth:`generate_tokens` for the seed."""
        return self._parallel(num_iter, [model_inputs], [seed], do_sample, temperature, top_k, top_p, guidance_scale)[0][0]

    def generate_parallel_rows(self, num_iter: int, model_inputs: list[dict[str, Any]], seeds: list[int],
                               do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None,
                               top_p: float | None = None, guidance_scale: float | None = None) -> GenerateOutput:
        """:meth:`generate_parallel` of several images at once, each step one forward and one batch of
        chains for all of them: row b is ``generate_parallel(num_iter, model_inputs[b], seeds[b])``'s
        image. ``sequences`` [B, N, D] in raster order; ``row_stats`` per image."""
        rasters, stats = self._parallel(num_iter, model_inputs, seeds, do_sample, temperature, top_k, top_p, guidance_scale)
        return GenerateOutput(sequences=torch.cat([r.sequences for r in rasters]), stats=stats,
                              row_stats=[r.stats for r in rasters], token_steps=torch.stack([r.token_steps for r in rasters]))

    def _parallel(self, num_iter, model_inputs, seeds, do_sample, temperature, top_k, top_p,
                  guidance_scale) -> tuple[list[GenerateOutput], SpecStats]:
        """MAR's decoding of B images together: each image's raster output, and the batch's stats."""
        import math
        import time

        from ...core.batch import batch_stats
        from ...core.continuous import MaskedARBatch

        check_continuous_sampling(do_sample, top_k, top_p)
        rows = [self._inputs(inputs, seed, temperature, guidance_scale or 1.0) for inputs, seed in zip(model_inputs, seeds)]
        n = self.target.num_image_tokens
        counts: list[int] = []
        started = time.perf_counter()
        batch = MaskedARBatch([self.target._state(row, None) for row in rows])
        for i in range(num_iter):
            # MAR's schedule: after step i, floor(N cos(pi/2 (i + 1) / num_iter)) tokens stay unknown
            # (none after the last); every step predicts at least one token while any is left
            unknown_after = 0 if i == num_iter - 1 else max(math.floor(n * math.cos(math.pi / 2 * (i + 1) / num_iter)), 0)
            left = n - batch.rows[0].length
            count = min(max(1, left - unknown_after), left)
            if count <= 0:
                continue
            batch.commit([step.sample for step in self.target.parallel_step_rows(batch.rows, [count] * len(rows))])
            counts.append(count)
        wall = time.perf_counter() - started
        steps = [step for step, count in enumerate(counts) for _ in range(count)]  # the step that made each token
        outputs = []
        for row, inputs in zip(batch.rows, rows):
            # the first step plays the prefill (tau = tokens a later step commits)
            stats = SpecStats(method=f"mar-parallel:{num_iter}", config={"num_iter": num_iter}, new_tokens=n,
                              verify_steps=len(counts) - 1, target_forwards=len(counts), prefill_tokens=counts[0],
                              committed_per_step=counts[1:], wall_time_s=wall)
            outputs.append(self._raster(row.tokens, steps, inputs["order"], stats))
        return outputs, batch_stats([o.stats for o in outputs], wall, len(counts))

    def decode(self, tokens: torch.Tensor) -> list:
        """[B, N, D] tokens in raster order -> B PIL images, each decoded alone (the same bits as
        that image's call alone)."""
        from ..images import to_pil

        with torch.inference_mode():
            return [image for row in tokens.to(self.target.device)
                    for image in to_pil(self.autoencoder.decode(self.target.unpatchify(row[None])))]
