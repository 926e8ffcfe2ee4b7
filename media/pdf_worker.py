"""The child process that reads one PDF:
`python -m media.pdf_worker PATH MAX_PAGES MAX_CHARS CPU_LIMIT_S MAX_MEMORY_BYTES`.

Prints one JSON object on stdout: {"doc": {...}} with the text, or {"refused": "why"} for a
file that cannot be read. It caps its own address space (pypdf keeps every inflated stream) and
CPU time (a backstop should the server die without killing it); media/extraction.py starts it,
enforces the wall-clock deadline and kills it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from media import documents

_PR_SET_PDEATHSIG = 1
# Reading runs below the server's priority: a crafted PDF can take its whole deadline of CPU, and
# while streams are being generated the kernel gives the reader only what they leave (about a
# tenth of a core when both compete; all of an idle one).
NICENESS = 10


def _die_with_the_server(server_pid: int) -> None:
    """Linux: killed when the server exits, however it exits (a third Ctrl-C's os._exit too)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the CPU limit below is the backstop
        return
    if os.getppid() != server_pid:  # it exited before the line above ran
        os._exit(1)


def main(argv: list[str]) -> int:
    _die_with_the_server(os.getppid())
    os.nice(NICENESS)
    path, max_pages, max_chars, cpu_limit_s, max_memory_bytes = argv
    soft_s = int(cpu_limit_s)
    resource.setrlimit(resource.RLIMIT_CPU, (soft_s, soft_s + 1))  # SIGXCPU at the soft limit, SIGKILL past it
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump core
    resource.setrlimit(resource.RLIMIT_AS, (int(max_memory_bytes), int(max_memory_bytes)))  # then MemoryError
    logging.disable(logging.WARNING)  # pypdf logs every oddity of a damaged file; the server logs the outcome
    # The deadline only keys refused files in the cache (the parent's business): any value does here.
    limits = documents.ExtractLimits(int(max_pages), int(max_chars), 0.0, int(max_memory_bytes))
    try:
        doc = documents.read_pdf(Path(path), limits)
    except documents.UnreadableDocument as exc:
        out: dict = {"refused": str(exc)}
    else:
        out = {
            "doc": {
                "text": doc.text,
                "num_pages": doc.num_pages,
                "num_pages_read": doc.num_pages_read,
                "num_chars": doc.num_chars,
            }
        }
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
