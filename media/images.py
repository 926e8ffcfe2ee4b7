"""Images from chat messages: their bytes (data: URL, uploaded file, or an allowed remote URL)
checked from the header (`probe`: size, format, pixel count), then decoded with Pillow on the
media threads, a few at a time (`decode_bounded`).

Owns every refusal of an image (bad data URL, too large, too many pixels, unknown format,
remote fetching off or host not allowed) as `ImageRejected` with a message that names the
limit. Remote fetches never follow redirects (an allowed host could send us anywhere). It
does not resize for a model (engine/native/vision_processor.py does that).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from PIL import Image

from media.workers import Slots, run_blocking
from settings import ImagesConfig

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
_DECODES = Slots()
_DATA_URL = re.compile(
    r"^data:(?P<type>image/[a-z0-9.+-]+)?(?P<params>(;[a-z0-9-]+=[^;,]*)*)(?P<b64>;base64)?,", re.IGNORECASE
)


class ImageRejected(Exception):
    """An image that is refused; `code` is the OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class DecodedImage:
    image: Image.Image  # RGB, fully loaded
    content_hash: str  # sha256 over size and RGB pixels: equal pictures hash equal, whatever their encoding
    width: int
    height: int


def decode_data_url(url: str, cfg: ImagesConfig) -> bytes:
    match = _DATA_URL.match(url)
    if match is None or match.group("type") is None:
        raise ImageRejected(
            "The image's data: URL must look like data:image/png;base64,<base64 bytes>.", "invalid_image_url"
        )
    if match.group("b64") is None:
        raise ImageRejected(
            "The image's data: URL must be base64-encoded (data:image/...;base64,...).", "invalid_image_url"
        )
    payload = url[match.end() :]
    if len(payload) * 3 // 4 > cfg.max_image_bytes:  # refused before decoding a byte
        raise _too_large(len(payload) * 3 // 4, cfg)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected("The image's data: URL holds invalid base64.", "invalid_image_url") from None


def check_remote_url(url: str, cfg: ImagesConfig) -> None:
    """Refuse a remote URL unless fetching is on and its host is allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageRejected(
            f"Image URLs must be data:, http or https URLs (or send a file_id); got scheme {parts.scheme!r}.",
            "invalid_image_url",
        )
    if not cfg.allow_remote_urls:
        raise ImageRejected(
            "This server does not fetch remote image URLs (images.allow_remote_urls is off): send "
            "the image as a data: URL or upload it with POST /v1/files and send its file_id.",
            "image_url_not_allowed",
        )
    host = (parts.hostname or "").lower()
    if host not in {h.lower() for h in cfg.remote_allow_hosts}:
        raise ImageRejected(
            f"Images are only fetched from the allowed hosts (images.remote_allow_hosts); {host!r} is not one of them.",
            "image_url_not_allowed",
        )


async def fetch_remote(url: str, cfg: ImagesConfig) -> bytes:
    """GET an allowed URL: no redirects, `remote_timeout_s` in all, at most `max_image_bytes`."""
    check_remote_url(url, cfg)
    timeout = aiohttp.ClientTimeout(total=cfg.remote_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise ImageRejected(f"Fetching the image gave HTTP {resp.status}.", "image_fetch_failed")
            if resp.content_length is not None and resp.content_length > cfg.max_image_bytes:
                raise _too_large(resp.content_length, cfg)
            data = bytearray()
            async for chunk in resp.content.iter_chunked(65_536):
                data += chunk
                if len(data) > cfg.max_image_bytes:
                    raise _too_large(len(data), cfg)
            return bytes(data)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ImageRejected(f"Fetching the image failed: {type(exc).__name__}.", "image_fetch_failed") from None


def probe(source: bytes | Path, cfg: ImagesConfig) -> tuple[int, int]:
    """(width, height) after checking bytes, format and declared pixel count from the header alone:
    nothing is decoded (blocking: reads a few kB of a file)."""
    with _opened(source, cfg) as image:
        return image.size


def decode(source: bytes | Path, cfg: ImagesConfig) -> DecodedImage:
    """`probe`, then decode to RGB (blocking, up to a second for a large image: `decode_bounded`)."""
    try:
        with _opened(source, cfg) as image:
            width, height = image.size
            image.load()
            rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):  # damaged past the header
        raise ImageRejected(f"The image cannot be decoded; send one of {', '.join(FORMATS)}.") from None
    digest = hashlib.sha256(f"{width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    return DecodedImage(rgb, digest, width, height)


async def decode_bounded(source: bytes | Path, cfg: ImagesConfig) -> DecodedImage:
    """`decode` on the media threads, at most `images.max_concurrent_decodes` at once."""
    async with _DECODES.semaphore(cfg.max_concurrent_decodes):
        return await run_blocking(decode, source, cfg)


@contextlib.contextmanager
def _opened(source: bytes | Path, cfg: ImagesConfig) -> Iterator[Image.Image]:
    """The image opened lazily (header read, pixels not) after the byte and pixel checks."""
    try:
        num_bytes = len(source) if isinstance(source, bytes) else source.stat().st_size
        if num_bytes > cfg.max_image_bytes:
            raise _too_large(num_bytes, cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source, formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageRejected(
            f"The image declares too many pixels (limit {cfg.max_image_pixels}).", "image_too_many_pixels"
        ) from None
    except (OSError, SyntaxError, ValueError, Image.UnidentifiedImageError):
        raise ImageRejected(f"The image cannot be decoded; send one of {', '.join(FORMATS)}.") from None
    with image:
        width, height = image.size  # from the header: nothing decoded yet
        if width * height > cfg.max_image_pixels:
            raise ImageRejected(
                f"The image is {width}x{height} = {width * height} pixels; the limit is {cfg.max_image_pixels}.",
                "image_too_many_pixels",
            )
        yield image


def _too_large(num_bytes: int, cfg: ImagesConfig) -> ImageRejected:
    return ImageRejected(f"The image is {num_bytes} bytes; the limit is {cfg.max_image_bytes}.", "image_too_large")
