"""The container walk before Pillow (media/images.check_structure): a JPEG, PNG or GIF built so
that Pillow's Python header loop runs millions of turns (empty markers, tiny chunks, one-byte
sub-blocks, stray bytes) or whose decoder reruns a progressive scan hundreds of times is refused
as invalid_image before Pillow opens it; images as encoders write them, at and near the caps,
still open and decode. Header checks share the decode slots."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from media import images
from settings import ImagesConfig


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every image Pillow was asked to open."""
    calls: list = []
    real = Image.open

    def recording(fp, *args, **kwargs):
        calls.append(fp)
        return real(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", recording)
    return calls


def encoded(fmt: str, size=(16, 12), mode="RGB", **options) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 90).save(buf, format=fmt, **options)
    return buf.getvalue()


def jpeg_with_markers(num_markers: int) -> bytes:
    """A small JPEG with `num_markers` empty APP1 segments after its start-of-image marker."""
    real = encoded("JPEG")
    return real[:2] + b"\xff\xe1\x00\x02" * num_markers + real[2:]


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_chunks(num_before: int = 0, num_data: int = 1) -> bytes:
    """A 1x1 PNG with `num_before` empty private chunks before its pixels, split into `num_data` IDATs."""
    pixels = zlib.compress(b"\0\0\0\0")
    idats = [png_chunk(b"IDAT", pixels if i == num_data - 1 else b"") for i in range(num_data)]
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)),
            png_chunk(b"prVt", b"") * num_before,
            *idats,
            png_chunk(b"IEND", b""),
        ]
    )


def gif_with(before_frame: bytes) -> bytes:
    real = encoded("GIF", mode="P")
    first_frame = real.index(b",")  # the image descriptor after the screen descriptor and palette
    return real[:first_frame] + before_frame + real[first_frame:]


def progressive_jpeg_with_extra_scans(num_extra: int) -> bytes:
    """A progressive JPEG whose last scan is repeated: libjpeg decodes every block again per scan."""
    real = encoded("JPEG", size=(64, 64), mode="L", progressive=True)
    last_scan = real[real.rindex(b"\xff\xda") : -2]
    return real[:-2] + last_scan * num_extra + real[-2:]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (jpeg_with_markers(100_000), "more than 512 markers before its image data"),
        (png_with_chunks(num_before=100_000), "more than 256 chunks before its image data"),
        (png_with_chunks(num_data=20_000), "more than 16384 chunks"),
        (gif_with(b"!\xfe" + b"\x01x" * 100_000 + b"\0"), "more than 8192 blocks before its first frame"),
        (gif_with(b"\x07" * 100_000), "more than 8192 blocks before its first frame"),
        (progressive_jpeg_with_extra_scans(120), "scans; the limit is 100"),
    ],
    ids=[
        "jpeg-markers",
        "png-chunks-before-idat",
        "png-idat-chunks",
        "gif-sub-blocks",
        "gif-stray-bytes",
        "jpeg-scans",
    ],
)
def test_a_header_built_to_loop_pillow_is_refused_before_pillow_opens_it(tmp_path, opened, data, words):
    path = tmp_path / "upload"
    path.write_bytes(data)
    for source in (data, path):
        with pytest.raises(images.ImageRejected) as refused:
            images.probe(source, ImagesConfig())
        assert refused.value.code == "invalid_image"
        assert words in refused.value.message
    with pytest.raises(images.ImageRejected, match=words):
        images.decode(data, ImagesConfig())
    assert opened == []


def test_a_png_must_start_with_its_ihdr_chunk(opened):
    data = png_with_chunks()
    moved = data[:8] + png_chunk(b"prVt", b"") + data[8:]
    with pytest.raises(images.ImageRejected, match="does not start with its IHDR chunk"):
        images.probe(moved, ImagesConfig())
    assert opened == []


@pytest.mark.parametrize(
    "data",
    [
        encoded("JPEG"),
        encoded("JPEG", progressive=True, icc_profile=b"p" * 200_000),  # an ICC profile over four APP2 segments
        jpeg_with_markers(480),
        progressive_jpeg_with_extra_scans(80),
        encoded("PNG", dpi=(72, 72)),
        png_with_chunks(num_before=250, num_data=16_000),
        encoded("GIF", mode="P", comment=b"c" * 100_000),
        gif_with(b"\x07" * 100),
        encoded("WEBP"),
    ],
    ids=["jpeg", "jpeg-icc", "jpeg-480-markers", "jpeg-86-scans", "png", "png-at-caps", "gif", "gif-stray", "webp"],
)
def test_images_as_encoders_write_them_and_near_the_caps_open_and_decode(data):
    cfg = ImagesConfig()
    width, height = images.probe(data, cfg)
    decoded = images.decode(data, cfg)
    assert (decoded.width, decoded.height) == (width, height)


async def test_header_checks_share_the_decode_slots(monkeypatch):
    running, most = 0, 0
    lock = threading.Lock()

    def slow(source, cfg):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return (1, 1)

    monkeypatch.setattr(images, "probe", slow)
    monkeypatch.setattr(images, "decode", slow)
    cfg = ImagesConfig(max_concurrent_decodes=2)
    work = [images.probe_bounded(b"x", cfg) for _ in range(4)] + [images.decode_bounded(b"x", cfg) for _ in range(4)]
    assert len(await asyncio.gather(*work)) == 8
    assert most == 2
