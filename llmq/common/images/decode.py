"""An image's bytes checked with Pillow: a format served, a size and pixel count within the
settings, a file that decodes whole. Each failure is a 400 naming the part and the problem."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from llmq.common.errors import InvalidRequest
from llmq.common.settings import get_settings

# What vision processors read and clients send; others (TIFF, ICO, PSD...) are refused.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+*-]+/[\w.+*-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


@dataclass(frozen=True, slots=True)
class CheckedImage:
    """An image that decoded whole within the limits; ``digest`` is its bytes' SHA-256."""

    digest: str
    data: bytes
    format: str
    width: int
    height: int


def image_error(where: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {problem}", where, "invalid_image")


def base64_bytes(text: str, where: str) -> bytes:
    """Base64 text's bytes, refused before decoding when they would pass the size limit."""
    most = get_settings().max_image_bytes
    if len(text) * 3 // 4 > most + 3:
        raise image_error(where, f"the image is larger than {most} bytes (LLMQ_MAX_IMAGE_BYTES)")
    try:
        return base64.b64decode(text.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise image_error(where, "the image is not valid base64") from None


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a ``data:<type>;base64,...`` URL."""
    match = _DATA_URL.match(url)
    if match is None:
        raise image_error(where, "a data URL must be data:<media type>;base64,<data>")
    return base64_bytes(url[match.end() :], where)


def check_image(data: bytes, where: str) -> CheckedImage:
    """``data`` as a checked image: format, byte size, pixel count (from the header, before
    any pixel is decoded), then the whole decode (a truncated file fails here)."""
    settings = get_settings()
    if len(data) > settings.max_image_bytes:
        raise image_error(
            where,
            f"the image has {len(data)} bytes; at most {settings.max_image_bytes} "
            "(LLMQ_MAX_IMAGE_BYTES)",
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own guard, far above ours
        raise image_error(
            where,
            f"the image has too many pixels ({exc}); at most {settings.max_image_pixels} "
            "(LLMQ_MAX_IMAGE_PIXELS)",
        ) from None
    except UnidentifiedImageError:
        raise image_error(
            where, f"the data is not an image of a served format ({', '.join(FORMATS)})"
        ) from None
    with image:
        if image.format not in FORMATS:
            raise image_error(
                where, f"{image.format} images are not served (served: {', '.join(FORMATS)})"
            )
        width, height = image.size
        if width * height > settings.max_image_pixels:
            raise image_error(
                where,
                f"the image is {width} x {height} = {width * height} pixels; at most "
                f"{settings.max_image_pixels} (LLMQ_MAX_IMAGE_PIXELS)",
            )
        try:
            image.load()
        except Exception as exc:  # truncated or corrupt: Pillow raises OSError, SyntaxError...
            raise image_error(where, f"the {image.format} image does not decode: {exc}") from None
        fmt = image.format
    return CheckedImage(hashlib.sha256(data).hexdigest(), data, fmt, width, height)
