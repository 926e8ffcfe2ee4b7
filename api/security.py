"""Who may call the server: the Host and Origin checks, API keys, keyless loopback mode, /metrics,
and the one public API path (a share link's snapshot).

The middleware here runs before any handler reads a body. A presented key must be valid in
every mode; the keyless `local` organisation is served only to a loopback peer that named an
allowed Host (DNS rebinding gets 403 before it reaches the API). It must not render errors
itself: it raises `ApiError`, which the error middleware renders.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from api.errors import ApiError, unauthorized
from api.state import PRINCIPAL, SETTINGS, STATE
from settings import ConfigError, Settings
from store.keys import is_key_shaped
from store.types import Principal

# Paths a load balancer probes with whatever Host it likes; they disclose nothing.
HOST_EXEMPT_PATHS = ("/health", "/ready")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
ADMIN_PREFIX = "/v1/admin/"  # api/admin.py: admin keys only, and admin keys nowhere else
# The API's paths: OpenAI's and Anthropic's under /v1/, Ollama's native API under /api/ (api/ollama.py).
OLLAMA_PREFIX = "/api/"  # api/ollama.py: Ollama's native API
API_PREFIXES = ("/v1/", OLLAMA_PREFIX)
# API paths anyone may read without a key: a share link's snapshot (api/shares.py), whose
# unguessable token in the path is the capability. Its page, /share/{token}, is no API path.
PUBLIC_API_PREFIXES = ("/v1/shared/",)


def is_api_path(path: str) -> bool:
    """Authenticated as the API (keys or the keyless loopback mode), with CORS headers on answers."""
    return path.startswith(API_PREFIXES)


def is_public_api_path(path: str) -> bool:
    """Served without a key, whoever asks (CORS headers still only for listed origins)."""
    return path.startswith(PUBLIC_API_PREFIXES)


def is_ollama_path(path: str) -> bool:
    return path.startswith(OLLAMA_PREFIX)


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keyless_allowed(settings: Settings) -> bool:
    """Whether the server may serve requests without a key at all (loopback peers only)."""
    server = settings.server
    if server.require_keys:
        return False
    return is_loopback(server.host) or server.allow_public_without_keys


def is_loopback_only(settings: Settings) -> bool:
    """Bound to loopback with no proxy in front: only this machine's users reach the port."""
    return is_loopback(settings.server.host) and not settings.server.trusted_proxies


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    """server.trusted_proxies: addresses or networks ("10.0.0.0/8"); an entry that is neither is
    matched as written. Every client a proxy serves arrives with the proxy's address."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> TrustedProxies:
        networks, names = [], set()
        for entry in settings.server.trusted_proxies:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                names.add(entry)
        return cls(tuple(networks), frozenset(names))

    def has(self, peer: str | None) -> bool:
        if not peer:
            return False
        if peer in self.names:
            return True
        try:
            ip = ipaddress.ip_address(peer)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack socket's IPv4 peer
        return any(ip in network for network in self.networks)


def forwarded_scheme(request: web.Request, proxies: TrustedProxies) -> str:
    """The scheme the client used: a trusted proxy's X-Forwarded-Proto (it may end TLS and speak
    plain HTTP to us), else this connection's own."""
    if proxies.has(request.remote):
        forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
        if forwarded in ("http", "https"):
            return forwarded
    return request.scheme


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context from server.tls_cert_file and tls_key_file (TLS 1.2 or later), or
    None for plain HTTP; ConfigError naming the setting when they cannot be used."""
    cfg = settings.server
    if not cfg.tls_cert_file and not cfg.tls_key_file:
        return None
    if not cfg.tls_cert_file or not cfg.tls_key_file:
        raise ConfigError("server.tls_cert_file and server.tls_key_file go together: set both (HTTPS) or neither")
    for name, path in (("tls_cert_file", cfg.tls_cert_file), ("tls_key_file", cfg.tls_key_file)):
        if not os.path.isfile(path):
            raise ConfigError(f"server.{name}: {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"server.tls_cert_file / tls_key_file: cannot load {cfg.tls_cert_file} with {cfg.tls_key_file} "
            f"(PEM certificate chain and its private key): {exc}"
        ) from None
    return context


def check_startup(settings: Settings) -> None:
    """Refuse configurations that would open a door without saying so."""
    tls_context(settings)  # an unusable certificate stops the start here, before models load
    if settings.telemetry.otlp_traces_endpoint:
        from api.telemetry import check_config

        check_config(settings.telemetry)
    if settings.server.trusted_proxies and keyless_allowed(settings):
        raise ConfigError(
            "server.trusted_proxies is set, so every client arrives from the proxy's address and would be "
            "served without a key: set server.require_keys = true (and create keys with: .venv/bin/python server.py "
            "keys create --org NAME --tier free)"
        )


_HOST_NAME = re.compile(r"[a-z0-9._-]*|[0-9a-f:]+")  # a DNS name or IPv4 address; an unbracketed IPv6


def host_name(header: str) -> str:
    """The host part of a Host (or Origin netloc) value, lower-cased, without port or brackets."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        end = header.find("]")
        rest = header[end + 1 :] if end > 0 else "?"
        return header[1:end] if rest == "" or (rest.startswith(":") and rest[1:].isdigit()) else ""
    name, _, port = header.partition(":") if header.count(":") == 1 else (header, "", "")
    if (port and not port.isdigit()) or not _HOST_NAME.fullmatch(name):
        return ""  # not one host ("a:80, b"), so it names none of ours
    return name


@dataclass(frozen=True, slots=True)
class HostPolicy:
    names: frozenset[str]  # Host names that may reach the API (and the keyless mode)
    any_host: bool  # allowed_hosts contains "*": any Host, but never keyless

    @classmethod
    def from_settings(cls, settings: Settings) -> HostPolicy:
        server = settings.server
        names = {*LOCAL_NAMES, server.host.lower(), *(h.lower() for h in server.allowed_hosts if h != "*")}
        return cls(frozenset(names), "*" in server.allowed_hosts)

    def is_named(self, host: str, sockname: str | None) -> bool:
        """The Host names this server: a configured name, or the address the connection came in on."""
        return host in self.names or (sockname is not None and host == sockname.lower())

    def allows(self, host: str, sockname: str | None) -> bool:
        return self.any_host or self.is_named(host, sockname)


def _sockname(request: web.Request) -> str | None:
    info = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return str(info[0]) if info else None


def _check_host(request: web.Request, policy: HostPolicy) -> None:
    host = host_name(request.headers.get("Host", ""))
    if request.path in HOST_EXEMPT_PATHS or policy.allows(host, _sockname(request)):
        return
    raise ApiError(
        403,
        f"Host {host!r} is not served here; add it to server.allowed_hosts if it names this server.",
        "permission_error",
        "host_not_allowed",
    )


def _is_same_origin(request: web.Request, origin: str) -> bool:
    parts = urlsplit(origin)
    return origin != "null" and bool(parts.netloc) and parts.netloc.lower() == request.headers.get("Host", "").lower()


def cors_origin(request: web.Request, settings: Settings) -> str | None:
    """The request's Origin when it is another site that server.cors_origins lets call the API
    (listed, or "*"), so its answers carry CORS headers; None for same-origin and other calls."""
    origin = request.headers.get("Origin")
    if origin is None or origin == "null" or _is_same_origin(request, origin):
        return None
    allowed = settings.server.cors_origins
    return origin if origin in allowed or "*" in allowed else None


def _check_origin(request: web.Request, settings: Settings) -> None:
    """A browser's state-changing call must come from our own page (or a configured origin)."""
    origin = request.headers.get("Origin")
    if origin is None or request.method in SAFE_METHODS:
        return
    if _is_same_origin(request, origin) or cors_origin(request, settings) is not None:
        return
    raise ApiError(
        403,
        f"Cross-origin request from {origin!r} refused; see server.cors_origins.",
        "permission_error",
        "origin_not_allowed",
    )


# Headers a page on an allowed origin may send, and may read from our answers.
CORS_ALLOW_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
CORS_EXPOSE_HEADERS = ", ".join(
    [
        "X-Request-Id",
        "request-id",  # Anthropic's SDK reads it on /v1/messages
        "X-Max-File-Bytes",
        "X-Sharing-Enabled",  # api/shares.py: whether links may be made
        "Retry-After",
        "retry-after-ms",
        "x-should-retry",
        "x-fallback-from",
        "x-fallback-reason",
        "x-history-messages-dropped",
        "Content-Disposition",  # an export's filename
        *(f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")),
    ]
)
CORS_MAX_AGE_S = 600


def add_cors_headers(request: web.Request, response: web.StreamResponse, settings: Settings) -> None:
    """CORS headers on an answer to an allowed origin (errors and streams included: a page can
    read neither without them)."""
    origin = cors_origin(request, settings)
    vary = response.headers.get("Vary")
    response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS


def _preflight(request: web.Request, settings: Settings) -> web.Response:
    """A browser's CORS preflight (OPTIONS with Access-Control-Request-Method): 204 with what the
    page may send when its origin is allowed, 403 otherwise. Preflights carry no key."""
    origin = request.headers.get("Origin")
    if origin is None or cors_origin(request, settings) is None:
        raise ApiError(
            403,
            f"Cross-origin request from {origin!r} refused; list the page's origin in server.cors_origins.",
            "permission_error",
            "origin_not_allowed",
        )
    headers = {
        "Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
        "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
    }
    wanted = request.headers.get("Access-Control-Request-Headers")
    if wanted:  # any header: the key check, not the header list, is what guards the API
        headers["Access-Control-Allow-Headers"] = wanted
    return web.Response(status=204, headers=headers)


async def _key_principal(request: web.Request, keyless_peer: bool):
    """The principal of the presented key; None when no key was sent. Invalid keys raise 401.
    `keyless_peer` (the keyless mode serves this peer): a placeholder that is no key of ours in
    shape (the openai SDK must send something; tutorials for other local servers send "EMPTY" or
    "ollama") counts as no key; one shaped like ours still has to be valid (a typo or a revoked key
    must not pass unnoticed)."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise unauthorized("Malformed Authorization header; expected 'Bearer <API key>'.")
    else:
        secret = request.headers.get("x-api-key", "")  # how Anthropic's SDK sends its key
    if not secret.strip() or (keyless_peer and not is_key_shaped(secret.strip())):
        return None
    principal = await request.app[STATE].store.authenticate(secret.strip())
    if principal is None:
        raise unauthorized(
            "Incorrect API key provided (unknown or revoked). "
            "Create one with: .venv/bin/python server.py keys create --org NAME --tier free, giving it the --db or"
            " --config this server was started with."
        )
    return principal


def _is_keyless_peer(request: web.Request, policy: HostPolicy) -> bool:
    settings = request.app[SETTINGS]
    if request.app[STATE].local_principal is None:
        return False
    peer_ok = is_loopback(request.remote or "") or settings.server.allow_public_without_keys
    origin = request.headers.get("Origin")
    if origin is not None and origin in settings.server.cors_origins:
        pass  # a page the operator listed by name may use the keyless mode like our own UI
    elif origin is not None and cors_origin(request, settings) is not None:
        return False  # any site ("*"): a page the user merely visits must never act keyless on their behalf
    return peer_ok and policy.is_named(host_name(request.headers.get("Host", "")), _sockname(request))


async def _check_metrics_access(request: web.Request) -> None:
    settings = request.app[SETTINGS]
    if is_loopback_only(settings):
        return
    token = settings.server.metrics_token
    header = request.headers.get("Authorization", "")
    if token and hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        return
    principal = await _key_principal(request, keyless_peer=False)
    if principal is None:
        raise unauthorized("/metrics needs an API key or server.metrics_token when the server is not loopback-only.")
    if principal.is_admin:  # admin keys manage organisations, nothing else (docs/security.md)
        raise ApiError(
            403,
            "This is an admin key: it reaches /v1/admin/ only. Use server.metrics_token or an inference key.",
            "permission_error",
            "admin_key_not_allowed",
        )


async def _admin_principal(request: web.Request) -> Principal:
    """/v1/admin/ takes admin keys only, from any peer; never the keyless local mode."""
    principal = await _key_principal(request, keyless_peer=False)
    if principal is None:
        raise unauthorized(
            "The admin API needs an admin key (Authorization: Bearer <key>). Create one with: "
            ".venv/bin/python server.py keys create --org admin --tier free --scope admin, giving it the --db or"
            " --config this server was started with."
        )
    if not principal.is_admin:
        raise ApiError(
            403,
            "The admin API needs an admin key; this key serves inference only. Create an admin key with: "
            ".venv/bin/python server.py keys create --org admin --tier free --scope admin, giving it the --db or"
            " --config this server was started with.",
            "permission_error",
            "admin_key_required",
        )
    return principal


# Writes outside the chat path (which has its own admission): each counts against the caller's
# request limit, so that no key can store conversations, files or feedback at any rate.
_STORE_WRITE_PREFIXES = ("/v1/conversations", "/v1/files", "/v1/responses/", "/v1/shares")


def _writes_to_the_store(request: web.Request) -> bool:
    return request.method in ("POST", "PATCH", "DELETE") and request.path.startswith(_STORE_WRITE_PREFIXES)


def make_access_middleware(settings: Settings):
    policy = HostPolicy.from_settings(settings)

    @web.middleware
    async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
        _check_host(request, policy)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return _preflight(request, settings)
        _check_origin(request, settings)
        if request.path == "/metrics":
            await _check_metrics_access(request)
        elif is_admin_path(request.path):
            request[PRINCIPAL] = await _admin_principal(request)
        elif is_api_path(request.path) and not is_public_api_path(request.path):
            keyless_peer = _is_keyless_peer(request, policy)
            principal = await _key_principal(request, keyless_peer)
            if principal is None and keyless_peer:
                principal = await request.app[STATE].keyless_principal()
            if principal is None:
                raise unauthorized("You didn't provide an API key. Send 'Authorization: Bearer <API key>'.")
            if principal.is_admin:
                raise ApiError(
                    403,
                    "This is an admin key: it manages organisations, keys and usage under /v1/admin/ and cannot "
                    "call the rest of the API. Use an inference key.",
                    "permission_error",
                    "admin_key_not_allowed",
                )
            request[PRINCIPAL] = principal
            if _writes_to_the_store(request):
                request.app[STATE].charge_request(principal)
        return await handler(request)

    return access_middleware
