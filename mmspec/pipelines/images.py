"""Image inputs: load, validate and normalise to an 8-bit RGB ``PIL.Image``.

Pipelines accept a ``PIL.Image``, a path (``str`` / ``os.PathLike``) or a numpy array and hand
the model's processor an RGB image; resizing to the model's resolution is the processor's job.

Conversions (all to 8-bit RGB):

* transparency (RGBA, LA, P with a transparent colour) is composited on white;
* CMYK, YCbCr, LAB, HSV, L, 1, P: PIL's own conversion to RGB;
* 16-bit ("I;16*" images, uint16 arrays) is scaled by 255/65535 -- not clipped as PIL's own
  conversion does, so a 16-bit photo keeps its tones; PIL's 32-bit modes "I" and "F" are read by
  their value range (see :func:`_wide_mode_to_uint8`);
* the EXIF orientation tag is applied (a phone photo comes out upright);
* an animated image (GIF, APNG, WebP) is its first frame, as PIL opens it.

Numpy arrays are [H, W] (grey), [H, W, 1], [H, W, 3] (RGB) or [H, W, 4] (RGBA), of dtype
uint8, uint16 (scaled as above), bool, or float in [0, 1].
"""

from __future__ import annotations

import base64
import io
import os
import re
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

ImageInput = Union[Image.Image, str, os.PathLike, np.ndarray]

#: inputs above these sizes are refused (a decoded 64-megapixel RGB image is ~190 MB)
MAX_SIDE = 16384
MAX_PIXELS = 64_000_000

_TRANSPARENT_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def load_image(image: ImageInput) -> Image.Image:
    """Any accepted input -> an upright 8-bit RGB ``PIL.Image`` (the input is never modified).

    Args:
        image: a ``PIL.Image``, a path to an image file, or a numpy array (see the module doc).
    Returns:
        ``PIL.Image`` in mode "RGB".
    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not an image, the array has an unsupported shape/dtype/range, or
            the image is larger than ``MAX_SIDE`` per side / ``MAX_PIXELS`` in total.
        TypeError: any other kind of input.
    """
    if isinstance(image, Image.Image):
        check_size(image.size, "the image")
        return to_rgb(ImageOps.exif_transpose(image))
    if isinstance(image, np.ndarray):
        return array_to_image(image)
    if isinstance(image, (str, os.PathLike)):
        with open_image_file(image) as opened:
            try:
                opened.load()
            except (OSError, SyntaxError, ValueError) as error:  # truncated or corrupt data
                raise ValueError(f"{image} is not an image file ({error})") from None
            return to_rgb(ImageOps.exif_transpose(opened))
    raise TypeError(_not_an_image(image))


def check_image(image: ImageInput) -> None:
    """Raise what :func:`load_image` would for ``image``, cheaply (a file's header only, an array's
    shape and dtype, not its pixels' range): every image of a list checked before any decoding."""
    if isinstance(image, Image.Image):
        check_size(image.size, "the image")
    elif isinstance(image, np.ndarray):
        _check_array_shape(image)
        if not (image.dtype in (np.uint8, np.uint16, np.bool_) or np.issubdtype(image.dtype, np.floating)):
            _to_uint8(image, "a numpy image")  # (its dtype's refusal)
    elif isinstance(image, (str, os.PathLike)):
        open_image_file(image).close()
    else:
        raise TypeError(_not_an_image(image))


def _not_an_image(image) -> str:
    """The refusal of an input that is no image kind mmspec reads, with how to make one of it."""
    kind = type(image).__name__
    hints = {"Tensor": "a torch tensor: pass tensor.permute(1, 2, 0).numpy() for [C, H, W] floats in [0, 1], "
                       "or tensor.numpy() for [H, W, C] uint8",
             "bytes": "encoded bytes: pass PIL.Image.open(io.BytesIO(data))",
             "bytearray": "encoded bytes: pass PIL.Image.open(io.BytesIO(data))",
             "BytesIO": "a stream: pass PIL.Image.open(stream)", "BufferedReader": "an open file: pass its path",
             "generator": "a generator: pass a list of images", "set": "a set: pass a list of images (a set has no order)",
             "list": "a nested list: pass a flat list of images", "tuple": "a nested tuple: pass a flat list of images"}
    hint = hints.get(kind, "")
    return f"expected a PIL.Image, a path or a numpy array, got {kind}" + (f" ({hint})" if hint else "")


def open_image_file(path: str | os.PathLike) -> Image.Image:
    """Open ``path`` lazily (the header only) and check that it is an image of acceptable size.

    Cheap: use it to validate many files before any model is loaded.
    Raises:
        FileNotFoundError, ValueError: as :func:`load_image`.
    """
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):(?://|(?<=data:))", str(path), re.IGNORECASE)  # (not "C:\\x.png")
    if scheme is not None and scheme.group(1).lower() != "file":
        raise ValueError(f"{_shown(path)} is a URL; mmspec reads no URLs: download the image and pass its file")
    if str(path).startswith("~"):
        path = os.path.expanduser(str(path))
    if str(path)[:5].lower() == "file:":  # a local file's URL: its path ("file:///a%20b.png" -> "/a b.png")
        from urllib.parse import unquote, urlparse

        url = urlparse(str(path))
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"{path} names another host's file; pass a local path")
        path = unquote(url.path)
    if not str(path).strip():  # (Path("") is ".", a directory)
        raise ValueError("the image path is empty; give an image file")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image file not found: {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not an image file")
    try:
        with warnings.catch_warnings():  # (PIL's two-line bomb warning: the size check below says it in one)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(path)
    except UnidentifiedImageError:
        raise ValueError(f"{path} is not an image file (PIL cannot identify its format)") from None
    except Image.DecompressionBombError:
        raise ValueError(f"{path} is too large (PIL refuses it as a decompression bomb); downscale it first") from None
    except (OSError, ValueError) as error:  # (ValueError: a text chunk past PIL's limit, a compression bomb)
        raise ValueError(f"{path} is not an image file mmspec can read ({error})") from None
    if getattr(opened, "n_frames", 1) > 1:
        warnings.warn(f"{path} holds {opened.n_frames} frames (an animation or a multi-page file); its first is used",
                      UserWarning, stacklevel=2)
    try:
        check_size(opened.size, str(path))
    except ValueError:
        opened.close()
        raise
    return opened


def _shown(path) -> str:
    """A path or URL for a message: at most 80 characters (a data URL holds a whole image)."""
    text = str(path)
    return text if len(text) <= 80 else text[:77] + "..."


def check_size(size: tuple[int, int], name: str) -> None:
    """Raise ValueError if a (width, height) image is empty or exceeds MAX_SIDE / MAX_PIXELS."""
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{name} is empty ({width}x{height} pixels)")
    if max(width, height) > MAX_SIDE or width * height > MAX_PIXELS:
        raise ValueError(
            f"{name} is too large: {width}x{height} pixels ({width * height / 1e6:.1f} megapixels); "
            f"the limit is {MAX_SIDE} pixels per side and {MAX_PIXELS / 1e6:.0f} megapixels -- downscale it first"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """A PIL image of any mode -> 8-bit RGB (see the module doc for each conversion)."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode == "La":  # (premultiplied grey: PIL converts it to LA only)
        image = image.convert("LA")
    if image.mode in _TRANSPARENT_MODES:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode.startswith("I") or image.mode == "F":
        return Image.fromarray(_wide_mode_to_uint8(image)).convert("RGB")
    return image.convert("RGB")


def array_to_image(array: np.ndarray) -> Image.Image:
    """A numpy image [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] -> 8-bit RGB ``PIL.Image``."""
    _check_array_shape(array)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    pixels = _to_uint8(array, "a numpy image")
    return to_rgb(Image.fromarray(np.ascontiguousarray(pixels)))  # uint8 [H, W] / [H, W, 3|4]: L / RGB / RGBA


def _check_array_shape(array: np.ndarray) -> None:
    """Raise ValueError unless ``array`` is [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] of an acceptable size."""
    shape = array.shape
    if not (array.ndim == 2 or (array.ndim == 3 and shape[-1] in (1, 3, 4))):
        if array.ndim == 3 and shape[0] in (1, 3, 4):
            hint = " (channels first? use array.transpose(1, 2, 0))"
        elif array.ndim == 4:
            hint = " (a stack of images? pass a list of [H, W, C] arrays: list(array))"
        else:
            hint = ""
        raise ValueError(f"a numpy image must be [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], got shape {shape}{hint}")
    check_size((shape[1], shape[0]), "the image")


def _to_uint8(pixels: np.ndarray, name: str) -> np.ndarray:
    """Numpy pixels -> uint8: uint8 as is, bool x255, uint16 by 255/65535, float in [0, 1] x255."""
    if pixels.dtype == np.uint8:
        return pixels
    if pixels.dtype == np.bool_:
        return pixels.astype(np.uint8) * 255
    if pixels.dtype == np.uint16:
        return _from_16bit(pixels)
    if np.issubdtype(pixels.dtype, np.floating):
        if not np.isfinite(pixels).all():
            raise ValueError(f"{name} has NaN or infinite values")
        low, high = float(pixels.min()), float(pixels.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(f"{name} of dtype {pixels.dtype} must have values in [0, 1], got [{low:g}, {high:g}]")
        return np.rint(pixels * 255.0).astype(np.uint8)
    raise ValueError(
        f"{name} has unsupported dtype {pixels.dtype}; use uint8 (0..255), uint16 (0..65535) or float in [0, 1], "
        "e.g. array.astype(np.uint8)"
    )


def _from_16bit(pixels: np.ndarray) -> np.ndarray:
    """Values in 0..65535 -> 0..255, rounded (x * 255 / 65535)."""
    return ((pixels.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)


def _wide_mode_to_uint8(image: Image.Image) -> np.ndarray:
    """PIL modes "I;16*", "I" (int32) and "F" (float32) -> uint8 [H, W].

    PIL stores 16-bit files as "I;16" (scaled by 255/65535). Mode "I" and "F" hold whatever was put
    there, so the value range decides: 0..255 is 8-bit data (as is), 0..65535 is 16-bit data
    (scaled), F within [0, 1] is scaled by 255, anything else is stretched min..max.
    """
    values = np.asarray(image)
    if values.dtype == np.uint16 or image.mode.startswith("I;16"):
        return _from_16bit(values.astype(np.uint16))
    low, high = float(values.min()), float(values.max())
    if image.mode == "F" and 0.0 <= low and high <= 1.0:
        return np.rint(values * 255.0).astype(np.uint8)
    if 0 <= low and high <= 255:
        return np.rint(values).astype(np.uint8)
    if image.mode == "I" and 0 <= low and high <= 65535:
        return _from_16bit(values)
    span = max(high - low, 1e-12)
    return np.rint((values.astype(np.float64) - low) * (255.0 / span)).astype(np.uint8)


def to_pil(images) -> list[Image.Image]:
    """float [B, 3, H, W] in [-1, 1] -> PIL images."""
    array = ((images.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in array]


def png_base64(image: Image.Image) -> str:
    """An image as a PNG, base64-encoded (the server's ``b64_json``; prefixed with
    ``data:image/png;base64,`` it is a data URI, as outputs' ``to_dict()`` give images)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
