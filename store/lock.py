"""One server per database: exclusive `flock`s on `<database>.lock` and on the database file, held
while the server runs.

Two servers on one file would each keep their own rate limits and queues (a 20-per-minute
key got 40). The lock file is named after the database's real path (symlinks resolved) and
holds the server's pid for the message; the lock on the database file itself catches a second
name for the same file (a hard link, a bind mount). SQLite locks with `fcntl` record locks,
which `flock` does not touch on Linux; the descriptor is closed only after the store is (closing
any descriptor of a file drops the process's `fcntl` locks on it). The locks are advisory and
per server process: `server.py keys ...`, `backup` and other readers still open the database
while a server holds it. The kernel drops them when the process dies, so a crash never leaves
them stuck.
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
        self.db_path = Path(os.path.realpath(db_path))
        self.path = Path(str(self.db_path) + ".lock")
        self._fds: list[int] = []

    def acquire(self) -> None:
        """Take both locks or raise DatabaseInUse naming the holder's pid (OSError when the
        files cannot be created: a read-only folder, a database path that is a folder)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock(self.path, holder_from_file=True)
            self._lock(self.db_path, holder_from_file=False)
        except BaseException:
            self.release()
            raise
        fd = self._fds[0]
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _lock(self, path: Path, *, holder_from_file: bool) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # an empty file is a new SQLite database
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() if holder_from_file else ""
            os.close(fd)
            via = "" if holder_from_file else " under another name (a hard link or bind mount of it)"
            raise DatabaseInUse(
                f"the database {self.db_path} is in use by another server{via} (pid {holder or 'unknown'}); "
                "stop that server, or give this one its own database with --db PATH"
            ) from None
        self._fds.append(fd)

    def holder(self) -> str | None:
        """The pid of the server that holds this database now ("unknown" when it wrote none), or
        None; creates nothing and keeps nothing (for a message about why a start failed)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file: no server has run on this database
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)  # drops the shared lock, if taken
        return None

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
