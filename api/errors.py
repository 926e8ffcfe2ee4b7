"""The one error type of the HTTP surface and the one renderer of OpenAI's error envelope.

Any layer (api, gateway, store) raises `ApiError` (or a subclass helper below); the error
middleware renders it. Nothing else writes error bodies.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def not_found(message: str, *, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", code, param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", "invalid_api_key")


def rate_limited(message: str, *, retry_after_s: float, headers: dict[str, str] | None = None) -> ApiError:
    hdrs = dict(headers or {})
    hdrs["Retry-After"] = str(max(1, int(-(-retry_after_s // 1))))
    return ApiError(429, message, "rate_limit_exceeded", "rate_limit_exceeded", None, hdrs)


def quota_exceeded(message: str, headers: dict[str, str] | None = None) -> ApiError:
    hdrs = dict(headers or {})
    hdrs["x-should-retry"] = "false"
    return ApiError(429, message, "insufficient_quota", "insufficient_quota", None, hdrs)


def overloaded(message: str, *, retry_after_s: float, code: str = "server_overloaded") -> ApiError:
    hdrs = {"Retry-After": str(max(1, int(-(-retry_after_s // 1))))}
    return ApiError(503, message, "server_error", code, None, hdrs)


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.", "server_error", "internal_error")
