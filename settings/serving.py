"""The sections of the HTTP front and the gateway: [server], [tiers.<name>] (with the limits an
organisation may override) and [queue]. Declarations only: loading and checking are in loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from settings.fields import setting


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP server: address, request and connection limits, access control, logs."""

    host: str = setting(
        "127.0.0.1",
        'Interface to bind, an address alone ("::1", not "[::1]"; the port is `port`); 127.0.0.1 keeps the server on '
        "this machine.",
    )
    port: int = setting(8000, "TCP port.", minimum=0, maximum=65535)
    max_body_bytes: int = setting(
        20_971_520,
        "Largest request body accepted (20 MiB: a phone photo sent inline as a data: URL, as Open WebUI and "
        "LibreChat send images); bigger bodies get 413. Bodies are read only after the key check.",
        minimum=1,
    )
    max_messages: int = setting(1000, "Most messages one chat request may carry.", minimum=1)
    max_prompt_chars: int = setting(
        1_000_000,
        "Most characters of a prompt's text (messages, and tools' names, descriptions and schemas), and most token ids "
        "of a legacy completion's prompt, checked before tokenizing.",
        minimum=1,
    )
    shutdown_grace_s: float = setting(
        10.0, "On Ctrl-C/SIGTERM: how long running answers may finish before they are aborted.", minimum=0
    )
    heartbeat_s: float = setting(
        5.0, "SSE comment sent this often while a stream waits in the queue or prefills.", above=0
    )
    allow_public_without_keys: bool = setting(
        False, "Serve requests without an API key on a non-loopback address. Dangerous."
    )
    local_tier: str = setting(
        "enterprise", "Tier of requests without a key (only on loopback, or with allow_public_without_keys)."
    )
    require_keys: bool = setting(
        False, "true: every API request (/v1, and Ollama's /api) needs an API key, even on 127.0.0.1."
    )
    cors_origins: list[str] = setting(
        [],
        'Origins (besides the UI\'s own) whose browser pages may call the API (CORS), e.g. ["http://localhost:3000"] '
        'for a browser front end; "*": any site, but then only with an API key. Empty: same-origin only.',
    )
    allowed_hosts: list[str] = setting(
        [],
        'Host header names accepted besides the bound address and localhost (blocks DNS rebinding); "*": any, keys '
        "then required.",
    )
    trusted_proxies: list[str] = setting(
        [],
        'Addresses (or networks, "10.0.0.0/8") of reverse proxies in front of this server. When set, the server '
        "refuses to start without require_keys = true; share links' per-address limits (sharing.reads_per_minute) "
        "do not apply to readers arriving through one, and a share link's url takes its X-Forwarded-Proto.",
    )
    metrics_token: str = setting(
        "", "Bearer token for /metrics (an API key works too); needed when the server is not loopback-only."
    )
    tls_cert_file: str = setting(
        "",
        "PEM certificate chain to serve HTTPS directly, without a reverse proxy (with tls_key_file; both or "
        "neither). Empty: plain HTTP.",
    )
    tls_key_file: str = setting("", "PEM private key of tls_cert_file.")
    header_timeout_s: float = setting(
        10.0,
        "A request's headers must arrive within this many seconds of the connection (or the previous answer); else "
        "408 and close.",
        above=0,
    )
    body_timeout_s: float = setting(
        30.0,
        "A request's body must arrive within this many seconds after its headers, and a file upload may not pause "
        "longer than this between reads; else 408 and close.",
        above=0,
    )
    write_timeout_s: float = setting(
        30.0,
        "An answer whose bytes the client does not read for this many seconds is given up and the connection "
        "closed (a client that stops reading would otherwise hold its connection slot).",
        above=0,
    )
    max_connections: int = setting(
        1024,
        "Open connections in total (lowered to fit the open-files limit). At the cap the oldest idle (or "
        "still-sending) connection is closed, else the new one gets 503.",
        minimum=1,
    )
    max_connections_per_client: int = setting(
        256, "Open connections from one client address (all local clients share 127.0.0.1), same rule.", minimum=1
    )
    fd_reserve: int = setting(
        64,
        "File descriptors kept free of connections (database, model files, health checks); lowers max_connections to "
        "fit `ulimit -n`.",
        minimum=0,
    )
    backlog: int = setting(1024, "Pending connections the kernel queues before the server accepts them.", minimum=1)
    log_level: str = setting(
        "info",
        "debug, info, warning or error. Prompt text is only ever logged at debug.",
        choices=("debug", "info", "warning", "error"),
        ignore_case=True,
    )
    log_json: bool = setting(
        False, "true: one JSON object per log line (for log shippers); false: human-readable console lines."
    )
    static_dir: str = setting("static", "Folder of the web chat UI, served at /.")
    max_n: int = setting(
        8, "Most choices (`n`) one chat request may ask for; they share the prompt's KV blocks.", minimum=1
    )


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One [tiers.<name>] section per tier. An organisation has a tier; its API keys inherit it."""

    priority: int = setting(0, "Higher is served first and preempted last.")
    requests_per_minute: int = setting(60, "Per-key request bucket size and refill per minute.", minimum=0)
    tokens_per_minute: int = setting(100_000, "Per-key token bucket (prompt + max_tokens) per minute.", minimum=0)
    tier_requests_per_minute: int = setting(0, "Bucket shared by the whole tier; 0: none.", minimum=0)
    tier_tokens_per_minute: int = setting(0, "Token bucket shared by the whole tier; 0: none.", minimum=0)
    max_tokens: int = setting(1024, "Largest max_tokens a request may ask for.", minimum=1)
    max_context_tokens: int = setting(4096, "Largest prompt + max_tokens.", minimum=1)
    max_thinking_tokens: int = setting(
        -1,
        "Most tokens a reasoning model served here (native, <think> tags of one token each) may think per answer "
        "for this tier: the server closes its thinking there, as a request's thinking_token_budget (the smaller "
        "wins); -1: no cap.",
    )
    max_concurrent_streams: int = setting(
        4,
        "Requests in flight per key; 429 above it, except keyless local use, whose extra requests wait for a stream.",
        minimum=1,
    )
    models: list[str] = setting([], "Models this tier may use, preferred first.")
    wait_target_s: float = setting(
        10.0,
        "Estimated queue wait above which the tier's next model serves, else 503; a tier is shed at the smallest "
        "target of itself and the tiers above it, and the top tier is never shed for waiting.",
        minimum=0,
    )
    retention_days: int = setting(30, "Days a deleted conversation is kept before it is purged.", minimum=0)
    budget_fallback: bool = setting(False, "Over budget: serve the tier's last model instead of answering 429.")
    file_storage_bytes: int = setting(104_857_600, "Bytes of uploaded files an organisation may keep.", minimum=0)
    max_files: int = setting(100, "Uploaded files an organisation may keep.", minimum=0)
    conversation_storage_bytes: int = setting(
        1_073_741_824,
        "Characters (about bytes) of conversation messages an organisation may keep, deleted conversations not "
        "counted and share links' snapshots counted; at the cap, storing more is a 400 conversation_quota_exceeded "
        "until some are deleted; 0: no cap.",
        minimum=0,
    )
    file_retention_days: int = setting(
        30, "Days an uploaded file is kept (its expires_at); 0: until deleted.", minimum=0
    )


# TierConfig fields an organisation may override for its own keys (`orgs set --limit`,
# PATCH /v1/admin/organizations/{name}); the rate limiter applies them per key.
ORG_LIMITS = ("requests_per_minute", "tokens_per_minute")


def merge_org_limits(limits: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`limits` with `changes` applied: a value sets a limit (a whole number >= 0, or its text), None
    removes it. ValueError naming the limit for an unknown name or a bad value."""
    merged = dict(limits)
    for name, value in changes.items():
        if name not in ORG_LIMITS:
            raise ValueError(f"{name!r} is not a limit an organisation can override; these are {', '.join(ORG_LIMITS)}")
        if value is None:
            merged.pop(name, None)
            continue
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise ValueError(f"limit {name}: expected a whole number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit {name}: expected a whole number >= 0, got {value!r}")
        merged[name] = value
    return merged


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """One bounded priority queue per model sits in front of the engine."""

    max_waiting_requests: int = setting(256, "Requests waiting per model; more get 503 with Retry-After.", minimum=0)
    max_waiting_tokens: int = setting(1_000_000, "Prompt + max_tokens waiting per model; more get 503.", minimum=0)
    max_wait_s: float = setting(60.0, "A request whose estimated wait is longer gets 503 at once.", minimum=0)
    aging_s: float = setting(
        10.0,
        "Every this many seconds of waiting raises a request's priority by one level, so lower tiers are served in "
        "bounded time. The wait counts across retries: a load refusal (503 queue_full, queue_wait_too_long or "
        "queue_displaced) starts a record for the API key, and the key's retries rank as if they had waited in line "
        "since then, until one gets into the engine. A record ends when the key has not been refused for 60 s (the "
        "longest Retry-After sent) + aging_s; "
        "4,096 keys are remembered (least recently refused forgotten first); keyless requests of one organisation "
        "are one key. 0: strict priority, no aging.",
        minimum=0,
    )
    age_retries: bool = setting(
        True,
        "Count a key's wait across its retries after load refusals (see aging_s). false: a refused request never "
        "ages, and a lower tier gets nothing while higher tiers alone fill the engine.",
    )
