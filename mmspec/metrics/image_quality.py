"""Text-to-image quality metrics computed with the project's own small CLIP model.

The metric model (``models/t2i-clip``, trained by ``mmspec train clip``) is an open_clip ``CLIP``
(a small ViT on 64 x 64 images and a small causal text transformer) trained from scratch with the
contrastive CLIP loss on the project's rendered scenes (:mod:`mmspec.train.t2i_data`: 1-4 coloured
shapes on a plain background, with their captions). It is **not** OpenAI CLIP and **not** the
Inception network of FID, so:

* :func:`prompt_score` is "CLIP-score style" (100 x the cosine similarity of the image and prompt
  embeddings, clipped at 0) and :func:`frechet_clip_distance` is "FID style" (Fréchet distance of
  image embeddings), but their numbers are **not comparable to published CLIP-score / FID**
  values, nor to the same metrics computed with another metric model (retraining the metric model
  changes every number).
* The model only knows the scenes' world: images outside the rendered-scene distribution and
  prompt words absent from the training captions (mapped to one "unknown" token) are measured
  poorly. Images are resized to the model's 64 x 64 input, so fine detail is not measured.
* The Fréchet distance is estimated from sample means and covariances; with few images the
  estimate is biased **upward** (the covariance noise adds to the trace term) and the bias depends
  on the set size. Compare only methods measured with the same number of images (and the same
  reference set); treat small differences between methods as noise. :func:`prompt_score` is an
  average over pairs and has no such bias, only sampling noise.

Images: PIL images, uint8 tensors ``[B, 3, H, W]`` (or one ``[3, H, W]``) in 0..255, or float
tensors in the project's model range [-1, 1] (what the text-to-image pipeline decodes to; see
:func:`mmspec.train.t2i_data.to_model_range`).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "model.safetensors"
PAD_ID, UNK_ID = 0, 1  # compact token ids; the kept BPE tokens follow from 2 in increasing order


def default_metric_dir() -> Path:
    from ..hub import models_dir

    return models_dir() / "t2i-clip"


def clip_config(token_ids: Sequence[int], image_size: int = 64, patch_size: int = 8, vision_width: int = 192,
                vision_layers: int = 6, context_length: int = 96, text_width: int = 192, text_layers: int = 4,
                head_width: int = 64, embed_dim: int = 128) -> dict[str, Any]:
    """The open_clip model config (``model_cfg`` of ``open_clip_config.json``) of a metric model.

    ``token_ids``: the BPE ids (open_clip's SimpleTokenizer) the text tower knows, including the
    start/end-of-text ids; see :class:`CompactTokenizer`.
    """
    return {
        "embed_dim": embed_dim,
        "vision_cfg": {"image_size": image_size, "patch_size": patch_size, "width": vision_width,
                       "layers": vision_layers, "head_width": head_width},
        "text_cfg": {"context_length": context_length, "vocab_size": 2 + len(token_ids), "width": text_width,
                     "heads": max(1, text_width // head_width), "layers": text_layers},
    }


class CompactTokenizer:
    """open_clip's own BPE tokenizer (``SimpleTokenizer``, no download) over a compact vocabulary.

    The full BPE vocabulary (49408 ids) would make the token embedding most of the model, while the
    scene captions use a few dozen tokens. Ids are remapped: 0 = padding, 1 = unknown (any BPE
    token absent from ``token_ids``), ``2 + i`` = ``sorted(token_ids)[i]``. The end-of-text id is the
    largest BPE id, so it stays the largest compact id and open_clip's ``argmax`` text pooling
    still picks the end-of-text position.
    """

    def __init__(self, token_ids: Sequence[int], context_length: int) -> None:
        from open_clip.tokenizer import SimpleTokenizer

        self.bpe = SimpleTokenizer(context_length=context_length)
        self.context_length = context_length
        self.token_ids = sorted(set(int(t) for t in token_ids) | {self.bpe.sot_token_id, self.bpe.eot_token_id})
        self.table = torch.full((self.bpe.vocab_size,), UNK_ID, dtype=torch.long)
        self.table[0] = PAD_ID  # open_clip pads with id 0
        self.table[torch.tensor(self.token_ids)] = torch.arange(2, 2 + len(self.token_ids))

    @property
    def vocab_size(self) -> int:
        return 2 + len(self.token_ids)

    @staticmethod
    def vocabulary(texts: Sequence[str], context_length: int, chunk: int = 4096) -> list[int]:
        """The BPE ids occurring in ``texts`` (the compact vocabulary of a model trained on them)."""
        from open_clip.tokenizer import SimpleTokenizer

        bpe, seen = SimpleTokenizer(context_length=context_length), set()
        for start in range(0, len(texts), chunk):
            seen.update(bpe(list(texts[start : start + chunk])).unique().tolist())
        seen.discard(0)
        return sorted(seen | {bpe.sot_token_id, bpe.eot_token_id})

    def __call__(self, texts: str | Sequence[str]) -> torch.Tensor:
        """LongTensor [N, context_length] (too long texts are truncated, keeping end-of-text)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        return self.table[self.bpe(texts)]


class MetricCLIP:
    """The metric model: an open_clip ``CLIP`` (float32, eval mode) with its compact tokenizer.

    Build a fresh (randomly initialised) one with ``MetricCLIP(config, token_ids)``, load a trained
    one with :meth:`load` (or :func:`load_metric_clip`).
    """

    def __init__(self, config: dict[str, Any], token_ids: Sequence[int], extra: dict[str, Any] | None = None) -> None:
        import open_clip
        from open_clip.model import CLIPTextCfg, CLIPVisionCfg

        self.config, self.extra = config, dict(extra or {})
        self.tokenizer = CompactTokenizer(token_ids, config["text_cfg"]["context_length"])
        if self.tokenizer.vocab_size != config["text_cfg"]["vocab_size"]:
            raise ValueError(f"text_cfg.vocab_size {config['text_cfg']['vocab_size']} != 2 + {len(self.tokenizer.token_ids)} token ids")
        self.model = open_clip.CLIP(embed_dim=config["embed_dim"], vision_cfg=CLIPVisionCfg(**config["vision_cfg"]),
                                    text_cfg=CLIPTextCfg(**config["text_cfg"])).float().eval()
        self.image_size = int(config["vision_cfg"]["image_size"])

    # ---- inputs ------------------------------------------------------------------------------
    def preprocess(self, images: Any) -> torch.Tensor:
        """PIL image(s) / uint8 / float [-1, 1] tensors -> float32 [B, 3, S, S] in [-1, 1]."""
        if isinstance(images, torch.Tensor):
            batch = images if images.dim() == 4 else images.unsqueeze(0)
        else:
            items = [images] if hasattr(images, "convert") else list(images)
            if items and isinstance(items[0], torch.Tensor):
                batch = torch.stack([x if x.dim() == 3 else x.squeeze(0) for x in items])
            else:
                arrays = [np.asarray(im.convert("RGB").resize((self.image_size, self.image_size), _bilinear()),
                                     dtype=np.uint8) for im in items]
                batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
        if batch.dtype == torch.uint8:
            batch = batch.float() / 127.5 - 1.0
        else:
            batch = batch.float()
        if batch.shape[1] != 3:
            raise ValueError(f"expected images [B, 3, H, W], got {tuple(batch.shape)}")
        if batch.shape[-2:] != (self.image_size, self.image_size):
            batch = F.interpolate(batch, size=(self.image_size, self.image_size), mode="bilinear",
                                  antialias=True, align_corners=False)
        return batch

    # ---- features ----------------------------------------------------------------------------
    def encode_text(self, tokens: torch.Tensor, bucket: int = 32) -> torch.Tensor:
        """Unnormalised text embeddings of compact tokens [N, context_length] (with gradients).

        Same result as ``self.model.encode_text`` but cheaper: rows are grouped by length (buckets of
        ``bucket`` tokens) and each group runs only up to its longest row. Exact, because the text
        transformer is causal (positions before the end-of-text token never see the padding after it)
        and pools at the end-of-text position.
        """
        from open_clip.transformer import text_global_pool

        model = self.model
        lengths = ((tokens != PAD_ID).long().cumsum(1) == (tokens != PAD_ID).sum(1, keepdim=True)).long().argmax(1) + 1
        groups = (lengths - 1) // bucket
        out = None
        for group in groups.unique().tolist():
            rows = (groups == group).nonzero().flatten()
            length = int(lengths[rows].max())
            part = tokens[rows, :length]
            x = model.token_embedding(part) + model.positional_embedding[:length]
            x = model.transformer(x, attn_mask=model.attn_mask[:length, :length])
            x = text_global_pool(model.ln_final(x), part, model.text_pool_type,
                                 eos_token_id=getattr(model, "text_eos_id", None))
            projection = model.text_projection
            x = projection(x) if isinstance(projection, torch.nn.Linear) else x @ projection
            if out is None:
                out = x.new_zeros(len(tokens), x.shape[-1])
            out = out.index_copy(0, rows, x)
        return out if out is not None else torch.zeros(0, self.config["embed_dim"])

    @torch.no_grad()
    def image_features(self, images: Any, normalize: bool = True, batch_size: int = 256) -> torch.Tensor:
        """float32 [B, embed_dim] image embeddings (unit norm unless ``normalize=False``)."""
        pixels = self.preprocess(images)
        out = [self.model.encode_image(pixels[i : i + batch_size]) for i in range(0, len(pixels), batch_size)]
        features = torch.cat(out) if out else torch.zeros(0, self.config["embed_dim"])
        return F.normalize(features, dim=-1) if normalize else features

    @torch.no_grad()
    def text_features(self, texts: str | Sequence[str], normalize: bool = True, batch_size: int = 256) -> torch.Tensor:
        """float32 [N, embed_dim] text embeddings (unit norm unless ``normalize=False``)."""
        tokens = self.tokenizer(texts)
        out = [self.encode_text(tokens[i : i + batch_size]) for i in range(0, len(tokens), batch_size)]
        features = torch.cat(out) if out else torch.zeros(0, self.config["embed_dim"])
        return F.normalize(features, dim=-1) if normalize else features

    # ---- files -------------------------------------------------------------------------------
    def save(self, directory: str | Path, **extra: Any) -> Path:
        """Write ``open_clip_config.json`` (model_cfg + preprocess_cfg + the token ids) and
        ``model.safetensors`` (fp16) into ``directory``."""
        from ..modeling.persistence import save_tensors

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.extra.update(extra)
        config = {
            "model_cfg": self.config,
            "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear",
                               "resize_mode": "squash"},
            "mmspec": {"token_ids": self.tokenizer.token_ids, "pad_id": PAD_ID, "unk_id": UNK_ID,
                       "note": "tokens: open_clip SimpleTokenizer ids remapped to 2 + index in token_ids "
                               "(0 = pad, 1 = unknown); see mmspec.metrics.image_quality.CompactTokenizer",
                       **self.extra},
        }
        tensors = {k: v.detach().to(torch.float16).contiguous().clone() for k, v in self.model.state_dict().items()}
        tmp = directory / f"{WEIGHTS_FILE}.{os.getpid()}.tmp"  # per process: workers converting at once
        save_tensors(tensors, tmp, metadata={"format": "pt"}).replace(directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "MetricCLIP":
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(f"no metric CLIP model in {directory} (train it: mmspec train clip --out {directory})")
        saved = json.loads((directory / CONFIG_FILE).read_text())
        extra = {k: v for k, v in saved.get("mmspec", {}).items() if k not in ("token_ids", "pad_id", "unk_id", "note")}
        metric = cls(saved["model_cfg"], saved["mmspec"]["token_ids"], extra)
        state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS_FILE)).items()}
        metric.model.load_state_dict(state)
        return metric


def _bilinear():
    from PIL import Image

    return Image.Resampling.BILINEAR


@lru_cache(maxsize=4)
def _load_cached(path: str, stamp: int) -> MetricCLIP:
    return MetricCLIP.load(path)


def load_metric_clip(directory: str | Path | None = None) -> MetricCLIP:
    """The trained metric model (default ``models/t2i-clip``), cached per directory and file time."""
    path = Path(directory) if directory is not None else default_metric_dir()
    weights = path / WEIGHTS_FILE
    stamp = weights.stat().st_mtime_ns if weights.exists() else 0
    return _load_cached(str(path.resolve()), stamp)


# ---- metrics ---------------------------------------------------------------------------------
def prompt_scores(images: Any, prompts: Sequence[str], model: MetricCLIP | None = None) -> torch.Tensor:
    """Per pair: 100 x max(cos(image, prompt), 0) with the metric model (CLIP-score style; numbers not
    comparable to CLIP-score computed with OpenAI CLIP)."""
    model = model or load_metric_clip()
    image = model.image_features(images)
    text = model.text_features(list(prompts))
    if len(image) != len(text):
        raise ValueError(f"{len(image)} images but {len(text)} prompts")
    return 100 * (image * text).sum(-1).clamp(min=0)


def prompt_score(images: Any, prompts: Sequence[str], model: MetricCLIP | None = None) -> float:
    """Mean over the (image, prompt) pairs of 100 x max(cosine similarity, 0) (CLIP-score style).

    Measured with the project's own metric CLIP trained on rendered scenes (not OpenAI CLIP): only
    comparable to other numbers from the same metric model; no set-size bias, only sampling noise.
    """
    return float(prompt_scores(images, prompts, model).mean())


def frechet_distance_from_statistics(mu_a: np.ndarray, sigma_a: np.ndarray, mu_b: np.ndarray, sigma_b: np.ndarray) -> float:
    """Fréchet (2-Wasserstein) distance between N(mu_a, sigma_a) and N(mu_b, sigma_b):
    ``|mu_a - mu_b|^2 + tr(sigma_a + sigma_b - 2 (sigma_a^1/2 sigma_b sigma_a^1/2)^1/2)``.

    The trace of the matrix square root is computed from symmetric eigendecompositions (float64,
    negative round-off eigenvalues clipped at 0), which stays stable for singular covariances
    (fewer samples than dimensions) where ``sqrtm(sigma_a @ sigma_b)`` can turn complex.
    """
    mu_a, mu_b = np.asarray(mu_a, np.float64), np.asarray(mu_b, np.float64)
    sigma_a, sigma_b = np.atleast_2d(np.asarray(sigma_a, np.float64)), np.atleast_2d(np.asarray(sigma_b, np.float64))
    sigma_a, sigma_b = (sigma_a + sigma_a.T) / 2, (sigma_b + sigma_b.T) / 2
    values, vectors = np.linalg.eigh(sigma_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
    middle = root_a @ sigma_b @ root_a
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    distance = float(((mu_a - mu_b) ** 2).sum() + np.trace(sigma_a) + np.trace(sigma_b) - 2 * trace_root)
    return max(distance, 0.0)


def frechet_distance(features_a: Any, features_b: Any) -> float:
    """Fréchet distance between the Gaussians fitted (mean, unbiased covariance) to two feature sets
    ``[N, D]`` (FID-style). Biased upward for small N (compare only equal set sizes)."""
    a = np.asarray(features_a.detach().cpu() if isinstance(features_a, torch.Tensor) else features_a, np.float64)
    b = np.asarray(features_b.detach().cpu() if isinstance(features_b, torch.Tensor) else features_b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(f"need two feature sets [N >= 2, D] of the same D, got {a.shape} and {b.shape}")
    return frechet_distance_from_statistics(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))


def frechet_clip_distance(images_a: Any, images_b: Any, model: MetricCLIP | None = None) -> float:
    """Fréchet distance of the metric CLIP's (unit-norm) image embeddings of two image sets.

    FID-style but measured with the project's own metric model trained on rendered scenes (not
    Inception): not comparable to published FID. Small sets bias it upward; compare only methods
    measured with the same set sizes and reference set.
    """
    model = model or load_metric_clip()
    return frechet_distance(model.image_features(images_a), model.image_features(images_b))
