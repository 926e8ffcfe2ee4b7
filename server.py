"""Entry point: `python server.py` serves; `python server.py keys|orgs ...` manages access;
`python server.py feedback export` writes what users said about answers as JSON lines;
`python server.py backup --out FILE` copies the database safely while the server runs.

Parses the command line, loads `config.toml` (plus `--set` overrides and the `--host`,
`--port`, `--db`, `--model` shortcuts), configures logging and runs the aiohttp app on
uvloop with graceful shutdown. Guarded by `__main__` so backends that spawn worker
processes (TensorRT-LLM's MPI workers) can import it safely.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "config.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="server.py",
        description="A self-hosted ChatGPT in one process. With no command, serve.",
    )
    from api.startup import version_text

    parser.add_argument("--version", action="version", version=version_text(), help="print the version and exit")
    _add_serve_flags(parser, is_subcommand=False)
    sub = parser.add_subparsers(dest="command")
    serve_parser = sub.add_parser(
        "serve",
        help="run the server (the default)",
        description="Run the server. These flags may also come before `serve`, or without it.",
    )
    _add_serve_flags(serve_parser, is_subcommand=True)
    from store.cli import add_cli

    add_cli(sub)
    gguf = sub.add_parser(
        "import-gguf",
        help="turn a GGUF file (llama.cpp's, Ollama's) into a model folder this server serves",
        description="Write a model folder in Hugging Face layout from a GGUF file: its config, tokenizer and chat "
        "template, and its tensors dequantized to safetensors (engine/gguf_import.py). Then serve it with "
        "--model FOLDER.",
    )
    gguf.add_argument("gguf_file", type=Path, metavar="FILE", help="the .gguf file (or an Ollama blob)")
    gguf.add_argument("--out", type=Path, required=True, metavar="FOLDER", help="the folder to write (new or empty)")
    gguf.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="auto",
        help="the weights' dtype (auto: the file's own F32/F16/BF16, bfloat16 for a quantized file)",
    )
    return parser


_PATH_FLAGS = ("config", "serve_db", "db", "model", "out", "gguf_file")  # dests of the flags that name a file or folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `--set` given before and after `serve` merged (later ones win)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    after_serve = vars(args).pop("serve_overrides", [])
    args.overrides = [*args.overrides, *after_serve]
    for name in _PATH_FLAGS:  # `--db=~/x` reaches us with its ~: the shell expands only `--db ~/x`
        value = getattr(args, name, None)
        if isinstance(value, (str, Path)) and str(value).startswith("~"):
            try:
                setattr(args, name, type(value)(Path(value).expanduser()))
            except RuntimeError as exc:  # ~nosuchuser
                parser.error(f"cannot expand ~ in {value}: {exc}")
    return args


def _add_serve_flags(parser: argparse.ArgumentParser, *, is_subcommand: bool) -> None:
    """The serving flags, on the top-level parser and on `serve`. On `serve` they have no defaults
    (SUPPRESS): argparse copies a subcommand's defaults over what was parsed before it, so
    `--port 8000 serve` would lose the port. `--set` after `serve` goes to its own list, which
    `parse_args` appends to the one before it."""
    default = argparse.SUPPRESS if is_subcommand else None
    parser.add_argument(
        "--config",
        type=Path,
        default=default if is_subcommand else DEFAULT_CONFIG,
        metavar="FILE",
        help="config file (default: config.toml)",
    )
    parser.add_argument(
        "--set",
        dest="serve_overrides" if is_subcommand else "overrides",
        action="append",
        default=default if is_subcommand else [],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set engine.max_num_seqs=32 (repeatable)",
    )
    parser.add_argument("--host", default=default, help="interface to bind (server.host)")
    parser.add_argument(
        "--port", type=int, default=default, help="TCP port (server.port); 0: any free port (the ready line names it)"
    )
    parser.add_argument(
        "--db", dest="serve_db", default=default, metavar="FILE", help="SQLite database file (store.path)"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=default,
        metavar="DIR",
        help="serve this local model folder as the only model, for every tier, named by the folder (the settings of "
        "[models.NAME] for that name, in the config file or --set models.NAME.KEY=VALUE, apply to it)",
    )


def apply_cli(settings, args: argparse.Namespace):
    """Fold the shortcut flags into the settings (they win over the file and --set); ConfigError
    for a value the setting does not allow (`--port 70000`)."""
    from settings import ModelConfig, validate

    server = settings.server
    if args.host is not None:
        server = dataclasses.replace(server, host=args.host)
    if args.port is not None:
        server = dataclasses.replace(server, port=args.port)
    store = settings.store
    db = getattr(args, "db", None) or args.serve_db
    if db is not None:
        store = dataclasses.replace(store, path=db)
    models, tiers = settings.models, settings.tiers
    if args.model is not None:
        name = model_name(args.model)
        _check_model_overrides(args.overrides, name)
        # The file's and --set's [models.<name>] settings of the served name apply; the other models
        # are not served, so there is nothing to fall back to.
        served = settings.models.get(name, ModelConfig())
        models = {name: dataclasses.replace(served, path=str(args.model), fallback="")}
        tiers = {t: dataclasses.replace(cfg, models=[name]) for t, cfg in settings.tiers.items()}
    return validate(dataclasses.replace(settings, server=server, store=store, models=models, tiers=tiers))


def _check_model_overrides(overrides: list[str], name: str) -> None:
    """With --model, a `--set models.<other>...` would be dropped with the model it names, and
    --model gives the path and leaves no fallback: ConfigError for those, naming what --model serves."""
    from settings import ConfigError

    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        if parts[0] != "models" or len(parts) < 2:
            continue
        if parts[1] != name:
            raise ConfigError(
                f"--set {item}: --model serves one model, named {name!r} (its folder's name); set "
                f"models.{name}.<key>, or declare the models in a config file instead of --model"
            )
        if len(parts) > 2 and parts[2] in ("path", "fallback"):
            raise ConfigError(f"--set {item}: with --model, the model's path is --model's and it has no fallback")


def model_name(folder: Path) -> str:
    """The name --model serves a folder as: the folder's own name, a symlink's rather than its
    target's, and for a Hugging Face cache snapshot (models--Qwen--Qwen3-0.6B/snapshots/<commit>)
    the repo's name rather than the commit's."""
    path = Path(os.path.abspath(folder))  # ".." resolved, symlinks not
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


def serve(settings, backend_factory=None) -> None:
    """Check the model folders, bind the port, then serve; the ready block is printed once
    everything has started. Raises ConfigError or PortInUse before anything is opened,
    DatabaseInUse when another server holds the database, CannotStart when it cannot be used."""
    import uvloop
    from aiohttp import web

    from api.app import init
    from api.runner import run
    from api.security import is_loopback, keyless_allowed
    from api.startup import (
        bind_listening_socket,
        check_model_folders,
        check_web_ui,
        freeze_startup_heap,
        ready_text,
        warn_if_prefix_cache_unwritable,
    )

    check_model_folders(settings)
    check_web_ui(settings)
    warn_if_prefix_cache_unwritable(settings)
    sock = bind_listening_socket(settings.server.host, settings.server.port, Path(settings.store.path))
    bound_port = sock.getsockname()[1]  # port 0: the one the kernel chose, for the ready line and logs
    settings = dataclasses.replace(settings, server=dataclasses.replace(settings.server, port=bound_port))
    if not is_loopback(settings.server.host) and settings.server.allow_public_without_keys:
        import structlog

        structlog.get_logger("server").warning("serving_without_keys_on_public_interface", host=settings.server.host)
    app = init(settings, backend_factory=backend_factory)

    async def say_ready(_app: web.Application) -> None:  # runs after the app's own startup
        freeze_startup_heap()  # no collector pauses of ~100 ms under load
        sys.stdout.write(ready_text(settings, is_keyless=keyless_allowed(settings)))
        sys.stdout.flush()

    app.on_startup.append(say_ready)
    uvloop.run(run(app, settings, sock))


def _import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf_import import GGUFImportError, import_gguf

    try:
        done = import_gguf(args.gguf_file, args.out, args.dtype)
    except GGUFImportError as exc:
        sys.stderr.write(f"cannot import: {exc}\n")
        return 1
    sys.stdout.write(
        f"wrote {done.out_dir} ({done.model_type}, {done.num_tensors} tensors in {done.dtype}, {done.seconds:.0f} s)\n"
        f"serve it: .venv/bin/python server.py --model {done.out_dir}\n"
    )
    return 0


def main(argv: list[str] | None = None, *, backend_factory=None) -> int:
    """0 after a clean shutdown; 1 when the server cannot start (the message says why).
    `backend_factory`: testing/fake_server.py serves the native models with a stand-in."""
    from api.logs import configure_logging
    from api.startup import CannotStart, PortInUse
    from settings import ConfigError, load_settings

    args = parse_args(argv)
    if args.command == "import-gguf":  # needs no settings: a file in, a folder out
        return _import_gguf(args)
    try:
        settings = apply_cli(load_settings(args.config, args.overrides), args)
    except ConfigError as exc:
        sys.stderr.write(f"config error: {exc}\n")
        return 1
    if args.command in ("keys", "orgs", "feedback", "backup"):
        from store.cli import run_cli

        # An admin command says what it did; the store's info lines (opened, migrated) are noise there.
        configure_logging("warning", json_lines=settings.server.log_json)
        return asyncio.run(run_cli(args, settings))
    configure_logging(settings.server.log_level, json_lines=settings.server.log_json)
    if args.model is not None:
        from api.startup import model_folder_problem

        # Before check_model_folders, whose message is about paths in a config file.
        if (problem := model_folder_problem(args.model, typed=str(args.model))) is not None:
            sys.stderr.write(f"config error: --model: {problem}\n")
            return 1
    from store.lock import DatabaseInUse

    try:
        serve(settings, backend_factory)
    except ConfigError as exc:
        sys.stderr.write(f"config error: {exc}\n")
        return 1
    except PortInUse as exc:
        sys.stderr.write(f"cannot start: {exc}\n")
        return 1
    except DatabaseInUse as exc:
        sys.stderr.write(f"cannot start: {exc}\n")
        return 1
    except CannotStart as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    try:
        exit_code = main()
    except BaseException as exc:  # a bug: its traceback, then exit, whatever threads are still running
        if isinstance(exc, SystemExit):  # argparse's --help, --version and usage errors
            exit_code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        elif isinstance(exc, KeyboardInterrupt):  # Ctrl-C before the server was up
            exit_code = 130
        else:
            import traceback

            traceback.print_exc()
            exit_code = 1
    # Everything is closed by now (store, lock, backends): skip the interpreter's teardown, which
    # spends seconds garbage-collecting torch's modules, so SIGTERM exits within the grace.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
