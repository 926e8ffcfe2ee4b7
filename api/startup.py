"""What `server.py` checks and says before serving: model folders exist, the port is free
(bound here, before anything loads, so "ready" is never followed by a bind error), and the
short block a newcomer reads once the server is up: the URL to open, the models, their tiers.
"""

from __future__ import annotations

import errno
import gc
import socket
from pathlib import Path

from settings import ConfigError, Settings

_PATHLESS_BACKENDS = ("openai",)  # served from another server: no local folder


def check_model_folders(settings: Settings) -> None:
    """A ConfigError naming the model and the folder looked for, before anything starts."""
    for name, model in settings.models.items():
        if model.backend in _PATHLESS_BACKENDS:
            continue
        if not model.path or not Path(model.path).is_dir():
            shown = Path(model.path).resolve() if model.path else "(empty)"
            raise ConfigError(
                f"models.{name}.path: the folder {shown} does not exist (relative paths in a "
                "config file are relative to that file's folder)"
            )


class PortInUse(Exception):
    """The address is taken; the message says which and what to do."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now so a busy port is reported before loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does on Unix
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"port {port} on {host} is already in use, probably by another server.py. Stop that "
                f"one (Ctrl-C in its terminal), or start this one on another port: .venv/bin/python server.py "
                f"--port {port + 1}"
            ) from None
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def freeze_startup_heap() -> int:
    """Move every object alive now into the garbage collector's permanent generation; returns
    how many. Called once the server has loaded everything (modules, models, tokenizers, the
    safety gate), which lives as long as the process: a full collection under load then scans
    only what requests allocate. Unfrozen, each one walks some 200,000 startup objects (about
    100 ms on a 2-core AMD EPYC) and stalls every stream: refusals took 115-193 ms at p99 in the
    `make load` arrivals shape against 13-19 ms frozen (bench/RESULTS.md, #15)."""
    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()


def ready_text(settings: Settings, *, is_keyless: bool) -> str:
    """The block printed once the server answers: URL, models with their tiers, access."""
    host = settings.server.host
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    if ":" in shown_host:
        shown_host = f"[{shown_host}]"
    scheme = "https" if settings.server.tls_cert_file else "http"
    url = f"{scheme}://{shown_host}:{settings.server.port}"
    lines = [f"Ready. Open {url} in a browser (OpenAI-compatible API: {url}/v1)."]
    for name in settings.models:
        tiers = [tier for tier, cfg in settings.tiers.items() if name in cfg.models]
        lines.append(f"  model {name}: tiers {', '.join(tiers) if tiers else '(none: not served)'}")
    if is_keyless:
        lines.append(f"No API key needed from this machine (tier {settings.server.local_tier}). Ctrl-C stops.")
    else:
        lines.append("API keys required: .venv/bin/python server.py keys create --org NAME --tier free. Ctrl-C stops.")
    return "\n".join(lines) + "\n"
