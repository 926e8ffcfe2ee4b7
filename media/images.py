"""Images from chat messages: their bytes (data: URL, uploaded file, or an allowed remote URL)
checked without decoding (`probe`: size, the container's structure, format, pixel count), then
decoded with Pillow on the media threads, a few at a time (`decode_bounded`).

Owns every refusal of an image (bad data URL, too large, a structure built to stall the
reader, too many pixels, unknown format, remote fetching off or host not allowed) as
`ImageRejected` with a message that names the limit. Remote fetches never follow redirects
(an allowed host could send us anywhere). It does not resize for a model
(engine/native/vision_processor.py does that).
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


def digest_of(source: bytes | Path) -> str:
    """sha256 of the image's encoded bytes (blocking: reads an uploaded file): the same bytes
    however they came (data: URL, upload), so a model's prepared image is found again by it."""
    return hashlib.sha256(source if isinstance(source, bytes) else source.read_bytes()).hexdigest()


def probe(source: bytes | Path, cfg: ImagesConfig) -> tuple[int, int]:
    """(width, height) after checking bytes, structure (`check_structure`), format and declared
    pixel count: nothing is decoded (blocking: reads the file, walks its headers)."""
    with _opened(source, cfg) as image:
        return image.size


async def probe_bounded(source: bytes | Path, cfg: ImagesConfig) -> tuple[int, int]:
    """`probe` on the media threads, in the same `images.max_concurrent_decodes` slots as decodes."""
    async with _DECODES.semaphore(cfg.max_concurrent_decodes):
        return await run_blocking(probe, source, cfg)


def decode(source: bytes | Path, cfg: ImagesConfig) -> DecodedImage:
    """`probe`'s checks, then decode to RGB (blocking, up to a second for a large image: `decode_bounded`)."""
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
    """The image opened lazily (header read, pixels not) after the byte, structure and pixel checks."""
    try:
        num_bytes = len(source) if isinstance(source, bytes) else source.stat().st_size
        if num_bytes > cfg.max_image_bytes:
            raise _too_large(num_bytes, cfg)
        data = source if isinstance(source, bytes) else source.read_bytes()
        check_structure(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
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


# -- the container's structure, walked before Pillow reads it -------------------------------
# Pillow reads what comes before the pixels (JPEG markers, PNG chunks, GIF blocks) in Python, one
# loop turn per item, and skips stray bytes one at a time: 10 MB of empty markers held the GIL
# for seconds (and a progressive JPEG's decoder, in C, goes over every block once per scan).
# `check_structure` walks the same items by their lengths, a bounded number of them, and refuses
# a file with far more than any camera, phone or editor writes. WebP is parsed in C (libwebp: 10
# MB of empty chunks cost it under 0.1 s), so it is left to Pillow.
MAX_JPEG_MARKERS = 512  # markers (and stray bytes) before the first scan; a camera's JPEG has 10-20
MAX_JPEG_SCANS = 100  # each scan of a progressive JPEG decodes every block again; encoders write about 10
MAX_PNG_CHUNKS_BEFORE_IDAT = 256  # metadata chunks; a phone's PNG has under 10
MAX_PNG_CHUNKS = 16_384  # decoding reads each one; encoders write 8-64 KiB IDATs (a 10 MiB PNG: under 1,300)
MAX_GIF_BLOCKS = 8192  # extensions, their sub-blocks and stray bytes before the first frame; GIFs have dozens
_JPEG_SOS = 0xDA
_JPEG_NO_LENGTH = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})  # JPG, RSTn, SOI, EOI, JPGn
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_structure(data: bytes) -> None:
    """Refuse (ImageRejected, invalid_image) a JPEG, PNG or GIF whose headers Pillow would spend
    long walking; other damage is Pillow's to find (the image then "cannot be decoded")."""
    if data.startswith(b"\xff\xd8\xff"):
        _check_jpeg(data)
    elif data.startswith(_PNG_SIGNATURE):
        _check_png(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        _check_gif(data)


def _check_jpeg(data: bytes) -> None:
    """Segments up to the first scan, turn for turn as Pillow's JpegImageFile._open reads them;
    then the scans, counted in C (0xFFDA occurs in entropy-coded data only as a marker)."""
    pos = 2  # after the start-of-image marker
    for _ in range(MAX_JPEG_MARKERS):
        if pos + 1 >= len(data):
            return
        marker = data[pos + 1]
        if data[pos] != 0xFF or marker == 0xFF:  # a stray byte, or fill before a marker
            pos += 1
        elif marker == 0x00:  # an escaped 0xFF where no scan is: skipped
            pos += 2
        elif marker == _JPEG_SOS:
            num_scans = data.count(b"\xff\xda", pos)
            if num_scans > MAX_JPEG_SCANS:
                raise ImageRejected(
                    f"The JPEG has {num_scans} scans; the limit is {MAX_JPEG_SCANS} (encoders write about 10)."
                )
            return
        elif marker < 0xC0:  # not a marker: Pillow refuses the file
            return
        elif marker in _JPEG_NO_LENGTH:
            pos += 2
        else:  # a segment: its length counts its own two bytes
            pos += 2 + max(int.from_bytes(data[pos + 2 : pos + 4], "big"), 2)
    raise ImageRejected(
        f"The JPEG has more than {MAX_JPEG_MARKERS} markers before its image data (a camera's has about 20)."
    )


def _check_png(data: bytes) -> None:
    """IHDR first, then every chunk to IEND by its length: Pillow reads those before the first
    IDAT (or fdAT) when opening, and the rest when decoding."""
    if data[12:16] != b"IHDR":
        raise ImageRejected("The PNG does not start with its IHDR chunk.")
    pos, num_chunks, has_data = len(_PNG_SIGNATURE), 0, False
    while pos + 8 <= len(data):
        kind = data[pos + 4 : pos + 8]
        if kind == b"IEND":
            return
        num_chunks += 1
        has_data = has_data or kind in (b"IDAT", b"fdAT")
        if not has_data and num_chunks > MAX_PNG_CHUNKS_BEFORE_IDAT:
            raise ImageRejected(
                f"The PNG has more than {MAX_PNG_CHUNKS_BEFORE_IDAT} chunks before its image data (a phone's has "
                "under 10)."
            )
        if num_chunks > MAX_PNG_CHUNKS:
            raise ImageRejected(f"The PNG has more than {MAX_PNG_CHUNKS} chunks.")
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")  # length, type, data, CRC


def _check_gif(data: bytes) -> None:
    """The blocks before the first frame, one at a time as Pillow's GifImageFile._seek(0) reads
    them (the frame's own data is read in C)."""
    flags = data[10] if len(data) > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the screen descriptor and palette
    in_extension = False
    for _ in range(MAX_GIF_BLOCKS):
        if pos >= len(data):
            return
        if in_extension:  # a sub-block: its length, then that many bytes; length 0 ends the extension
            in_extension = data[pos] != 0
            pos += 1 + data[pos]
        elif data[pos] == 0x21:  # "!": an extension's label, then its sub-blocks
            in_extension, pos = True, pos + 2
        elif data[pos] in (0x2C, 0x3B):  # ",": the first frame; ";": the end
            return
        else:  # a stray byte, skipped
            pos += 1
    raise ImageRejected(
        f"The GIF has more than {MAX_GIF_BLOCKS} blocks before its first frame (a GIF has a few dozen)."
    )
