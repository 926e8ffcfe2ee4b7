"""Child process for the kill -9 test: records requests concurrently, acknowledging each on stdout.

Usage: python tests/store/crash_writer.py DB_PATH RUN_ID. Runs until killed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import structlog

from settings import StoreConfig
from store.store import Store
from store.types import RequestRecord, RequestStatus

NUM_STREAMS = 8


async def _stream(store: Store, org_id: str, conv_id: str, name: str) -> None:
    for i in range(1_000_000):
        now = time.time()
        rec = RequestRecord(
            f"{name}-{i}",
            org_id,
            None,
            "demo-mini",
            "plus",
            RequestStatus.FINISHED,
            30,
            0,
            7,
            0.0001,
            1.0,
            2.0,
            3.0,
            now,
            now,
            conv_id,
            (("user", f"question {name}-{i}"),),
            f"answer {name}-{i}",
        )
        assert await store.record_request(rec)
        sys.stdout.write(f"ACK {rec.request_id}\n")
        sys.stdout.flush()


async def main(db_path: Path, run_id: str) -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    store = await Store.open(db_path, StoreConfig())
    org = await store.ensure_org("crash", "plus")
    conv = await store.create_conversation(org.id)
    sys.stdout.write(f"CONV {conv.id}\n")
    sys.stdout.flush()
    await asyncio.gather(*(_stream(store, org.id, conv.id, f"{run_id}-s{s}") for s in range(NUM_STREAMS)))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
