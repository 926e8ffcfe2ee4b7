"""The bytes of uploaded files on disk: one file per id under one folder, written via a temp file.

`Blobs` owns the folder: an upload streams into `.partial/` (hashed and counted as it goes,
never held whole in memory) and is renamed to its id only when complete; removing a file
also removes its cached text. A file sent inline in a request is written to `.partial/` too, only
while it is read (`scratch_path`), then removed. Files written beside a blob (its cached text) go through
`<name>.<random>.tmp`, which a crash can leave behind: the sweep removes those once stale. It
knows nothing of owners or quotas (that is SQLite's part).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_PARTIAL = ".partial"
_TEXT_SUFFIX = ".txt"
_TEMP_SUFFIX = ".tmp"  # media/documents.py write_cache: <file id>.txt.<random>.tmp


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def is_file_id(text: str) -> bool:
    return bool(FILE_ID.match(text))


class Upload:
    """One upload in progress; `commit` or `discard` (exactly one of them) ends it."""

    def __init__(self, blobs: Blobs) -> None:
        self._blobs = blobs
        self.temp_path = blobs.root / _PARTIAL / f"{secrets.token_hex(8)}.part"
        self._fh = open(self.temp_path, "wb")  # noqa: SIM115 - closed by commit/discard
        self._sha = hashlib.sha256()
        self.num_bytes = 0

    def write(self, chunk: bytes) -> None:
        self._fh.write(chunk)
        self._sha.update(chunk)
        self.num_bytes += len(chunk)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def commit(self, file_id: str) -> Path:
        """Flush to disk and move into place under `file_id` (call off the event loop)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        final = self._blobs.path(file_id)
        os.replace(self.temp_path, final)
        return final

    def discard(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.temp_path.unlink(missing_ok=True)


class Blobs:
    def __init__(self, root: Path) -> None:
        """Creates the folder; OSError when uploads could not be written there (checked by writing
        one empty file, so a read-only disk is found now, not at the first upload)."""
        self.root = Path(root)
        (self.root / _PARTIAL).mkdir(parents=True, exist_ok=True)
        probe = self.root / _PARTIAL / f"write-check-{secrets.token_hex(4)}.part"
        probe.touch()
        probe.unlink()

    def start_upload(self) -> Upload:
        return Upload(self)

    def scratch_path(self) -> Path:
        """A new name in `.partial/` for bytes kept only while a request reads them (the caller
        removes it; one left by a crash goes with the sweep)."""
        return self.root / _PARTIAL / f"inline-{secrets.token_hex(8)}.part"

    def path(self, file_id: str) -> Path:
        if not is_file_id(file_id):  # ids are the only names, so no path can escape the folder
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def text_path(self, file_id: str) -> Path:
        return self.path(file_id).with_suffix(_TEXT_SUFFIX)

    def remove(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
        self.text_path(file_id).unlink(missing_ok=True)

    def sweep_orphans(self, live_ids: set[str], min_age_s: float = 3600.0) -> int:
        """Remove blobs without a row, and stale partial uploads and temp files (left by a crash);
        returns the count."""
        cutoff = time.time() - min_age_s
        removed = 0
        for entry in [*self.root.iterdir(), *(self.root / _PARTIAL).iterdir()]:
            file_id = entry.name.removesuffix(_TEXT_SUFFIX)
            is_temp = entry.name.endswith(_TEMP_SUFFIX) and is_file_id(entry.name.partition(".")[0])
            is_orphan = entry.parent.name == _PARTIAL or is_temp or (is_file_id(file_id) and file_id not in live_ids)
            if entry.is_file() and is_orphan and entry.stat().st_mtime < cutoff:
                entry.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("orphan_files_removed", num_files=removed)
        return removed
