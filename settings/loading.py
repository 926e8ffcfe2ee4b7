"""Loading: the `Settings` of all sections, `load_settings` (config.toml read with tomllib, ~
expanded and relative paths resolved, `--set section.key=value` overrides applied, unknown keys
and wrong types rejected naming the key), `validate`, and `settings_help` for the docs. Declares
no setting.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from settings.backends import EngineConfig, ModelConfig, TrtllmConfig, UpstreamConfig
from settings.features import (
    DEFAULT_STORE_PATH,
    EmbeddingsConfig,
    FilesConfig,
    ImagesConfig,
    ModerationsConfig,
    SafetyConfig,
    SharingConfig,
    StoreConfig,
    TelemetryConfig,
)
from settings.fields import ConfigError
from settings.serving import QueueConfig, ServerConfig, TierConfig


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    files: FilesConfig = field(default_factory=FilesConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    moderations: ModerationsConfig = field(default_factory=ModerationsConfig)
    trtllm: TrtllmConfig = field(default_factory=TrtllmConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    tiers: dict[str, TierConfig] = field(default_factory=dict)


# Sections whose keys are user-chosen names (e.g. [models.demo-mini]), each of one type.
_NAMED_SECTIONS: dict[str, type] = {"models": ModelConfig, "tiers": TierConfig}


def load_settings(path: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """Parse the config file (if any), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
        _expand_home(raw)  # "~/chat.db" is the home folder's, not a folder named ~ beside the file
        _resolve_paths(raw, Path(path).resolve().parent)
    for item in overrides:
        _apply_override(raw, item)
    _expand_home(raw)  # the --set values
    return validate(_build(Settings, raw, ""))


def _read_toml(path: Path) -> dict[str, Any]:
    """The config file's tables; ConfigError, one line, for a file that cannot be read as TOML."""
    try:
        # utf-8-sig: Windows editors (Notepad) save UTF-8 with a byte order mark, which TOML forbids
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def validate(settings: Settings) -> Settings:
    """`settings` when every value is one its setting allows (`setting(minimum=..., choices=...)`),
    else a ConfigError naming the first that is not. Run at load, and again by server.py after the
    --host/--port/--db flags are folded in."""
    _check_allowed(settings, "")
    _check_host(settings.server.host)
    _check_public_base_url(settings.sharing.public_base_url)
    return settings


def _check_host(host: str) -> None:
    """server.host is one address or name, as the socket takes it. Empty listened on every
    interface while the ready line said "http://:8000"; "[::1]" and "127.0.0.1:9000" ended in
    "Name or service not known"."""
    if not host:
        raise ConfigError(
            "server.host must not be empty: give 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        )
    has_port = host.count(":") == 1  # an IPv6 address has two colons or more
    if has_port or any(c in host for c in "[]/") or any(c.isspace() for c in host):
        raise ConfigError(
            f"server.host must be an address or host name alone (127.0.0.1, ::1, 0.0.0.0, localhost): without "
            f"brackets, scheme or port (the port is server.port, --port); got {host!r}"
        )


def _check_public_base_url(url: str) -> None:
    """sharing.public_base_url is empty or an origin alone: links are its /share/<token>, and the page
    reads /static/ and /v1/ from its root, so a path there would name pages that are not served."""
    if not url:
        return
    parts = urlsplit(url)
    try:
        is_port_ok = not parts.netloc.endswith(":") and parts.port != 0
    except ValueError:  # a port that is no number, or past 65535
        is_port_ok = False
    is_origin = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/")
    has_extra = bool(parts.query or parts.fragment) or "@" in parts.netloc or any(c.isspace() for c in url)
    if not (is_origin and is_port_ok) or has_extra:
        raise ConfigError(
            f'sharing.public_base_url must be empty or an origin alone, such as "https://chat.example.com" or '
            f'"http://10.0.0.5:8000" (a scheme, a name and a port; no path, user or query); got {url!r}'
        )


def _check_allowed(obj: Any, where: str) -> None:
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), _join(where, f.name)
        if dataclasses.is_dataclass(value):
            _check_allowed(value, key)
        elif where == "" and f.name in _NAMED_SECTIONS:
            for name, item in value.items():
                _check_allowed(item, _join(key, name))
        elif (allowed := f.metadata.get("allowed")) is not None:
            if isinstance(value, dict):
                items = [(_join(key, k), v) for k, v in value.items()]
            else:
                items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            for item_key, item in items:
                if (problem := allowed.problem(item)) is not None:
                    raise ConfigError(f"{item_key} {problem}")


# Settings that name files or folders: (section, key, default, shipped). Relative values in a
# config file are relative to that file's folder, so the server finds its files from any
# working directory; so are the defaults of the user's data (the database), while the defaults
# of what ships with the server (the web UI, the safety classifier) stay in the project's
# folder, wherever the config file is (and so does a relative value of theirs, or a model
# folder's, that exists only there: the bundled demo models of a copied config.toml). --set and
# --db/--model values stay relative to the working directory, as shell arguments are. A leading
# ~ is the home folder in every path setting (a shell expands it in `--db ~/x` but not in
# `--db=~/x`, `--set` or a config file; left as it was, it made a folder named ~ in the working
# directory).
_PATH_SETTINGS = (
    ("server", "static_dir", "static", True),
    ("server", "tls_cert_file", "", False),
    ("server", "tls_key_file", "", False),
    ("store", "path", DEFAULT_STORE_PATH, False),
    ("files", "dir", "", False),
    ("engine", "prefix_cache_dir", "auto", False),
    ("safety", "classifier_path", "safety/classifier.npz", True),
)
_NOT_PATHS = ("auto",)  # words a path setting takes instead of a path (engine.prefix_cache_dir = "auto")
_MODEL_PATHS = ("path", "tokenizer")  # a model's folder, or a relayed model's tokenizer folder
PROJECT_DIR = Path(__file__).resolve().parents[1]  # the repository root, above this package


def _home(value: Any, key: str) -> Any:
    """`value` with a leading ~ (or ~user) made the home folder; anything else as it is."""
    if not isinstance(value, str) or not value.startswith("~"):
        return value
    try:
        return str(Path(value).expanduser())
    except RuntimeError as exc:  # ~nosuchuser, or no home folder known
        raise ConfigError(f"{key}: cannot expand ~ in {value!r}: {exc}") from None


def _expand_home(raw: dict[str, Any]) -> None:
    for section, key, _, _ in _PATH_SETTINGS:
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            node[key] = _home(node[key], _join(section, key))
    models = raw.get("models")
    for name, model in models.items() if isinstance(models, dict) else ():
        for key in _MODEL_PATHS:
            if isinstance(model, dict) and key in model:
                model[key] = _home(model[key], f"models.{name}.{key}")


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    for section, key, default, shipped in _PATH_SETTINGS:
        node = raw.setdefault(section, {})
        if not isinstance(node, dict):
            continue
        value = node.get(key, default)
        if key not in node:
            node[key] = _resolve(value, PROJECT_DIR if shipped else base)
        else:
            node[key] = _resolve_or_shipped(value, base) if shipped else _resolve(value, base)
    models = raw.get("models")
    for model in models.values() if isinstance(models, dict) else ():  # not a table: _build names it
        for key in _MODEL_PATHS:
            if isinstance(model, dict) and key in model:
                model[key] = _resolve_or_shipped(model[key], base)


def _resolve_or_shipped(value: Any, base: Path) -> Any:
    """`value` under base, unless it exists only in the project: a copy of config.toml moved out of
    the project names what ships with the server relative to the project ("static",
    "models/demo-flagship"), found there rather than missing beside the copy."""
    resolved = _resolve(value, base)
    if isinstance(resolved, str) and not Path(resolved).exists() and Path(_resolve(value, PROJECT_DIR)).exists():
        return _resolve(value, PROJECT_DIR)
    return resolved


def _resolve(value: Any, base: Path) -> Any:
    """Relative non-empty paths become absolute under base; anything else is left as it is
    (wrong types are reported by _build, naming the key)."""
    if not isinstance(value, str) or not value or value in _NOT_PATHS or value.startswith(":"):  # ":memory:"
        return value
    return value if Path(value).is_absolute() else str(base / value)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:  # a TOML value (number, bool, quoted string, list); bare words are strings
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {_join(where, unknown[0])!r}")
    kwargs = {}
    for name, value in raw.items():
        key = _join(where, name)
        hint = hints[name]
        if where == "" and name in _NAMED_SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table of named sections")
            item_cls = _NAMED_SECTIONS[name]
            kwargs[name] = {k: _build(item_cls, v, _join(key, k)) for k, v in value.items()}
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        else:
            kwargs[name] = _coerce(hint, value, key)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(args[0], value, key)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return {k: _coerce(item, v, _join(key, k)) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def settings_help() -> list[tuple[str, Any, str]]:
    """(key, default, help) for every declared setting; used by docs and a test."""
    rows: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                walk(hint, _join(prefix, f.name))
            elif prefix == "" and f.name in _NAMED_SECTIONS:
                walk(_NAMED_SECTIONS[f.name], f"{f.name}.<name>")
            else:
                factory = f.default_factory  # MISSING (not callable) unless the field has one
                default = factory() if callable(factory) else f.default
                rows.append((_join(prefix, f.name), default, f.metadata.get("help", "")))

    walk(Settings, "")
    return rows
