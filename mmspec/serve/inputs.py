"""Request bodies -> checked pipeline arguments. Every refusal is a 4xx
:class:`~mmspec.serve.errors.APIError` naming the field, raised before anything is queued.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..pipelines.images import load_image
from .config import ServeConfig
from .errors import APIError, bad_request

#: largest decoded image (pixels) accepted before the pipeline's own size checks
MAX_IMAGE_PIXELS = 40_000_000  # an image's, and a request's images' in all


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises APIError 400 for malformed JSON or a non-object.

    Beyond syntax errors, Python's parser refuses integers of more than 4300 digits (ValueError) and
    nesting deeper than the interpreter's recursion limit (RecursionError): both are the client's
    fault, so both are a 400 here, not the 500 of an unexpected exception.
    """
    try:
        data = json.loads(body)
    except RecursionError:
        raise bad_request("the request body is not valid JSON (nested too deeply)", code="invalid_json") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise bad_request(f"the request body is not valid JSON ({message})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


class Fields:
    """Typed access to a JSON object's fields: each getter refuses a wrong type or range in one line."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix
        self.read: set[str] = set()  # the names a getter or refuse() looked at

    def _name(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False) -> Any:
        self.read.add(name)
        value = self.data.get(name)
        if value is None:
            if required:
                raise bad_request(f"'{self._name(name)}' is required", self._name(name), "missing_field")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join("number" if k is float else "integer" if k is int else "string" if k is str else
                                "boolean" if k is bool else "object" if k is dict else "array" if k is list else k.__name__
                                for k in kinds)
            raise bad_request(f"'{self._name(name)}' must be {names}, got {type(value).__name__} {short(value)}",
                              self._name(name), "invalid_type")
        return value

    def integer(self, name: str, default: int | None = None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.get(name, int, default)
        if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
            raise bad_request(f"'{self._name(name)}' must be between {low} and {high}, got {short(value)}", self._name(name))
        return value

    def number(self, name: str, default: float | None = None, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float | None:
        value = self.get(name, (int, float), default)
        if value is None:
            return None
        value = float(value)
        if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) or (
                high is not None and value > high):
            bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
            raise bad_request(f"'{self._name(name)}' must be in {bound}, got {value}", self._name(name))
        return value

    def text(self, name: str, limit: int, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.get(name, str, default, required=required)
        if value is None:
            return None
        check_unicode(value, self._name(name))
        if required and not value.strip():
            raise bad_request(f"'{self._name(name)}' is empty", self._name(name), "empty_field")
        if len(value) > limit:
            raise bad_request(f"'{self._name(name)}' has {len(value)} characters; at most {limit} are accepted",
                              self._name(name), "too_long")
        return value

    def refuse(self, name: str, allowed: tuple[Any, ...], why: str) -> None:
        """Refuse ``name`` unless absent or one of ``allowed`` (a feature not supported); a bool
        matches only a bool (``false`` is not the number 0, nor ``true`` the 1 of ``n``)."""
        self.read.add(name)
        value = self.data.get(name)
        if name in self.data and not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            raise bad_request(f"'{self._name(name)}' = {short(self.data[name])} is not supported: {why}",
                              self._name(name), "unsupported")

    def refuse_unknown(self, *elsewhere: str) -> None:
        """Refuse a field that no getter read (a typo such as ``sed`` for ``seed`` would otherwise
        leave the default in force silently), naming the closest known one. ``elsewhere``: the
        fields read by other code (``model``, ``mmspec``) or accepted unused (OpenAI's ``user``)."""
        known = sorted(self.read | set(elsewhere))
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            reader = f"'{self.prefix.rstrip('.')}' takes" if self.prefix else "this endpoint reads"
            raise bad_request(f"unknown field '{clip(self._name(unknown[0]))}'; {hint}{reader} {', '.join(known)}",
                              self._name(unknown[0]), "unknown_field")


def clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters for an error message ("..." at the end when cut): a
    client's 4,000-digit seed or 1 MB field name is not echoed whole."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any) -> str:
    """A client's value as JSON for an error message, cut by :func:`clip`."""
    return clip(json.dumps(value) if not isinstance(value, (bytes, bytearray)) else repr(value))


def check_unicode(text: str, param: str) -> None:
    """Refuse a string that holds a lone surrogate (``"\\ud800"`` is valid JSON but no Unicode
    text: the tokenizers then fail with messages that name neither the field nor the fault).
    Raises APIError 400 ``invalid_value`` naming ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(f"'{param}' holds a lone surrogate ({short(text[error.start])} at character {error.start}); "
                          "send valid Unicode text", param) from None


def decode_image(url: str, config: ServeConfig, param: str, pixels_left: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An ``image_url`` -> a loaded RGB PIL image, converted as the pipelines convert a file
    (:func:`mmspec.pipelines.images.load_image`). ``pixels_left``: what the request's earlier
    images left of its :data:`MAX_IMAGE_PIXELS` (read from the header, before decoding).

    Accepted: ``data:image/...;base64,...`` URIs (the scheme, type and ``base64`` in any case, as
    RFC 2397 and MIME read them; whitespace inside the payload, such as the line breaks of
    ``base64.encodebytes``, is skipped); with ``allow_local_files``, a path or ``file://`` URL
    (under ``local_files_root`` when set). http(s) URLs are refused: the server fetches nothing.
    Raises:
        APIError: 400 for a remote URL, a local file without the flag, bad base64, not an image.
    """
    scheme = url[: url.find(":") + 1].lower()  # ("" without a colon)
    if scheme in ("http:", "https:", "ftp:"):
        raise bad_request("remote image URLs are not fetched; send the image inline as a data: URI (base64)", param,
                          "remote_url_refused")
    if scheme == "data:":
        header, comma, payload = url.partition(",")
        header = header.lower()
        if not comma or ";base64" not in header:
            raise bad_request("a data URI image must be base64: data:image/png;base64,<data>", param, "invalid_image")
        if not header[5:].startswith("image/"):
            raise bad_request(f"the data URI's type {clip(header[5:].split(';')[0])!r} is not an image type", param,
                              "invalid_image")
        try:
            raw = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("the data URI's base64 payload does not decode", param, "invalid_image") from None
        return _open_image(io.BytesIO(raw), param, pixels_left)
    if not config.allow_local_files:
        raise bad_request("image_url must be a data: URI; local files are read only when the server runs with "
                          "--allow-local-files", param, "local_files_refused")
    path = Path(url[7:] if url[:7].lower() == "file://" else url).expanduser().resolve()
    if config.local_files_root is not None and not path.is_relative_to(config.local_files_root):
        raise bad_request(f"local files are read only under {config.local_files_root}", param, "local_files_refused")
    if not path.is_file():
        raise bad_request(f"no image file at {path}", param, "file_not_found")
    return _open_image(path, param, pixels_left)


def _open_image(source: io.BytesIO | os.PathLike, param: str, pixels_left: int) -> Image.Image:
    try:
        with Image.open(source) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise bad_request(f"the image is {width}x{height}; at most {MAX_IMAGE_PIXELS} pixels are accepted", param,
                                  "image_too_large")
            if width * height > pixels_left:
                raise bad_request(f"the request's images hold more than {MAX_IMAGE_PIXELS} pixels in all; send fewer "
                                  "or smaller images", param, "image_too_large")
            image.load()
            try:
                return load_image(image)  # (the CLI's and the pipeline's conversion: 16-bit, alpha over white, EXIF)
            except ValueError as error:  # (a side past the pipelines' limit)
                raise bad_request(str(error), param, "image_too_large") from None
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise bad_request(f"the image could not be read as an image ({type(error).__name__})", param, "invalid_image") from None
