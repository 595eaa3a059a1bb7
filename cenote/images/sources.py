"""Where an image comes from, and the rules it is held to before it is decoded: a PIL image or a
local path (offline), a ``data:`` URI, a ``file://`` path under ``--allowed-local-media-path``,
and http(s) only with ``--allow-remote-media`` (which cenote does not fetch: refused either way,
naming the flag). Every image is held to ``--max-image-pixels`` from its header, before its
pixels are decoded."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cenote.errors import InvalidInputError, InvalidInputTypeError

if TYPE_CHECKING:
    from PIL.Image import Image

DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # 50 megapixels: a 7,000 x 7,000 photo fits


@dataclass(frozen=True)
class MediaPolicy:
    """What the server may read on a client's behalf."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height, checked before decoding
    allowed_local_media_path: Path | None = None  # file:// URLs under this folder; None: none
    allow_remote_media: bool = False  # http(s) URLs (refused: this build fetches nothing)
    local_paths: bool = False  # plain paths (the offline LLM: the caller's own files)


def open_image(source: Any, policy: MediaPolicy, where: str) -> Image:
    """The decoded RGB image of ``source``: a PIL image; with ``policy.local_paths`` also a path
    (``str`` / ``PathLike``); always a URL string (``data:``, ``file://``, ``http(s)://``). ``where`` names
    the input in errors ("prompt 2")."""
    from PIL import Image as PILImage

    if isinstance(source, PILImage.Image):
        _check_pixels(source.width, source.height, policy, where)
        return source.convert("RGB")
    is_path = isinstance(source, os.PathLike) or (
        isinstance(source, str) and "://" not in source and not source.startswith("data:")
    )
    if is_path and policy.local_paths:
        path = Path(source)
        return _decode(path.read_bytes() if path.is_file() else None, policy, where, str(path))
    if not isinstance(source, str):
        raise InvalidInputTypeError(
            f"{where}: an image must be a PIL image, a path or a URL string, got "
            f"{type(source).__name__}"
        )
    if source.startswith("data:"):
        return _decode(_data_uri_bytes(source, where), policy, where, "the data URI")
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme == "file":
        return _decode(_local_file(source, policy, where).read_bytes(), policy, where, source)
    if scheme in ("http", "https"):
        if not policy.allow_remote_media:
            raise InvalidInputError(
                f"{where}: remote image URLs are refused ({source[:100]!r}); the server reads "
                "data: URIs and, under --allowed-local-media-path, file:// paths "
                "(--allow-remote-media is off)"
            )
        raise InvalidInputError(
            f"{where}: this server does not fetch remote images ({source[:100]!r}); send the "
            "image as a data: URI"
        )
    raise InvalidInputError(
        f"{where}: image URL scheme {scheme or '(none)'!r} is not supported; use data:, file:// "
        "or http(s)://"
    )


def _data_uri_bytes(uri: str, where: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidInputError(f"{where}: a data URI must be 'data:<type>;base64,<payload>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"{where}: the data URI's payload is not valid base64") from e


def _local_file(url: str, policy: MediaPolicy, where: str) -> Path:
    allowed = policy.allowed_local_media_path
    if allowed is None:
        raise InvalidInputError(
            f"{where}: file:// URLs are refused; start the server with "
            "--allowed-local-media-path DIR to read images under DIR"
        )
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    root = allowed.resolve()
    if not path.is_relative_to(root):
        raise InvalidInputError(
            f"{where}: {path} is outside the allowed local media path {root} "
            "(--allowed-local-media-path)"
        )
    if not path.is_file():
        raise InvalidInputError(f"{where}: {path} is not a file")
    return path


def _decode(data: bytes | None, policy: MediaPolicy, where: str, name: str) -> Image:
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if data is None:
        raise InvalidInputError(f"{where}: {name} is not a file")
    try:
        with warnings.catch_warnings():
            # --max-image-pixels is the bound (PIL's own warning threshold is 89 megapixels)
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            image = PILImage.open(io.BytesIO(data))  # reads the header only
            _check_pixels(image.width, image.height, policy, where)
            image.load()
    except (UnidentifiedImageError, PILImage.DecompressionBombError) as e:
        if isinstance(e, PILImage.DecompressionBombError):
            raise InvalidInputError(f"{where}: {name} has too many pixels ({e})") from e
        raise InvalidInputError(f"{where}: {name} is not an image PIL can read") from e
    except (OSError, SyntaxError, ValueError) as e:  # a truncated or corrupt file
        if isinstance(e, InvalidInputError):
            raise
        raise InvalidInputError(f"{where}: {name} could not be decoded ({e})") from e
    return image.convert("RGB")


def _check_pixels(width: int, height: int, policy: MediaPolicy, where: str) -> None:
    limit = policy.max_image_pixels
    if width * height > limit:
        raise InvalidInputError(
            f"{where}: the image is {width} x {height} = {width * height} pixels, more than the "
            f"limit of {limit} (--max-image-pixels)"
        )
