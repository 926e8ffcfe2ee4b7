"""At startup: which replicas answer, and the model's context window if the upstream says it.

vLLM, SGLang and this server list `max_model_len` on each entry of `GET /models`; llama.cpp's
server does not (set `max_model_len` in the config, or give a local `tokenizer` folder).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from engine.upstream.replicas import Replica

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Discovery:
    max_model_len: int | None
    reachable: dict[Replica, bool]


async def discover_max_model_len(
    session: aiohttp.ClientSession,
    replicas: Sequence[Replica],
    upstream_model: str,
    headers: dict[str, str],
    timeout_s: float,
) -> Discovery:
    listings = await asyncio.gather(*(_list_models(session, r, headers, timeout_s) for r in replicas))
    max_len = None
    for replica, entries in zip(replicas, listings, strict=True):
        if entries is None:
            continue
        entry = next((e for e in entries if e.get("id") == upstream_model), None)
        if entry is None:
            names = [e.get("id") for e in entries][:5]
            log.warning("upstream_model_not_listed", replica=replica.label, upstream_model=upstream_model, listed=names)
        elif isinstance(entry.get("max_model_len"), int) and max_len is None:
            max_len = entry["max_model_len"]
    return Discovery(max_len, {r: entries is not None for r, entries in zip(replicas, listings, strict=True)})


async def _list_models(
    session: aiohttp.ClientSession, replica: Replica, headers: dict[str, str], timeout_s: float
) -> list[dict[str, Any]] | None:
    """The replica's model entries; None when it cannot be reached or answers 5xx."""
    try:
        async with session.get(
            replica.base_url + "/models", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status >= 500:
                return None
            if resp.status != 200:
                log.warning("upstream_models_refused", replica=replica.label, status=resp.status)
                return []
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        log.warning("upstream_unreachable", replica=replica.label, error=type(exc).__name__)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
