"""The single writer: one task owns the write connection and runs whole transactions.

Jobs (async functions of the connection) run inside `BEGIN IMMEDIATE` ... `COMMIT` on this task,
never the caller's, so a cancelled caller cannot leave a transaction open. Jobs queued together
share one commit, each in a savepoint; a result is delivered only after its COMMIT returned.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiosqlite
import structlog

from store.types import StoreUnavailable

log = structlog.get_logger(__name__)

T = TypeVar("T")
Job = Callable[[aiosqlite.Connection], Awaitable[T]]

MAX_JOBS_PER_COMMIT = 64

# Primary result codes that mean "the file cannot be written now", not "this job is wrong".
_STORAGE_ERRORS = {
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_CORRUPT,
    sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_NOTADB,
    sqlite3.SQLITE_PERM,
}


def is_storage_error(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and code is not None and (code & 0xFF) in _STORAGE_ERRORS


@dataclass(slots=True)
class _Pending:
    job: Job[Any]
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _BatchAborted(Exception):
    """A storage error inside a job: the whole transaction is rolled back."""


class Writer:
    """Owns the write connection; `run(job)` is the only way anything is written."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._is_closing = False
        self.is_writable = True  # outcome of the most recent transaction

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="store-writer")

    async def run(self, job: Job[T]) -> T:
        """Run `job` in a write transaction and return its result once committed.

        If the caller is cancelled, the job still runs (a finished request is still billed);
        only its result is dropped.
        """
        if self._is_closing:
            raise StoreUnavailable("the store is closed")
        pending = _Pending(job)
        self._queue.put_nowait(pending)
        result: T = await pending.future
        return result

    async def close(self) -> None:
        """Stop taking jobs, finish every job already queued, then stop the task."""
        if self._is_closing:
            return
        self._is_closing = True
        self._queue.put_nowait(None)
        if self._task is not None:
            await self._task

    async def _loop(self) -> None:
        while True:
            batch, is_last = await self._next_batch()
            if batch:
                try:
                    await self._run_batch(batch)
                except Exception as exc:  # a bug here must not kill the only writer
                    log.exception("store_writer_batch_failed")
                    _fail_all(batch, functools.partial(_as_is, exc))
            if is_last:
                return

    async def _next_batch(self) -> tuple[list[_Pending], bool]:
        item = await self._queue.get()
        if item is None:
            return [], True
        batch = [item]
        while len(batch) < MAX_JOBS_PER_COMMIT and not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    async def _run_batch(self, batch: list[_Pending]) -> None:
        outcomes: list[tuple[bool, Any]] = []  # (is_ok, value or exception), by job
        try:
            await self._conn.execute("BEGIN IMMEDIATE")
            for pending in batch:
                outcomes.append(await self._run_job(pending.job))
            await self._conn.execute("COMMIT")
        except (sqlite3.Error, _BatchAborted) as exc:
            cause = exc.__cause__ if isinstance(exc, _BatchAborted) else exc
            await self._rollback()
            self._set_writable(False, cause)
            _fail_all(batch, functools.partial(_unavailable, cause))
            return
        self._set_writable(True, None)
        for pending, (is_ok, value) in zip(batch, outcomes, strict=True):
            if pending.future.done():  # the caller was cancelled; the write stands
                continue
            if is_ok:
                pending.future.set_result(value)
            else:
                pending.future.set_exception(value)

    async def _run_job(self, job: Job[Any]) -> tuple[bool, Any]:
        await self._conn.execute("SAVEPOINT job")
        try:
            value = await job(self._conn)
        except Exception as exc:
            if is_storage_error(exc):
                raise _BatchAborted() from exc
            await self._conn.execute("ROLLBACK TO job")
            await self._conn.execute("RELEASE job")
            return False, exc
        await self._conn.execute("RELEASE job")
        return True, value

    async def _rollback(self) -> None:
        # SQLite may already have rolled back on its own (e.g. after SQLITE_FULL).
        if not self._conn.in_transaction:
            return
        try:
            await self._conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.error("store_rollback_failed", error=str(exc))

    def set_unwritable(self, cause: BaseException) -> None:
        """Unwritable, found without a transaction (the disk is full): the next commit that
        succeeds sets it writable again."""
        self._set_writable(False, cause)

    def _set_writable(self, is_writable: bool, cause: BaseException | None) -> None:
        if is_writable == self.is_writable:
            if cause is not None:
                log.error("store_write_failed", error=str(cause))
            return
        self.is_writable = is_writable
        if is_writable:
            log.warning("store_writable_again")
        else:
            log.error("store_not_writable", error=str(cause))


def _unavailable(cause: BaseException | None) -> StoreUnavailable:
    err = StoreUnavailable(f"the database cannot be written: {cause}")
    err.__cause__ = cause
    return err


def _as_is(exc: BaseException) -> BaseException:
    return exc


def _fail_all(batch: list[_Pending], make_error: Callable[[], BaseException]) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(make_error())
