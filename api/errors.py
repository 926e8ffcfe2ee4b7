"""The one error type of the HTTP surface and the one renderer of OpenAI's error envelope.

`api` raises `ApiError` (or a helper below); the gateway raises its own plain types
(`gateway.errors`), which `from_gateway` maps to status, envelope and headers through the
one table `GATEWAY_ERRORS`. Every error body is `ApiError.body()`, or Anthropic's or Ollama's
envelope of it on their paths (`error_body_for`, `api/app.py`): the error middleware sends it as
JSON, a stream that has already opened sends it as one SSE `data:` frame (`api/chat.py`), and the
connection guard writes it for malformed HTTP and on a connection aiohttp never read a request
from (`api/connections.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.errors import BucketView, GatewayError, Reason
from gateway.ratelimit import format_reset


@dataclass(eq=False)
class ApiError(Exception):
    """An error with its HTTP status and OpenAI `type`, `code` and `param`."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Messages quote what the caller sent (a key, a name, an id): never more than this of it,
        # whatever the path, so an error is never as large as the request that caused it.
        self.message = _cut(self.message, MAX_MESSAGE_CHARS)
        self.param = None if self.param is None else _cut(self.param, MAX_PARAM_CHARS)
        super().__init__(self.message)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 1000, 200


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def not_found(message: str, *, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", code, param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", "invalid_api_key")


def overloaded(message: str, *, retry_after_s: float, code: str = "server_overloaded") -> ApiError:
    hdrs = {"Retry-After": str(max(1, int(-(-retry_after_s // 1))))}
    return ApiError(503, message, "server_error", code, None, hdrs)


def rate_limited(message: str, *, retry_after_s: float) -> ApiError:
    """429 for a caller without a key (a share link's reader): OpenAI's rate-limit error, no x-ratelimit-*."""
    hdrs = {
        "Retry-After": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
    }
    return ApiError(429, message, "rate_limit_exceeded", "rate_limit_exceeded", None, hdrs)


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.", "server_error", "internal_error")


# Every gateway refusal: HTTP status, OpenAI error type, error code. 429 means the caller's own
# limits (or plan), 503 the server's load; both carry Retry-After unless retrying cannot help.
GATEWAY_ERRORS: dict[Reason, tuple[int, str, str]] = {
    Reason.KEY_REQUESTS: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.KEY_TOKENS: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.TIER_REQUESTS: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.TIER_TOKENS: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.CONCURRENT_STREAMS: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.REQUEST_TOO_LARGE: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    Reason.QUEUE_FULL: (503, "server_error", "queue_full"),
    Reason.WAIT_TOO_LONG: (503, "server_error", "queue_wait_too_long"),
    Reason.DISPLACED: (503, "server_error", "queue_displaced"),
    Reason.SHUTTING_DOWN: (503, "server_error", "server_shutting_down"),
    Reason.MODEL_UNAVAILABLE: (503, "server_error", "model_unavailable"),
    Reason.OVER_QUOTA: (429, "insufficient_quota", "insufficient_quota"),
    Reason.MODEL_NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    Reason.TIER_NOT_ENABLED: (403, "invalid_request_error", "tier_not_enabled"),
}


def from_gateway(exc: GatewayError) -> ApiError:
    status, error_type, code = GATEWAY_ERRORS[exc.reason]
    headers = ratelimit_headers(exc.buckets)
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        if status == 429:
            headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
    if not exc.should_retry:
        headers["x-should-retry"] = "false"
    return ApiError(status, exc.message, error_type, code, exc.param, headers)


def ratelimit_headers(buckets: tuple[BucketView, ...]) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}."""
    headers: dict[str, str] = {}
    for view in buckets:
        headers[f"x-ratelimit-limit-{view.unit}"] = str(view.limit)
        headers[f"x-ratelimit-remaining-{view.unit}"] = str(max(0, math.floor(view.remaining)))
        headers[f"x-ratelimit-reset-{view.unit}"] = format_reset(view.reset_s)
    return headers
