"""Small PDFs that stress a reader, written by hand (offsets computed exactly): a flate bomb,
streams that fill memory, an AES-encrypted file, a page that is only an image, and a file that
takes pypdf minutes."""

from __future__ import annotations

import asyncio
import io
import zlib

from PIL import Image

_FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def write_pdf(objects: list[bytes], trailer_extra: bytes = b"") -> bytes:
    """Object i+1 is objects[i]; object 1 is the catalog."""
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for n, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % n + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R %s>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer_extra, xref)
    return bytes(out)


def _pages_sharing(stream: bytes, num_pages: int, stream_dict: bytes = b"") -> bytes:
    """Catalog, pages, font, one content stream, then `num_pages` pages that all show it."""
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(num_pages))
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 3 0 R >> >> >>"
    )
    return write_pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, num_pages),
            _FONT,
            b"<< /Length %d %s>>stream\n" % (len(stream), stream_dict) + stream + b"\nendstream",
            *[page] * num_pages,
        ]
    )


def flate_bomb_pdf(num_bytes: int = 80_000_000) -> bytes:
    """One page whose content inflates past pypdf's 75 MB limit, from about 80 kB."""
    return _pages_sharing(zlib.compress(b" " * num_bytes, 9), 1, b"/Filter /FlateDecode ")


def inflating_pdf(num_pages: int = 4, num_bytes: int = 60_000_000) -> bytes:
    """Pages with a stream each that inflates to `num_bytes` of blanks (under pypdf's limit): a
    reader that keeps them all needs num_pages * num_bytes of memory, from a few hundred kB."""
    stream = zlib.compress(b" " * num_bytes, 9)
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(num_pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, num_pages)]
    objects.append(_FONT)
    for i in range(num_pages):
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R"
            b" /Resources << /Font << /F1 3 0 R >> >> >>" % (5 + 2 * i)
        )
        objects.append(b"<< /Length %d /Filter /FlateDecode >>stream\n" % len(stream) + stream + b"\nendstream")
    return write_pdf(objects)


def slow_pdf(num_pages: int = 100, stream_bytes: int = 1 << 20) -> bytes:
    """Pages sharing one flate stream of `stream_bytes` of text operators: a few kB that pypdf
    reads at about a second of CPU per page."""
    line = b"BT /F1 12 Tf 72 720 Td (AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA) Tj ET\n"
    return _pages_sharing(zlib.compress(line * (stream_bytes // len(line)), 9), num_pages, b"/Filter /FlateDecode ")


def aes_encrypted_pdf() -> bytes:
    """An AES-256 (/V 5 /R 6) encryption dictionary: pypdf needs `cryptography` to open it."""
    key = b"<" + b"ab" * 48 + b">"
    short = b"<" + b"cd" * 32 + b">"
    encrypt = (
        b"<< /Filter /Standard /V 5 /R 6 /Length 256 /CF << /StdCF << /AuthEvent /DocOpen /CFM /AESV3 /Length 32 >> >>"
        b" /StmF /StdCF /StrF /StdCF /O "
        + key
        + b" /U "
        + key
        + b" /OE "
        + short
        + b" /UE "
        + short
        + b" /P -4 /Perms <"
        + b"ef" * 16
        + b"> >>"
    )
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] >>",
        encrypt,
    ]
    file_id = b"<00112233445566778899aabbccddeeff>"
    return write_pdf(objects, b"/Encrypt 4 0 R /ID [%s %s] " % (file_id, file_id))


def image_only_pdf(num_pages: int = 2) -> bytes:
    """A "scanned" PDF: each page one picture, no text."""
    pictures = [Image.new("RGB", (120, 90), (200, 40 * i, 40)) for i in range(num_pages)]
    buf = io.BytesIO()
    pictures[0].save(buf, format="PDF", save_all=True, append_images=pictures[1:])
    return buf.getvalue()


class Children:
    """Every child process started while it records (asyncio.create_subprocess_exec)."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.started = asyncio.Event()


def record_children(monkeypatch) -> Children:
    children = Children()
    real = asyncio.create_subprocess_exec

    async def recording(*args, **kwargs):
        proc = await real(*args, **kwargs)
        children.procs.append(proc)
        children.started.set()
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording)
    return children
