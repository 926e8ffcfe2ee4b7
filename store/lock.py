"""One server per database: an exclusive `flock` on `<database>.lock`, held while the server runs.

Two servers on one file would each keep their own rate limits and queues (a 20-per-minute
key got 40). The lock is advisory and per server process: `server.py keys ...` and other
readers still open the database while a server holds it. The kernel drops the lock when the
process dies, so a crash never leaves it stuck.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from store.types import StoreError


class DatabaseInUse(StoreError):
    """Another running server holds the database."""


class ServerLock:
    def __init__(self, db_path: Path) -> None:
        self.path = Path(str(db_path) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise DatabaseInUse naming the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DatabaseInUse(
                f"the database {self.path.with_suffix('')} is in use by another server (pid {holder}); "
                "stop that server, or give this one its own database with --db PATH"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
