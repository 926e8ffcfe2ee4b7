"""PDF extraction in a child process: the text comes back and is read once per file (callers
for a file being read wait for that reading), a slow file's reader is killed at the deadline
(and the refusal remembered), one that needs too much memory is refused, the last caller to be
cancelled kills the reader, and a reading that waits too long for a reader slot is busy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from media import extraction
from media.documents import ExtractLimits, UnreadableDocument
from testing.pdf import make_pdf
from tests.media.pdf_fixtures import Children, inflating_pdf, record_children, slow_pdf

PDF = "application/pdf"


@pytest.fixture
def spawned(monkeypatch) -> Children:
    return record_children(monkeypatch)


def limits(max_extract_s: float = 30.0, max_memory_bytes: int = 2 << 30) -> ExtractLimits:
    return ExtractLimits(300, 400_000, max_extract_s, max_memory_bytes=max_memory_bytes)


async def test_the_text_comes_back_from_the_child_and_one_file_is_read_once(tmp_path, spawned):
    path = tmp_path / "report"
    path.write_bytes(make_pdf(["Revenue grew.", "Costs fell."]))
    calls = [extraction.cached_extract(path, tmp_path / "report.txt", PDF, limits(), 1) for _ in range(3)]
    docs = await asyncio.gather(*calls)
    assert docs[0].text == "[Page 1]\nRevenue grew.\n\n[Page 2]\nCosts fell." and docs[0].num_pages == 2
    assert docs[1] == docs[0] == docs[2]
    assert len(spawned.procs) == 1  # the others found the cache once a slot freed up


async def test_a_slow_pdf_is_killed_at_the_deadline_and_the_refusal_is_remembered(tmp_path, spawned):
    path = tmp_path / "slow"
    path.write_bytes(slow_pdf())  # about a second of CPU per page, 100 pages
    with pytest.raises(UnreadableDocument, match=r"took too long to read \(more than the 0.5 s limit"):
        await extraction.cached_extract(path, tmp_path / "slow.txt", PDF, limits(0.5), 2)
    (proc,) = spawned.procs
    assert proc.returncode is not None  # killed, not left running
    with pytest.raises(UnreadableDocument, match="took too long"):
        await extraction.cached_extract(path, tmp_path / "slow.txt", PDF, limits(0.5), 2)
    assert len(spawned.procs) == 1  # not read again


async def test_cancelling_the_caller_kills_its_reader(tmp_path, spawned):
    path = tmp_path / "slow"
    path.write_bytes(slow_pdf())
    task = asyncio.create_task(extraction.cached_extract(path, tmp_path / "slow.txt", PDF, limits(60.0), 2))
    await spawned.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert spawned.procs[0].returncode is not None
    assert not (tmp_path / "slow.txt").exists()  # nothing remembered: the next request reads it again


async def test_a_reader_runs_below_the_server_priority(tmp_path, spawned):
    """A crafted PDF costs its whole deadline of CPU: the reader must not take it from the
    streams being generated (an attacker's uploads kept both cores busy at equal priority)."""
    from media.pdf_worker import NICENESS

    path = tmp_path / "slow"
    path.write_bytes(slow_pdf())
    task = asyncio.create_task(extraction.cached_extract(path, tmp_path / "slow.txt", PDF, limits(60.0), 2))
    await spawned.started.wait()
    stat = f"/proc/{spawned.procs[0].pid}/stat"
    niceness = None
    for _ in range(200):  # until the child has set it (it starts at the server's)
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        niceness = int(fields[16])  # the 19th field of stat; fields[0] here is the 3rd
        if niceness == os.nice(0) + NICENESS:
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert niceness == os.nice(0) + NICENESS


async def test_a_caller_that_waits_too_long_for_a_reader_slot_is_busy(tmp_path, spawned):
    path = tmp_path / "report"
    path.write_bytes(make_pdf(["Hello"]))
    slots = extraction._SLOTS.semaphore(1)
    await slots.acquire()  # another file holds the only reader
    try:
        with pytest.raises(extraction.ExtractionBusy, match=r"busy for 0\.2 s"):
            await extraction.cached_extract(path, tmp_path / "report.txt", PDF, limits(0.2), 1)
    finally:
        slots.release()
    assert spawned.procs == []
    doc = await extraction.cached_extract(path, tmp_path / "report.txt", PDF, limits(0.2 + 30), 1)
    assert doc.text == "[Page 1]\nHello"


async def test_a_reading_outlives_one_cancelled_caller_while_another_waits(tmp_path, spawned):
    path = tmp_path / "slow"
    path.write_bytes(slow_pdf())
    calls = [extraction.cached_extract(path, tmp_path / "slow.txt", PDF, limits(1.0), 2) for _ in range(2)]
    leaving, staying = (asyncio.create_task(call) for call in calls)
    await spawned.started.wait()
    leaving.cancel()
    with pytest.raises(UnreadableDocument, match="took too long"):  # the reading went on to its deadline
        await staying
    assert leaving.cancelled() and len(spawned.procs) == 1


async def test_a_pdf_that_needs_more_memory_than_the_reader_may_use_is_refused(tmp_path, spawned):
    path = tmp_path / "inflating"
    path.write_bytes(inflating_pdf(num_pages=4, num_bytes=60_000_000))  # 240 MB inflated
    with pytest.raises(UnreadableDocument, match="needs more memory than this server allows"):
        await extraction.cached_extract(path, tmp_path / "inflating.txt", PDF, limits(max_memory_bytes=192 << 20), 1)
    assert spawned.procs[0].returncode == 0  # refused by the reader, not killed


def test_a_reader_dies_with_the_server_however_the_server_exits(tmp_path):
    """A third Ctrl-C ends the server with os._exit: its PDF reader must not live on (Linux)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pdf = tmp_path / "slow.pdf"
    pdf.write_bytes(slow_pdf())
    parent = (
        "import subprocess, sys, time, os\n"
        f"child = subprocess.Popen([sys.executable, '-m', 'media.pdf_worker', {str(pdf)!r}, '100', '100000', '60',"
        f" str(2 << 30)])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(1.0)\n"
        "os._exit(1)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", parent], cwd=root, capture_output=True, text=True, timeout=30)
    child_pid = int(done.stdout.split()[0])
    for _ in range(100):  # the kernel's SIGKILL is at once; reaping by init may take a moment
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{child_pid}/stat").read_text().split()[2] == "Z":
            return
        time.sleep(0.05)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the reader outlived the server")


async def test_a_file_deleted_while_it_is_read_leaves_no_text_behind(tmp_path, spawned):
    """Its delete removed the upload and its text (none yet); the reading, seconds later, wrote
    the text of a file that no longer exists (kept until the hourly orphan sweep)."""
    from media import documents

    path = tmp_path / "doc.pdf"
    path.write_bytes(make_pdf(["some text on a page"]))
    doc = await extraction.cached_extract(path, tmp_path / "doc.txt", PDF, limits(), 2)
    assert (tmp_path / "doc.txt").exists()  # kept while its file is there
    path.unlink()  # store/blobs.py remove() ran while the next reading was under way
    documents.write_cache(tmp_path / "again.txt", limits(), doc, path)
    assert not (tmp_path / "again.txt").exists()
