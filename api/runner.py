"""Serving the app on a socket: guarded connections, signals, and a shutdown bounded by the grace.

`run(app, settings)` starts the app (store, models, queues), listens with the connection guard
of `api/connections.py`, and on SIGINT/SIGTERM/SIGHUP: stops accepting, lets running answers finish
for `shutdown_grace_s`, cuts the rest with a `server_shutting_down` error event, then stops
the app. The process is gone within the grace plus a few seconds. A second signal during the
drain ends the grace at once (running answers are cut, billed for what they generated, as
when the grace runs out); a third exits the process on the spot, so a Ctrl-C pressed again
and again never leaves a hung process holding the database.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import structlog
from aiohttp import web

from api.app import error_body_for
from api.connections import ConnectionGuard, ConnectionLimits, make_protocol_factory
from api.inflight import INFLIGHT
from api.security import tls_context
from api.state import STATE
from settings import Settings

log = structlog.get_logger(__name__)

CUT_WAIT_S = 3.0  # after the grace: how long cut answers get to send their error event and bill
HANDLER_WAIT_S = 1.0  # then: how long aiohttp waits for any other handler before cancelling it
KEEPALIVE_S = 75.0  # idle keep-alive connections close after this (aiohttp's default)
LINGER_S = 1.0  # after an error answer, how long a body that will not be read is drained
# Each stops the server gracefully. SIGHUP is what a closed terminal or ssh session sends: its
# default action killed the process on the spot (streams cut unbilled, prefix cache not saved).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def run(app: web.Application, settings: Settings, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT, SIGTERM or SIGHUP; `sock`: a listening socket bound already (else host and port)."""
    cfg = settings.server
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=HANDLER_WAIT_S,
        keepalive_timeout=KEEPALIVE_S,
        lingering_time=LINGER_S,
    )
    try:
        await runner.setup()  # starts the app: store, models, queues (cleanup_ctx)
    except BaseException:
        await _stop_what_started(app)
        raise
    try:
        guard = ConnectionGuard(ConnectionLimits.from_config(cfg))
        loop = asyncio.get_running_loop()
        assert runner.server is not None  # made by setup()
        factory = make_protocol_factory(runner.server, guard, error_body_for)
        # HTTPS: a handshake must end within the header deadline (a connection is guarded once it has).
        context = tls_context(settings)
        handshake_s = cfg.header_timeout_s if context is not None else None
        if sock is not None:
            listener = await loop.create_server(
                factory, sock=sock, backlog=cfg.backlog, ssl=context, ssl_handshake_timeout=handshake_s
            )
        else:
            listener = await loop.create_server(
                factory,
                cfg.host,
                cfg.port,
                reuse_address=True,
                backlog=cfg.backlog,
                ssl=context,
                ssl_handshake_timeout=handshake_s,
            )
        sweeper = loop.create_task(guard.sweep_forever(), name="connection-sweeper")
        log.info(
            "listening",
            host=cfg.host,
            port=cfg.port,
            tls=context is not None,
            max_connections=guard.limits.max_connections,
            max_connections_per_client=guard.limits.max_per_client,
        )
        received = await _wait_for_signal(loop)
        log.info("shutting_down", signal=received, grace_s=cfg.shutdown_grace_s)
        hurry = _escalate_on_signals(loop)
        listener.close()
        try:
            await _drain(app, runner, cfg.shutdown_grace_s, hurry)
        finally:
            sweeper.cancel()
    finally:
        await runner.cleanup()  # app shutdown and cleanup: queues, backends, store
    log.info("stopped")


async def _stop_what_started(app: web.Application) -> None:
    """aiohttp runs no cleanup when a startup step fails, so the contexts entered before it (the
    store's writer thread, the models' step threads, the database lock) would keep the process
    alive: exit them now, in reverse order, as a normal stop does."""
    app.on_cleanup.freeze()  # Application.cleanup runs only a frozen list
    try:
        await app.cleanup()
    except Exception:  # the start's own error is what the operator needs; this one goes to the log
        log.exception("cleanup_after_failed_start_failed")


async def _wait_for_signal(loop: asyncio.AbstractEventLoop) -> str:
    received: asyncio.Future[str] = loop.create_future()

    def on_signal(name: str) -> None:
        if not received.done():
            received.set_result(name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        return await received
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _escalate_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """While shutting down: the next SIGINT/SIGTERM/SIGHUP sets the returned event (the grace ends now),
    the one after exits the process at once (the kernel releases the database lock)."""
    hurry = asyncio.Event()

    def on_signal(name: str) -> None:
        if not hurry.is_set():
            log.warning("shutdown_hurried", signal=name, detail="running answers are cut now; again to exit at once")
            hurry.set()
            return
        log.error("shutdown_forced", signal=name)
        os._exit(1)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    return hurry


async def _drain(
    app: web.Application, runner: web.AppRunner, grace_s: float, hurry: asyncio.Event | None = None
) -> None:
    """New chats get 503 and /ready turns false; running ones get the grace (until `hurry` is
    set), then are cut."""
    if STATE in app:
        app[STATE].draining = True
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle keep-alive connections close now, busy ones after their answer
    inflight = app[INFLIGHT]
    hurried = asyncio.ensure_future((hurry or asyncio.Event()).wait())
    empty = asyncio.ensure_future(inflight.wait_empty(grace_s))
    try:
        await asyncio.wait({hurried, empty}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
    if empty.done() and empty.result():
        return
    empty.cancel()
    num_cut = inflight.cut_all()
    log.warning("shutdown_grace_over", num_cut=num_cut, grace_s=grace_s)
    await inflight.wait_empty(CUT_WAIT_S)
