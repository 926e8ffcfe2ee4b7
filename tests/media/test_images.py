"""Image checks and decoding without a server: the header check decodes nothing, and decodes
run at most images.max_concurrent_decodes at once."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from media import images
from settings import ImagesConfig


def header_only_png(width: int, height: int) -> bytes:
    """A PNG that declares its size but whose pixel data is a few bytes: only decoding notices."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")


def test_probe_reads_the_header_and_decodes_nothing(tmp_path):
    cfg = ImagesConfig()
    data = header_only_png(4096, 4096)
    assert images.probe(data, cfg) == (4096, 4096)
    path = tmp_path / "upload"
    path.write_bytes(data)
    assert images.probe(path, cfg) == (4096, 4096)
    with pytest.raises(images.ImageRejected, match="cannot be decoded"):
        images.decode(path, cfg)
    with pytest.raises(images.ImageRejected, match="4097x4096"):
        images.probe(header_only_png(4097, 4096), cfg)


def test_decode_takes_bytes_or_a_path():
    buf = io.BytesIO()
    Image.new("L", (5, 4), 7).save(buf, format="PNG")
    decoded = images.decode(buf.getvalue(), ImagesConfig())
    assert (decoded.width, decoded.height, decoded.image.mode) == (5, 4, "RGB")
