"""OpenAI chat-completions response bodies: the JSON object, the stream's chunks and `usage`.

Pure dict builders over values the caller already has (`now_s` is the one clock read);
nothing here parses a request or writes to a stream.
"""

from __future__ import annotations

import time
from typing import Any


def usage_dict(
    prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost_usd: float | None, reasoning_tokens: int = 0
) -> dict:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},  # of completion_tokens, thinking
    }
    if cost_usd is not None:
        usage["cost_usd"] = round(cost_usd, 9)  # extension: cost from the server's price table (nano-dollars)
    return usage


def completion_body(
    completion_id: str, model: str, created: int, content: str, finish_reason: str, usage: dict, extra: dict
) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "system_fingerprint": None,
        **extra,
    }


def chunk_body(
    completion_id: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason: str | None,
    include_usage: bool,
    usage: dict | None = None,
) -> dict:
    body = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = usage  # as OpenAI does: null on every chunk but the last (unless continuous)
    return body


def usage_chunk_body(completion_id: str, model: str, created: int, usage: dict) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage,
    }


def now_s() -> int:
    return int(time.time())
