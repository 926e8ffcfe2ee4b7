"""`Store`: the one object that owns the database, and the only door to it (its conversation,
feedback and stored-Response methods are in store/store_conversations.py, a mixin it subclasses).

Reads run on a small pool of read-only connections; every write is a job for the single
`Writer`. Authenticating a request reads no SQL while its key is in the `KeyCache` (re-read
in the background every `key_cache_s / 2`, cleared by key and organisation writes made here),
and keys' `last_used_at` is coalesced in memory and flushed periodically: never a write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from settings import StoreConfig
from store import files, keys, ledger, schema
from store.keycache import KeyCache, LiveKey
from store.rows import fetch_all
from store.store_conversations import StoreConversations
from store.types import (
    INFERENCE_SCOPE,
    ApiKey,
    FileQuery,
    FileQuota,
    Org,
    Principal,
    RequestRecord,
    StoredFile,
    StoreError,
    StoreUnavailable,
)
from store.writer import Job, T, Writer, is_storage_error

log = structlog.get_logger(__name__)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # "leave as is", where None is a meaningful value
# What a write probe commits: an answer and its messages, roughly, with their search index
# (about 3 bytes a character of text, store/schema.py's migration 13).
PROBE_BYTES = 256 * 1024
# Below this much free space on the database's disk the probe reports it unwritable: writes that
# fit in pages the file and its WAL already hold can succeed on a full disk, the next one not.
MIN_FREE_BYTES = 1024 * 1024


class Store(StoreConversations):
    def __init__(self, path: Path, config: StoreConfig, write_conn: aiosqlite.Connection) -> None:
        self.path = path
        self.config = config
        self._write_conn = write_conn
        self._writer = Writer(write_conn)
        self._readers: asyncio.Queue[aiosqlite.Connection] = asyncio.Queue()
        self._read_conns: list[aiosqlite.Connection] = []
        self._last_used: dict[str, float] = {}  # key_id -> unix s, not yet written
        self._keys = KeyCache(config.key_cache_s)
        self._maintenance: asyncio.Task[None] | None = None
        self._key_refresh: asyncio.Task[None] | None = None
        self._is_closed = False
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._file_problem: str | None = None  # how the file went: deleted or replaced under us

    @classmethod
    async def open(cls, path: Path, config: StoreConfig) -> Store:
        """Open (creating if needed), check, migrate, and start the writer."""
        path = Path(path)
        check_database_path(path)
        _log_sqlite_version()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_conn = await aiosqlite.connect(path, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:  # a read-only or missing folder, a file we may not read
            raise StoreError(f"cannot open the database {path}: {getattr(exc, 'strerror', None) or exc}") from exc
        store = cls(path, config, write_conn)
        store._file_id = _file_id(path)
        try:
            await schema.configure(write_conn, busy_timeout_ms=config.busy_timeout_ms, is_reader=False)
            await schema.prepare(write_conn, config.synchronous)
            await _apply_max_bytes(write_conn, config.max_db_bytes)
            for _ in range(max(1, config.num_read_connections)):
                conn = await aiosqlite.connect(path, isolation_level=None)
                store._read_conns.append(conn)
                await schema.configure(conn, busy_timeout_ms=config.busy_timeout_ms, is_reader=True)
                store._readers.put_nowait(conn)
        except sqlite3.Error as exc:
            await store._close_connections()
            raise StoreError(f"cannot open the database {path}: {exc}") from exc
        except BaseException:
            await store._close_connections()
            raise
        store._writer.start()
        await store.probe_writable()  # so that /ready is right before the first real write
        store._maintenance = asyncio.create_task(store._maintain(), name="store-maintenance")
        if store._keys.is_enabled:
            store._key_refresh = asyncio.create_task(store._refresh_keys(), name="store-key-refresh")
        log.info(
            "store_opened",
            path=str(path),
            synchronous=config.synchronous.upper(),
            schema=schema.SCHEMA_VERSION,
            is_writable=store.is_writable,
        )
        return store

    async def close(self) -> None:
        """Flush last_used, finish every queued write, then close the connections."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in (self._maintenance, self._key_refresh):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._maintenance = self._key_refresh = None
        with contextlib.suppress(StoreError):
            await self._flush_last_used()
        await self._writer.close()
        await self._close_connections()

    @property
    def is_writable(self) -> bool:
        """False while the last write transaction failed for lack of a writable database, and
        for good once the file was deleted or replaced under the server (writes would go to a
        file no longer at the path, lost at stop)."""
        return self._writer.is_writable and self._file_problem is None

    def _check_file(self) -> None:
        """Notice, once, that the database file at the path is no longer the one opened."""
        if self._file_problem is not None or self._file_id is None:
            return
        found = _file_id(self.path)
        if found == self._file_id:
            return
        self._file_problem = "deleted" if found is None else "replaced by another file"
        log.error(
            "store_file_gone",
            path=str(self.path),
            problem=self._file_problem,
            detail="what the server writes now would be lost at stop: stop it, put the file back "
            "(or restore a backup), then start it",
        )

    # --- organisations and keys ----------------------------------------------------------

    async def create_org(
        self, name: str, tier: str, *, budget_usd: float | None = None, limits: dict[str, Any] | None = None
    ) -> Org:
        job = functools.partial(keys.insert_org, name=name, tier=tier, budget_usd=budget_usd, limits=limits or {})
        return await self._write(job)

    async def get_org(self, name: str) -> Org | None:
        async with self._reader() as conn:
            return await keys.get_org(conn, name)

    async def list_orgs(self) -> list[Org]:
        async with self._reader() as conn:
            return await keys.list_orgs(conn)

    async def update_org(
        self, name: str, *, tier: str | None = None, budget_usd: Any = UNSET, limits: Any = UNSET
    ) -> Org:
        """Change the given fields; `budget_usd=None` removes the budget, `UNSET` keeps it."""
        changes: dict[str, Any] = {}
        if tier is not None:
            changes["tier"] = tier
        if budget_usd is not UNSET:
            changes["budget_usd"] = budget_usd
        if limits is not UNSET:
            changes["limits"] = dict(limits or {})
        try:
            return await self._write(functools.partial(keys.update_org, name=name, changes=changes))
        finally:  # its keys' cached principals carry the old tier and limits
            self._keys.invalidate()

    async def ensure_org(self, name: str, tier: str) -> Org:
        """The organisation `name`, created if missing; its tier is set to `tier`."""
        org = await self.get_org(name)
        if org is not None and org.tier == tier:
            return org
        try:
            return await self._write(functools.partial(keys.ensure_org, name=name, tier=tier))
        finally:
            self._keys.invalidate()

    async def create_key(
        self, org_name: str, *, name: str | None = None, expires_at: float | None = None, scope: str = INFERENCE_SCOPE
    ) -> tuple[ApiKey, str]:
        """A new key and its secret (valid until `expires_at`, unix s, if given); the secret is returned once.

        `scope`: `inference` (the API) or `admin` (/v1/admin/ only)."""
        job = functools.partial(keys.insert_key, org_name=org_name, name=name, expires_at=expires_at, scope=scope)
        return await self._write(job)

    async def list_keys(self, org_name: str | None = None) -> list[ApiKey]:
        async with self._reader() as conn:
            found = await keys.list_keys(conn, org_name)
        pending = self._last_used
        return [_with_last_used(k, pending.get(k.id)) for k in found]

    async def get_key(self, ident: str) -> ApiKey | None:
        """A key by its id or prefix, revoked or not (never its secret)."""
        async with self._reader() as conn:
            found = await keys.get_key(conn, ident)
        return None if found is None else _with_last_used(found, self._last_used.get(found.id))

    async def find_keys(self, ident: str) -> list[ApiKey]:
        """Keys whose id is `ident` or whose prefix starts with it (at least `sk-` and 3 more
        characters), revoked or not, oldest first: `keys revoke` picks one by a short prefix."""
        async with self._reader() as conn:
            found = await keys.find_keys(conn, ident)
        return [_with_last_used(k, self._last_used.get(k.id)) for k in found]

    async def revoke_key(self, prefix: str) -> bool:
        """Revoke by prefix or key id; refused from the next request on (this process), or within
        key_cache_s (others)."""
        try:
            return await self._write(functools.partial(keys.revoke_key, prefix=prefix, now=time.time()))
        finally:  # after the commit: a lookup that read before it is not stored (KeyCache.generation)
            self._keys.invalidate()

    async def authenticate(self, secret: str) -> Principal | None:
        """The live key's principal; None for unknown, revoked or expired (expiry checked every time).

        Answered from the key cache when it can, so a flood of requests reads no SQL.
        """
        if not keys.is_well_formed(secret):
            return None
        key_hash = keys.hash_secret(secret)
        cached = self._keys.get(key_hash)
        if cached is None or isinstance(cached, Principal):
            principal = cached
        else:  # MISS: read the database
            principal = await self._look_up_key(key_hash)
        if principal is not None and principal.key_id is not None:
            self._last_used[principal.key_id] = time.time()
        return principal

    # --- uploaded files (metadata; the bytes are store.blobs') ---------------------------

    async def insert_file(self, f: StoredFile, quota: FileQuota) -> StoredFile:
        """Record an uploaded file; raises QuotaExceeded (nothing written) past the org's quota."""
        return await self._write(functools.partial(files.insert, f=f, quota=quota))

    async def file_usage(self, org_id: str) -> tuple[int, int]:
        """(number of files, bytes) the organisation keeps now."""
        async with self._reader() as conn:
            return await files.usage(conn, org_id, time.time())

    async def get_file(self, org_id: str, file_id: str) -> StoredFile | None:
        async with self._reader() as conn:
            return await files.get(conn, org_id, file_id, time.time())

    async def get_files(self, org_id: str, file_ids: list[str]) -> dict[str, StoredFile]:
        """The organisation's live files among `file_ids`, by id (one read for many)."""
        async with self._reader() as conn:
            return await files.get_many(conn, org_id, file_ids, time.time())

    async def list_files(self, org_id: str, query: FileQuery) -> tuple[list[StoredFile], bool]:
        async with self._reader() as conn:
            return await files.list_page(conn, org_id, time.time(), query)

    async def delete_file(self, org_id: str, file_id: str) -> bool:
        return await self._write(functools.partial(files.delete, org_id=org_id, file_id=file_id))

    async def purge_expired_files(self, now: float | None = None) -> list[str]:
        """Delete the rows of expired files; returns their ids (the caller removes the bytes)."""
        job = functools.partial(files.purge_expired, now=time.time() if now is None else now)
        return await self._write(job)

    async def file_ids(self) -> set[str]:
        async with self._reader() as conn:
            return await files.live_ids(conn)

    # --- the usage ledger ----------------------------------------------------------------

    async def record_request(self, rec: RequestRecord) -> bool:
        """Bill `rec` and store its conversation turn in one transaction; False if already billed.

        Raises StoreUnavailable if it could not be written; the record is then logged at
        ERROR (counts and cost, no text) so that it is never lost silently.
        """
        try:
            return await self._write(functools.partial(ledger.record, rec=rec))
        except StoreUnavailable as exc:
            log.error(
                "usage_record_not_written",
                request_id=rec.request_id,
                org_id=rec.org_id,
                key_id=rec.key_id,
                model=rec.model,
                status=rec.status.value,
                prompt_tokens=rec.prompt_tokens,
                cached_tokens=rec.cached_tokens,
                completion_tokens=rec.completion_tokens,
                cost_usd=rec.cost_usd,
                created_at=rec.created_at,
                error=str(exc),
            )
            raise

    async def month_spend_usd(self, org_id: str, now: float | None = None) -> float:
        """Cost of the organisation's requests in the calendar month (UTC) of `now`."""
        async with self._reader() as conn:
            return await ledger.month_spend_usd(conn, org_id, time.time() if now is None else now)

    async def usage_summary(
        self, org_id: str | None, *, start: float | None = None, end: float | None = None, group_by: str = "model"
    ) -> list[dict[str, Any]]:
        """Rows of {<group>, num_requests, prompt_tokens, cached_tokens, completion_tokens, cost_usd};
        `org_id=None`: every organisation's requests."""
        async with self._reader() as conn:
            return await ledger.summary(conn, org_id, start, end, group_by)

    # --- health --------------------------------------------------------------------------

    async def integrity_check(self) -> str:
        """`PRAGMA integrity_check`: 'ok', or SQLite's list of problems."""
        async with self._reader() as conn:
            rows = await fetch_all(conn, "PRAGMA integrity_check")
        return "\n".join(str(r[0]) for r in rows)

    async def probe_writable(self) -> bool:
        """Write (and commit) PROBE_BYTES, then shrink it again; updates and returns `is_writable`.

        A tiny in-place update can succeed on a full disk while the next ledger row fails, so
        the probe makes the file (or its WAL) grow the way an answer with its messages does.
        The freed pages stay in the file for the next real write. A disk with less than
        MIN_FREE_BYTES free is unwritable whatever the probe gets (it may fit in pages the file
        or its WAL already hold: the answer after it does not).
        """
        self._check_file()
        if self._file_problem is not None:
            return False
        try:
            free = shutil.disk_usage(self.path.parent).free
        except OSError:
            free = None  # the write below tells
        if free is not None and free < MIN_FREE_BYTES:
            self._writer.set_unwritable(StoreUnavailable(f"{free} bytes free on the disk holding {self.path}"))
            return False
        with contextlib.suppress(StoreUnavailable):
            await self._write(functools.partial(_write_probe, num_bytes=PROBE_BYTES))
            await self._write(functools.partial(_write_probe, num_bytes=0))
        return self.is_writable

    # --- internals -----------------------------------------------------------------------

    async def _write(self, job: Job[T]) -> T:
        return await self._writer.run(job)

    @contextlib.asynccontextmanager
    async def _reader(self) -> AsyncIterator[aiosqlite.Connection]:
        if self._is_closed:
            raise StoreUnavailable("the store is closed")
        conn = await self._readers.get()
        try:
            yield conn
        except sqlite3.Error as exc:
            if is_storage_error(exc):
                raise StoreUnavailable(f"the database cannot be read: {exc}") from exc
            raise
        finally:
            self._readers.put_nowait(conn)

    async def _look_up_key(self, key_hash: str) -> Principal | None:
        generation, checked_s = self._keys.generation, self._keys.now()
        async with self._reader() as conn:
            live: LiveKey | None = (await keys.find_live_keys(conn, [key_hash])).get(key_hash)
        self._keys.put(key_hash, live, generation, checked_s=checked_s)
        return None if live is None else live.principal_at(time.time())

    async def _refresh_keys(self) -> None:
        """Re-read the cached keys in use every key_cache_s / 2, so that a key revoked (or an
        organisation changed) by another process (`server.py keys revoke`) is seen within
        key_cache_s while requests read no SQL. A failed re-read lets the entries age out."""
        while True:
            await asyncio.sleep(self._keys.max_age_s / 2)
            hashes = self._keys.in_use()
            if not hashes:
                continue
            generation, checked_s = self._keys.generation, self._keys.now()
            try:
                async with self._reader() as conn:
                    found = await keys.find_live_keys(conn, hashes)
            except (StoreError, sqlite3.Error) as exc:
                log.warning("key_refresh_failed", error=str(exc))
                continue
            for key_hash in hashes:
                self._keys.put(key_hash, found.get(key_hash), generation, checked_s=checked_s, is_refresh=True)

    async def _flush_last_used(self) -> None:
        if not self._last_used:
            return
        pending, self._last_used = self._last_used, {}
        try:
            await self._write(functools.partial(keys.touch_keys, last_used=pending))
        except StoreError:
            for key_id, t in pending.items():  # keep them for the next flush
                self._last_used[key_id] = max(t, self._last_used.get(key_id, 0.0))
            raise

    async def _maintain(self) -> None:
        """Flush last_used periodically; while unwritable, probe so /ready can recover."""
        interval_s = max(0.05, self.config.last_used_flush_s)
        while True:
            await asyncio.sleep(interval_s)
            self._check_file()
            with contextlib.suppress(StoreError):
                await self._flush_last_used()
                if not self.is_writable:
                    await self.probe_writable()

    async def _close_connections(self) -> None:
        for conn in [*self._read_conns, self._write_conn]:
            with contextlib.suppress(Exception):
                await conn.close()
        self._read_conns.clear()


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_database_path(path: Path) -> None:
    """StoreError, in one line, for a path that can never hold the database: a folder, or a path
    through a file. Without it SQLite says only "unable to open database file"."""
    with contextlib.suppress(OSError):  # a folder we may not look into: opening it says so
        if path.is_dir():
            raise StoreError(f"cannot open the database {path}: Is a directory; give a file in it: {path / 'chat.db'}")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise StoreError(f"cannot open the database {path}: Not a directory ({parent} is a file)")


def open_error(path: Path, exc: Exception) -> str:
    """`cannot open the database PATH: why`, naming the path once whether or not `exc` names it."""
    message = str(exc)
    return message if str(path) in message else f"cannot open the database {path}: {message}"


async def _write_probe(conn: aiosqlite.Connection, num_bytes: int) -> None:
    value = f"{time.time()} " + "x" * num_bytes
    await conn.execute(
        "INSERT INTO meta (key, value) VALUES ('write_probe', ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (value,),
    )


async def _apply_max_bytes(conn: aiosqlite.Connection, max_db_bytes: int) -> None:
    if max_db_bytes > 0:
        rows = await fetch_all(conn, "PRAGMA page_size")
        await conn.execute_fetchall(f"PRAGMA max_page_count = {max(1, max_db_bytes // int(rows[0][0]))}")


def _with_last_used(key: ApiKey, pending_s: float | None) -> ApiKey:
    if pending_s is None or (key.last_used_at is not None and key.last_used_at >= pending_s):
        return key
    return dataclasses.replace(key, last_used_at=pending_s)


def _log_sqlite_version() -> None:
    # Debug only: the WAL-reset bug fixed in 3.52.0 needs two connections writing at once, and
    # the store writes through one connection; a warning on every start and every `keys`
    # command told users of Debian's SQLite about a problem they cannot have.
    log.debug("sqlite", version=sqlite3.sqlite_version, has_wal_reset_fix=schema.sqlite_version_is_safe())
