"""The aiohttp application factory: middlewares, the start/stop order, and the routes.

`init(settings)` returns a `web.Application`; long-lived parts (store, models, queues,
router, safety gate) start in `cleanup_ctx` and stop in reverse order. Routes come from
`api/resources.py` (with chat completions), `api/files.py`, `api/responses.py` and the API
modules beside them (completions, messages, embeddings, moderations, Ollama's). The
middlewares here (and the access middleware of `api/security.py`) are the only places that
stamp request ids, check Host/Origin and authenticate; errors are rendered as described in
`api/errors.py`.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import Gauge

from api import (
    admin,
    chat,
    completions,
    embeddings,
    files,
    messages,
    moderations,
    ollama,
    ollama_embed,
    ollama_models,
    resources,
    responses,
    responses_background,
)
from api.connections import BIG_BODY_HINT, CLOSE_AFTER, make_body_deadline_middleware
from api.errors import ApiError, from_gateway, internal_error, overloaded
from api.inflight import INFLIGHT, InFlight
from api.security import (
    add_cors_headers,
    check_startup,
    is_api_path,
    is_ollama_path,
    keyless_allowed,
    make_access_middleware,
)
from api.startup import CannotStart, build_info, check_tiers
from api.state import REQUEST_ID, SETTINGS, STATE, AppState
from engine.registry import BackendFactory, build_models
from engine.types import EngineError
from engine.upstream.metrics import register_upstream_metrics
from gateway.admission import build_admission
from gateway.errors import GatewayError
from gateway.metrics import Metrics
from settings import ConfigError, Settings
from store.lock import ServerLock
from store.store import Store, check_database_path, open_error
from store.types import StoreError, StoreUnavailable

log = structlog.get_logger(__name__)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    request[REQUEST_ID] = "req_" + uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request[REQUEST_ID])
    try:
        return await handler(request)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")


async def _stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Runs just before any response's headers go out, streams included."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]
        if request.path.startswith("/v1/messages"):  # where Anthropic's SDK reads it (`_request_id`)
            response.headers["request-id"] = request[REQUEST_ID]
    if request.get(CLOSE_AFTER):  # a stalled or malformed body: answer, then drop the connection
        response.force_close()
        response.headers["Connection"] = "close"  # the hook runs after aiohttp chose the header
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers["Server"] = "selfhosted-chat"  # not aiohttp's and Python's versions
    if is_api_path(request.path):
        add_cors_headers(request, response, request.app[SETTINGS])
    else:
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("Referrer-Policy", "no-referrer")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(request, exc)
    except GatewayError as exc:
        return error_response(request, from_gateway(exc))
    except StoreUnavailable as exc:
        log.error("store_unavailable", path=request.path, error=str(exc))
        return error_response(
            request,
            overloaded("The database cannot be written; try again later.", retry_after_s=30, code="store_unavailable"),
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(request, _from_http_exception(exc, request.path))
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return error_response(request, internal_error())


def _from_http_exception(exc: web.HTTPException, path: str) -> ApiError:
    if exc.status == 413:
        return ApiError(
            413,
            f"The request body is too large ({exc.text}). {BIG_BODY_HINT}",
            "invalid_request_error",
            "request_too_large",
        )
    if exc.status == 404:
        see = "/api/tags and /api/chat" if is_ollama_path(path) else "/v1/models and /v1/chat/completions"
        return ApiError(404, f"Unknown URL. See {see}.", "invalid_request_error", "unknown_url")
    if exc.status == 405:
        return ApiError(
            405,
            f"Method {exc.method if hasattr(exc, 'method') else ''} not allowed here.".replace("  ", " "),
            "invalid_request_error",
            "method_not_allowed",
        )
    return ApiError(exc.status, exc.reason, "invalid_request_error", None)


def error_body_for(path: str, error: ApiError) -> dict:
    """The error envelope the clients of `path` read: Anthropic's on its Messages API, Ollama's on its
    native API, OpenAI's elsewhere (and for "", no path read). The connection guard renders malformed
    HTTP with it too (api/connections.py)."""
    if messages.is_messages_path(path):
        return messages.error_body(error)
    if is_ollama_path(path):
        return ollama.error_body(error)
    return error.body()


def error_response(request: web.Request, error: ApiError) -> web.Response:
    headers = {"X-Request-Id": request.get(REQUEST_ID, ""), **error.headers}
    return web.json_response(error_body_for(request.path, error), status=error.status, headers=headers)


async def _lifecycle(app: web.Application, backend_factory: BackendFactory | None) -> AsyncIterator[None]:
    """Start store, models, queues and the safety gate; stop them in reverse order."""
    settings = app[SETTINGS]
    # Models first: a config error there (a missing folder) must not leave the store's
    # writer thread running, which kept the process alive after "config error".
    models = build_models(settings, backend_factory)
    store, lock = await _open_database(settings)
    started = []
    purge_task = None
    try:
        await _clean_up_after_last_run(store)
        for name, handle in models.items():
            try:
                await handle.backend.start()
            except EngineError as exc:  # e.g. a checkpoint whose tensors do not match its config.json
                raise ConfigError(f"models.{name}: {exc}") from None
            started.append(handle)
        state = await _make_state(settings, store, models)
        app[STATE] = state
        if state.safety is not None:
            await state.safety.start()
        for queue in state.admission.queues.values():
            await queue.start()
        retention = {name: tier.retention_days for name, tier in settings.tiers.items()}
        purge_task = asyncio.create_task(store.run_purge_loop(retention))
        yield
    finally:
        if purge_task is not None:
            purge_task.cancel()
            await asyncio.gather(purge_task, return_exceptions=True)
        if STATE in app:
            app[STATE].draining = True
            for queue in app[STATE].admission.queues.values():
                await queue.stop()
        for handle in reversed(started):
            await handle.backend.shutdown()
        tracing = app[STATE].tracing if STATE in app else None
        if tracing is not None:  # the last spans leave (bounded by its timeout)
            await asyncio.to_thread(tracing.shutdown)
        await store.close()
        lock.release()


async def _open_database(settings: Settings) -> tuple[Store, ServerLock]:
    """Take the one-server lock and open the store. DatabaseInUse when another server holds it;
    CannotStart, in one line, when the file cannot be used (a newer schema, not a database, a
    folder, a read-only or full disk)."""
    path = Path(settings.store.path)
    try:
        check_database_path(path)  # before the lock, whose files would fail there less clearly
    except StoreError as exc:
        raise CannotStart(str(exc)) from None
    lock = ServerLock(path)
    try:
        lock.acquire()  # one server per database: a second one stops here with a clear message
    except OSError as exc:
        raise CannotStart(f"cannot open the database {path}: {exc.strerror or exc} ({exc.filename})") from None
    try:
        return await Store.open(path, settings.store), lock
    except StoreError as exc:
        lock.release()
        raise CannotStart(open_error(path, exc)) from None
    except (OSError, sqlite3.Error) as exc:
        lock.release()
        raise CannotStart(f"cannot open the database {path}: {exc}") from None
    except BaseException:
        lock.release()
        raise


async def _clean_up_after_last_run(store: Store) -> None:
    """What a previous process left unfinished. The first writes of a start: a database that
    cannot take them (disk full) stops the start with one line."""
    try:
        num_orphaned = await store.fail_unfinished_responses(responses_background.RESTART_ERROR)
        num_cut = await store.delete_pending_conversations()
    except StoreError as exc:
        raise CannotStart(f"cannot open the database {store.path} for writing: {exc}") from None
    if num_orphaned:  # one server per database: nothing else can be running them
        log.warning("background_responses_failed_at_start", num_responses=num_orphaned)
    if num_cut:  # a Responses call created them, then the process died before the answer was stored
        log.warning("unanswered_conversations_deleted_at_start", num_conversations=num_cut)


async def _log_ready(app: web.Application) -> None:
    """After every part of the app has started (the lifecycle above, the Files API's folder)."""
    state = app[STATE]
    log.info("server_ready", models=list(state.models), keyless=state.local_principal is not None)


async def _make_state(settings: Settings, store: Store, models) -> AppState:
    metrics = Metrics()
    name, version, commit = build_info()
    Gauge(
        "chat_build_info",
        "Always 1; the labels say which build serves.",
        ("name", "version", "commit"),
        registry=metrics.registry,
    ).labels(name, version, commit or "unknown").set(1)
    admission = build_admission(settings, {name: handle.backend for name, handle in models.items()}, metrics)
    register_upstream_metrics(metrics.registry, {name: handle.backend for name, handle in models.items()})
    local = None
    if keyless_allowed(settings):  # its tier is declared (check_tiers)
        existing = await store.get_org("local")
        if existing is not None and existing.tier != settings.server.local_tier:
            log.warning(
                "local_org_tier_reset",
                tier=existing.tier,
                new_tier=settings.server.local_tier,
                detail="server.local_tier sets the tier of keyless local requests at every start; change it there",
            )
        org = await store.ensure_org("local", settings.server.local_tier)
        from store.types import Principal

        local = Principal(key_id=None, org=org)
    # The encoders (safety gate, embeddings) take the engine's kernel choice: engine.native_kernels = false
    # means PyTorch ops for all of them.
    kernel_isa = settings.engine.kernel_isa if settings.engine.native_kernels else "torch"
    safety = None
    if settings.safety.enabled:
        from gateway.safety import SafetyGate
        from gateway.safety.gate import classifier_threads

        cpu_engine = any(getattr(handle.backend, "runs_on_cpu", False) for handle in models.values())
        threads = classifier_threads(settings.safety.threads, cpu_engine)
        if cpu_engine and settings.safety.threads > 1:
            log.warning(
                "safety_threads_ignored",
                threads=settings.safety.threads,
                detail="a native engine runs on the CPU: the classifier runs on its threads between its steps",
            )
        log.info("safety_classifier_threads", threads=threads, beside_cpu_engine=cpu_engine)
        safety = SafetyGate(settings.safety, registry=metrics.registry, kernel_isa=kernel_isa, threads=threads)
    embedding_service = None
    if settings.embeddings.enabled:
        embedding_service = embeddings.EmbeddingsService(settings.embeddings, kernel_isa)
    tracing = None
    if settings.telemetry.otlp_traces_endpoint:
        from api.telemetry import Tracing

        tracing = Tracing(settings.telemetry)
    return AppState(
        settings=settings,
        models=models,
        store=store,
        admission=admission,
        metrics=metrics,
        safety=safety,
        local_principal=local,
        tracing=tracing,
        embeddings=embedding_service,
    )


async def _on_shutdown(app: web.Application) -> None:
    # Runs when the server stops accepting: /ready turns false and new chats get 503
    # while running streams get the grace period to finish.
    if STATE in app:
        app[STATE].draining = True


def init(settings: Settings, *, backend_factory: BackendFactory | None = None) -> web.Application:
    """The app. `backend_factory`: tests serve the native models with a stand-in through it."""
    check_tiers(settings)  # here, not when the state is made: that is after every model has loaded
    check_startup(settings)
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[
            request_id_middleware,
            error_middleware,
            make_access_middleware(settings),
            make_body_deadline_middleware(settings.server),
        ],
    )
    app[SETTINGS] = settings
    app[INFLIGHT] = InFlight()
    app.cleanup_ctx.append(functools.partial(_lifecycle, backend_factory=backend_factory))
    files.setup(app)  # after _lifecycle: its context needs the store
    app.on_startup.append(_log_ready)  # after every cleanup_ctx has started
    app.on_shutdown.append(_on_shutdown)
    app.on_response_prepare.append(_stamp_headers)
    resources.add_routes(app, chat.chat_completions)
    admin.add_routes(app)
    responses.add_routes(app)
    completions.add_routes(app)
    messages.add_routes(app)
    embeddings.add_routes(app)
    moderations.add_routes(app)
    ollama.add_routes(app)
    ollama_embed.add_routes(app)
    ollama_models.add_routes(app)
    return app
