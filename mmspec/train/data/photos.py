"""``photos`` family (ScienceQA / MMT-like real images) with hand-written captions.

Photos come from packages that ship them (scikit-image, matplotlib), so nothing is downloaded.
Each sample is a random crop / mirror / colour jitter of one photo, drawn from a quantised
augmentation grid.  Split rule:

* photos with ``holdout`` set (see :data:`HELD_OUT`) appear only in that split;
* for the other photos, each augmentation (crop scale, offset, flip, jitter levels) is owned by
  one split via its content key, so no crop of the test split is ever a training crop.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageEnhance

from .core import Content, check_split, draw_for_split, pick
from .photo_catalog import PHOTOS, Photo

HELD_OUT = {p.name: p.holdout for p in PHOTOS if p.holdout}
HOLDOUT_WEIGHT = 3.0  # held-out photos are drawn this much more often in their own split
MAX_SIDE = 512  # photos are downscaled once to this size, which is plenty for 128 px crops
OFFSETS = 9  # crop positions per axis
JITTER_LEVELS = (0.85, 0.92, 1.0, 1.08, 1.15)
NO_JITTER = JITTER_LEVELS.index(1.0)


def _to_rgb(array: np.ndarray) -> Image.Image:
    """Any skimage/matplotlib image array (bool, float, gray, RGBA) as an RGB PIL image."""
    a = np.asarray(array)
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    elif a.dtype != np.uint8:
        a = np.clip(a * (255.0 if a.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    if a.ndim == 2:
        return Image.fromarray(a).convert("RGB")
    if a.shape[2] == 4:  # composite transparent pixels onto white
        rgba = Image.fromarray(a, "RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return Image.fromarray(a[..., :3])


@lru_cache(maxsize=None)
def load_photo(source: str) -> Image.Image:
    """Load a catalogue photo (cached), downscaled so its longer side is at most ``MAX_SIDE``."""
    kind, _, name = source.partition(":")
    if kind == "skimage":
        import skimage.data

        image = _to_rgb(getattr(skimage.data, name)())
    elif kind == "skimage-stereo":
        import skimage.data

        image = _to_rgb(skimage.data.stereo_motorcycle()[int(name)])
    elif kind == "mpl":
        import matplotlib.cbook

        with matplotlib.cbook.get_sample_data(name) as f:
            image = _to_rgb(np.asarray(Image.open(f).convert("RGBA")))
    else:
        raise ValueError(f"unknown photo source {source!r}")
    scale = MAX_SIDE / max(image.size)
    if scale < 1:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.LANCZOS)
    return image


@lru_cache(maxsize=None)
def is_gray(source: str) -> bool:
    """Whether the photo at ``source`` has no colour (then colour jitter is skipped)."""
    a = np.asarray(load_photo(source)).astype(int)
    return bool(np.abs(a[..., 0] - a[..., 1]).max() < 3 and np.abs(a[..., 1] - a[..., 2]).max() < 3)


def _scales(photo: Photo) -> np.ndarray:
    return np.round(np.arange(photo.min_scale, 1.0001, 0.05), 2)


def _draw_augmentation(photo: Photo):
    """A ``draw`` function for :func:`~.core.draw_for_split` over ``photo``'s augmentation grid."""
    def draw(rng: np.random.Generator) -> tuple[str, tuple]:
        aug = (int(rng.integers(len(_scales(photo)))), int(rng.integers(OFFSETS)), int(rng.integers(OFFSETS)),
               int(rng.integers(2)) if photo.flip else 0,
               *((int(v) for v in rng.integers(len(JITTER_LEVELS), size=3)) if photo.jitter else (NO_JITTER,) * 3))
        return f"photo|{photo.name}|" + ",".join(map(str, aug)), aug
    return draw


def augment(photo: Photo, aug: tuple, size: int, pad_color=(255, 255, 255)) -> Image.Image:
    """Apply a grid augmentation ``(scale_i, off_x, off_y, flip, bright_i, contrast_i, sat_i)``."""
    scale_i, ox, oy, flip, b, c, s = aug
    image = load_photo(photo.source)
    W, H = image.size
    scale = float(_scales(photo)[scale_i])
    if photo.pad:  # crop keeping the aspect ratio, then letterbox into the square
        cw, ch = W * scale, H * scale
    else:
        cw = ch = min(W, H) * scale
    x0, y0 = (W - cw) * ox / (OFFSETS - 1), (H - ch) * oy / (OFFSETS - 1)
    crop = image.crop((round(x0), round(y0), round(x0 + cw), round(y0 + ch)))
    if photo.pad:
        fit = size / max(crop.size)
        crop = crop.resize((max(1, round(crop.width * fit)), max(1, round(crop.height * fit))), Image.LANCZOS)
        canvas = Image.new("RGB", (size, size), pad_color)
        canvas.paste(crop, ((size - crop.width) // 2, (size - crop.height) // 2))
        out = canvas
    else:
        out = crop.resize((size, size), Image.LANCZOS)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    out = ImageEnhance.Brightness(out).enhance(JITTER_LEVELS[b])
    out = ImageEnhance.Contrast(out).enhance(JITTER_LEVELS[c])
    if not is_gray(photo.source):
        out = ImageEnhance.Color(out).enhance(JITTER_LEVELS[s])
    return out


def photos_for_split(split: str) -> list[Photo]:
    """Photos that may appear in ``split``: the shared ones plus those held out for it."""
    check_split(split)
    return [p for p in PHOTOS if p.holdout in (None, split)]


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One augmented real photo with its hand-written captions and questions."""
    photos = photos_for_split(split)
    weights = np.array([HOLDOUT_WEIGHT if p.holdout else 1.0 for p in photos])
    photo = photos[int(rng.choice(len(photos), p=weights / weights.sum()))]
    if photo.holdout:  # the whole photo belongs to this split: any augmentation will do
        key, aug = _draw_augmentation(photo)(rng)
    else:
        key, aug = draw_for_split(rng, split, _draw_augmentation(photo))
    pad_color = photo.pad_color or pick(rng, [(255, 255, 255), (40, 40, 40), (128, 128, 128)])
    image = augment(photo, aug, size, pad_color)
    meta = {"key": key, "photo": photo.name, "holdout": photo.holdout, "augmentation": list(aug)}
    return Content(image, list(photo.captions), photo.detailed, list(photo.qas), "", meta)
