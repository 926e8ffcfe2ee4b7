"""A document's text, extracted once per file: from the cache beside the upload, else read now.

Owns the deadline and the isolation of PDF reading: pypdf can spend minutes of CPU on a small
crafted file, so each PDF is read in a child process (a fresh interpreter, `python -m
media.pdf_worker`: never a fork of this threaded process) that is killed when `max_extract_s`
passes or every request waiting for it is cancelled (clients gone, server stopping). Requests
for a file being read wait for that one reading. At most `max_concurrent` children run at once;
a reading waits for a slot at most `max_extract_s`. Text files are read on the media threads
(their size is bounded by the upload limit). It does not render prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from media import documents
from media.documents import DocumentText, ExtractLimits, UnreadableDocument
from media.workers import Slots, run_blocking

log = structlog.get_logger(__name__)

_ROOT = Path(__file__).resolve().parents[1]  # the child imports `media` from the repository root
_CPU_MARGIN_S = 5  # the child's own CPU limit: the deadline plus this (a backstop, see media/pdf_worker.py)
_STDERR_TAIL_CHARS = 500
_SLOTS = Slots()


class ExtractionBusy(Exception):
    """No PDF slot freed up within `max_extract_s` (HTTP 503: try again)."""


async def cached_extract(
    path: Path, cache_path: Path, media_type: str, limits: ExtractLimits, max_concurrent: int
) -> DocumentText:
    """The file's text, cut to `limits.max_chars`; raises UnreadableDocument or ExtractionBusy."""
    cached = await run_blocking(documents.read_cache, cache_path, limits)
    if cached is not None:
        return cached
    if not documents.is_pdf(media_type):
        doc = await run_blocking(documents.read_text, path, media_type, limits)
        await run_blocking(documents.write_cache, cache_path, limits, doc, path)
        return doc
    return await _join(cache_path, lambda: _extract_pdf(path, cache_path, limits, max_concurrent))


@dataclass(slots=True)
class _Reading:
    task: asyncio.Task[DocumentText]
    num_waiting: int = 0


_READINGS: dict[Path, _Reading] = {}  # by cache path; an entry leaves when its task ends


async def _join(cache_path: Path, start: Callable[[], Coroutine[Any, Any, DocumentText]]) -> DocumentText:
    """One reading per file: a request for a file being read waits for that reading; the last
    request to leave (client gone, server stopping) cancels it, which kills its child."""
    loop = asyncio.get_running_loop()
    reading = _READINGS.get(cache_path)
    if reading is None or reading.task.get_loop() is not loop:
        reading = _READINGS[cache_path] = _Reading(loop.create_task(start()))

        def forget(_: asyncio.Task, reading: _Reading = reading) -> None:
            if _READINGS.get(cache_path) is reading:
                del _READINGS[cache_path]

        reading.task.add_done_callback(forget)
    reading.num_waiting += 1
    try:
        return await asyncio.shield(reading.task)
    finally:
        reading.num_waiting -= 1
        if reading.num_waiting == 0 and not reading.task.done():
            reading.task.cancel()
            await asyncio.wait([reading.task])  # its child killed and reaped before this request ends


async def _extract_pdf(path: Path, cache_path: Path, limits: ExtractLimits, max_concurrent: int) -> DocumentText:
    slots = _SLOTS.semaphore(max_concurrent)
    try:
        async with asyncio.timeout(limits.max_extract_s):
            await slots.acquire()
    except TimeoutError:
        raise ExtractionBusy(f"every PDF reader stayed busy for {limits.max_extract_s:g} s") from None
    try:
        cached = await run_blocking(documents.read_cache, cache_path, limits)
        if cached is not None:  # a reading that ended since this request looked left it
            return cached
        result = await _read_pdf_in_child(path, limits)
        await run_blocking(documents.write_cache, cache_path, limits, result, path)
    finally:
        slots.release()
    if isinstance(result, UnreadableDocument):
        raise result
    return result


async def _read_pdf_in_child(path: Path, limits: ExtractLimits) -> DocumentText | UnreadableDocument:
    """The text, or the refusal to remember; raises UnreadableDocument when the child failed in a
    way that may not happen again (killed, crashed): that one is not remembered."""
    cpu_limit_s = math.ceil(limits.max_extract_s) + _CPU_MARGIN_S
    where = os.path.abspath(path)  # noqa: ASYNC240 - no disk access (getcwd); the child's cwd differs
    args = (where, str(limits.max_pdf_pages), str(limits.max_chars), str(cpu_limit_s), str(limits.max_memory_bytes))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "media.pdf_worker",
        *args,
        cwd=_ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(limits.max_extract_s):
            out, err = await proc.communicate()
    except TimeoutError:
        log.warning("pdf_extract_timeout", path=str(path), max_extract_s=limits.max_extract_s)
        return UnreadableDocument(
            f"the PDF took too long to read (more than the {limits.max_extract_s:g} s limit, files.max_extract_s)"
        )
    finally:
        if proc.returncode is None:  # the deadline passed or the request was cancelled
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
    return _parse_reply(path, proc.returncode, out, err)


def _parse_reply(path: Path, returncode: int | None, out: bytes, err: bytes) -> DocumentText | UnreadableDocument:
    try:
        reply = json.loads(out)
        if "refused" in reply:
            return UnreadableDocument(reply["refused"])
        doc = reply["doc"]
        return DocumentText(doc["text"], doc["num_pages"], doc["num_pages_read"], doc["num_chars"])
    except (ValueError, KeyError, TypeError):
        tail = err.decode(errors="replace")[-_STDERR_TAIL_CHARS:]
        log.warning("pdf_extract_failed", path=str(path), returncode=returncode, stderr=tail)
        raise UnreadableDocument("the PDF cannot be read (the reader stopped without an answer)") from None
