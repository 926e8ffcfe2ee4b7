"""What `server.py` checks and says before serving: model folders exist and are ones it can
serve (not GGUF, not a repo id), tiers name declared models, the port is free
(bound here, before anything loads, so "ready" is never followed by a bind error), and the
short block a newcomer reads once the server is up: the URL to open, the models, their tiers.
"""

from __future__ import annotations

import errno
import gc
import re
import shlex
import socket
import tomllib
from pathlib import Path

import structlog

from engine.gguf_import import is_gguf
from settings import PROJECT_DIR, ConfigError, Settings
from settings.features import DEFAULT_STORE_PATH
from store.lock import ServerLock

log = structlog.get_logger(__name__)

_PATHLESS_BACKENDS = ("openai",)  # served from another server: no local folder


_SERVED_LAYOUT = "a model folder in Hugging Face layout (config.json, tokenizer files, *.safetensors)"
_GGUF_TAIL = (
    "GGUF is not served as it is: turn it into a model folder with `server.py import-gguf FILE --out FOLDER` "
    f"and give that folder, or give {_SERVED_LAYOUT}, such as the model's original release; or serve the GGUF with "
    'llama.cpp\'s llama-server and relay to it (backend = "openai", docs/scale-out.md)'
)
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # one half of a Hugging Face repo id: owner/name


def check_model_folders(settings: Settings) -> None:
    """A ConfigError naming the model and the folder looked for, before anything starts."""
    for name, model in settings.models.items():
        if model.backend in _PATHLESS_BACKENDS:
            continue
        if not model.path:
            raise ConfigError(f"models.{name}.path: empty: give {_SERVED_LAYOUT}")
        problem = model_folder_problem(Path(model.path))
        if problem is not None:
            hint = "" if Path(model.path).exists() else " (relative paths in a config file are relative to its folder)"
            raise ConfigError(f"models.{name}.path: {problem}{hint}")


def model_folder_problem(path: Path, typed: str | None = None) -> str | None:
    """Why `path` is not a model folder this server can serve, in words that say what to give
    instead (a GGUF file, a Hugging Face repo id, a file), or None when it may be one (what is
    inside is checked when the model is built). `typed`: the path as the user wrote it, when known
    (--model); else a missing owner/name under an existing folder is taken for a possible repo id."""
    shown = path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or is_gguf(path):  # an Ollama blob has no suffix
            return f"{shown} is a GGUF file; {_GGUF_TAIL}"
        return f"{shown} is a file, not a folder: give {_SERVED_LAYOUT}"
    if path.is_dir():
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
        gguf_files = sorted(path.glob("*.gguf"))
        if gguf_files and not has_weights:
            return f"{shown} holds GGUF weights only ({gguf_files[0].name}); {_GGUF_TAIL}"
        return None
    repo_id = typed if typed is not None else f"{shown.parent.name}/{shown.name}"
    owner, _, name = repo_id.partition("/")
    if not shown.parent.exists() and _REPO_PART.fullmatch(owner) and _REPO_PART.fullmatch(name):
        return (
            f"the folder {shown} does not exist; if {repo_id} is a Hugging Face repo id: this server downloads "
            f"nothing, so download the model first (hf download {repo_id} --local-dir models/{name}) and give "
            "that folder"
        )
    return f"the folder {shown} does not exist"


def check_tiers(settings: Settings) -> None:
    """A ConfigError for a tier or fallback naming an undeclared model, or a keyless local tier
    not under [tiers]: before any model loads, not after every one has (a typo cost a full load)."""
    from api.security import keyless_allowed
    from gateway.router import check_model_names

    check_model_names(settings.models, settings.tiers)
    if keyless_allowed(settings) and settings.server.local_tier not in settings.tiers:
        raise ConfigError(
            f"server.local_tier: tier {settings.server.local_tier!r} is not declared under [tiers] (a --config "
            "file replaces config.toml whole, tiers included: start from a copy of config.toml)"
        )


def check_web_ui(settings: Settings) -> None:
    """A ConfigError when server.static_dir holds no web UI: else / answers 404 with no word at start."""
    static_dir = settings.server.static_dir
    if static_dir and not (Path(static_dir) / "index.html").is_file():
        raise ConfigError(
            f"server.static_dir: no web UI in {Path(static_dir).resolve()} (index.html missing; relative paths in a "
            'config file are relative to its folder, and "static" is the one shipped with the server)'
        )


class PortInUse(Exception):
    """The address is taken; the message says which and what to do."""


class CannotStart(Exception):
    """Something outside the settings stops the start (the database file, its disk); the message,
    one line, says what and where."""


def warn_if_prefix_cache_unwritable(settings: Settings) -> None:
    """engine.prefix_cache_dir is only written at a clean stop: say at start when it cannot be,
    rather than with a traceback at the stop. Warmth only, so a warning, not an error."""
    from engine.native.prefix_store import folder_problem
    from engine.registry import _prefix_cache_dir  # the one place "auto" is resolved

    directory = _prefix_cache_dir(settings)
    uses_it = settings.engine.enable_prefix_caching and any(m.backend == "native" for m in settings.models.values())
    if directory is None or not uses_it:
        return
    problem = folder_problem(directory)
    if problem is not None:
        log.warning(
            "prefix_cache_dir_not_writable",
            path=str(directory),
            error=problem,
            detail="the prefix cache will not be kept across restarts; set engine.prefix_cache_dir",
        )


def bind_listening_socket(host: str, port: int, db_path: Path | None = None) -> socket.socket:
    """The server's listening socket, bound now so a busy port is reported before loading. When
    the port's holder is probably the server on this database (`db_path`), the message says a
    second server needs its own database too: `--port` alone would stop again at the lock."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does on Unix
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(_port_in_use_text(host, port, db_path)) from None
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def _port_in_use_text(host: str, port: int, db_path: Path | None) -> str:
    holder = None if db_path is None else ServerLock(db_path).holder()
    if holder is None:
        return (
            f"port {port} on {host} is already in use, probably by another server.py. Stop that "
            f"one (Ctrl-C in its terminal), or start this one on another port: .venv/bin/python server.py "
            f"--port {port + 1}"
        )
    return (
        f"port {port} on {host} is already in use, probably by the server.py that holds this one's database "
        f"{db_path} (pid {holder}). Stop that one (Ctrl-C in its terminal), or start this one on another port "
        f"with a database of its own: .venv/bin/python server.py --port {port + 1} --db PATH"
    )


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def build_info() -> tuple[str, str, str | None]:
    """(name, version) from pyproject.toml, and the commit when this runs from a git clone (read
    from .git, without running git); None otherwise (an unpacked release)."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project["name"], project["version"], _git_commit(PROJECT_ROOT / ".git")


def version_text() -> str:
    """`selfhosted-chat 0.1.0 (commit 1a2b3c4d5e6f)`, for `server.py --version`."""
    name, version, commit = build_info()
    return f"{name} {version}" + (f" (commit {commit[:12]})" if commit else "")


def _git_commit(git_dir: Path) -> str | None:
    try:
        head = (git_dir / "HEAD").read_text(encoding="ascii").strip()
        if not head.startswith("ref: "):
            return head or None  # a detached HEAD holds the commit itself
        ref = head.removeprefix("ref: ")
        if (git_dir / ref).is_file():
            return (git_dir / ref).read_text(encoding="ascii").strip() or None
        for line in (git_dir / "packed-refs").read_text(encoding="ascii").splitlines():
            commit, _, name = line.partition(" ")
            if name == ref:
                return commit
    except OSError:
        pass
    return None


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
        lines.append(
            f"No API key needed from this machine (tier {settings.server.local_tier}; a client that must send one"
            " can send EMPTY). Ctrl-C stops."
        )
    else:
        # The command as it must run for this server: `keys` without --db writes the default database.
        db = Path(settings.store.path).resolve()
        db_flag = "" if db == (PROJECT_DIR / DEFAULT_STORE_PATH).resolve() else f" --db {shlex.quote(str(db))}"
        lines.append(
            f"API keys required: .venv/bin/python server.py keys create{db_flag} --org NAME --tier free. Ctrl-C stops."
        )
    return "\n".join(lines) + "\n"
