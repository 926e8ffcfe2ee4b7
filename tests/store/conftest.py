"""Fixtures for the store tests: a fresh Store on a temporary file, and record builders."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import pytest
import pytest_asyncio

from settings import StoreConfig
from store.store import Store
from store.types import RequestRecord, RequestStatus

_request_ids = itertools.count()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "chat.db"


@pytest.fixture
def store_config() -> StoreConfig:
    return StoreConfig(busy_timeout_ms=2000, last_used_flush_s=3600.0)


@pytest_asyncio.fixture
async def store(db_path: Path, store_config: StoreConfig):
    opened = await Store.open(db_path, store_config)
    yield opened
    await opened.close()


def _make_record(org_id: str, **changes) -> RequestRecord:
    now = time.time()
    rec = RequestRecord(
        request_id=f"req-{next(_request_ids)}",
        org_id=org_id,
        key_id=None,
        model="demo-mini",
        tier="plus",
        status=RequestStatus.FINISHED,
        prompt_tokens=100,
        cached_tokens=20,
        completion_tokens=10,
        cost_usd=0.001,
        queue_ms=1.0,
        ttft_ms=5.0,
        total_ms=50.0,
        created_at=now,
        finished_at=now + 0.05,
    )
    return dataclasses.replace(rec, **changes)


@pytest.fixture
def make_record():
    """make_record(org_id, **changes) -> a finished RequestRecord with a fresh request id."""
    return _make_record
