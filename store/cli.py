"""`server.py keys|orgs ...`: manage organisations and API keys offline; `feedback export`;
`backup`: copy the database while the server runs.

Each command opens the store, does one thing and closes it; it is safe while the server runs
(WAL, one short write transaction). A key's secret is printed once, at creation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from settings import Settings, merge_org_limits
from store.feedback import Feedback
from store.keys import (
    MAX_BUDGET_USD,
    MAX_EXPIRES_IN_DAYS,
    MIN_PREFIX_MATCH_CHARS,
    SECRET_PREFIX,
    key_name_problem,
    org_name_problem,
)
from store.money import format_usd
from store.store import UNSET, Store, check_database_path, open_error
from store.types import INFERENCE_SCOPE, KEY_SCOPES, Conflict, NotFound, StoreError


def add_cli(subparsers: Any) -> None:
    """Add the `keys`, `orgs`, `feedback` and `backup` commands to the server's argparse subparsers."""
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    keys.set_defaults(store_cli="keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = _with_db(keys_sub.add_parser("create", help="create a key (and its organisation if missing)"))
    create.add_argument("--org", required=True, type=_org_name, help="organisation name")
    create.add_argument(
        "--tier",
        help="tier of a new organisation; for an existing one it must equal that organisation's tier"
        " (change it with `orgs set`)",
    )
    create.add_argument(
        "--budget",
        type=_budget,
        default=UNSET,
        help="monthly budget in USD of a new organisation, or 'none'; for an existing one it must equal"
        " that organisation's budget (change it with `orgs set`)",
    )
    create.add_argument("--name", type=_key_name, help="a label for the key")
    create.add_argument(
        "--expires-in-days",
        type=_expires_in_days,
        help=f"the key stops working after this many days (more than 0, at most {MAX_EXPIRES_IN_DAYS:g})",
    )
    create.add_argument(
        "--scope",
        choices=KEY_SCOPES,
        default=INFERENCE_SCOPE,
        help="inference (default): the API; admin: only /v1/admin/ (organisations, keys, every organisation's usage)",
    )
    listing = _with_db(keys_sub.add_parser("list", help="list keys (prefix and last 4 only)"))
    listing.add_argument("--org", help="only this organisation's keys")
    revoke = _with_db(keys_sub.add_parser("revoke", help="revoke a key by its prefix (sk-...) or id (key_...)"))
    revoke.add_argument(
        "key",
        metavar="PREFIX_OR_ID",
        help=f"the prefix `keys list` shows, or its first {MIN_PREFIX_MATCH_CHARS} or more characters if only one"
        " active key starts with them; or the key's id (key_...)",
    )

    orgs = subparsers.add_parser("orgs", help="create, list and change organisations")
    orgs.set_defaults(store_cli="orgs")
    orgs_sub = orgs.add_subparsers(dest="orgs_command", required=True)
    _with_db(orgs_sub.add_parser("list", help="list organisations"))
    org_create = _with_db(orgs_sub.add_parser("create", help="create an organisation"))
    org_create.add_argument("name", type=_org_name)
    org_create.add_argument("--tier", required=True)
    org_create.add_argument("--budget", type=_budget, default=None, help="monthly budget in USD")
    feedback = subparsers.add_parser("feedback", help="export what users said about answers")
    feedback.set_defaults(store_cli="feedback")
    feedback_sub = feedback.add_subparsers(dest="feedback_command", required=True)
    export = _with_db(
        feedback_sub.add_parser(
            "export", help="one JSON line per rated, regenerated or edited answer: prompt, answer, model, rating, edit"
        )
    )
    export.add_argument("--org", help="only this organisation's feedback")
    export.add_argument("--out", type=Path, help="write to this file (default: standard output)")
    backup = _with_db(
        subparsers.add_parser(
            "backup",
            help="copy the database to a file, safely while the server runs (SQLite's online backup)",
            description="Copy the database, consistent as of one moment, while a server may be writing it "
            "(plain cp of a running server's database misses what is still in its -wal file). Says where "
            "the uploaded files and the prefix cache are, which live outside the database. See docs/operations.md.",
        )
    )
    backup.set_defaults(store_cli="backup")
    backup.add_argument("--out", type=Path, required=True, help="the backup file to write (must not exist)")
    org_set = _with_db(orgs_sub.add_parser("set", help="change an organisation's tier, budget or limits"))
    org_set.add_argument("name")
    org_set.add_argument("--tier")
    org_set.add_argument("--budget", type=_budget, default=UNSET, help="monthly budget in USD, or 'none'")
    org_set.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a tier limit, e.g. requests_per_minute=100; KEY=none removes it",
    )


async def run_cli(args: argparse.Namespace, settings: Settings) -> int:
    """Run the parsed `keys`/`orgs`/`feedback`/`backup` command; returns the process exit code."""
    try:
        code = await _run(args, settings)
        sys.stdout.flush()  # here, so that a closed pipe is caught below rather than at exit
    except BrokenPipeError:
        # The reader left (`keys list | head -2`): stop quietly. Python's docs ("Note on SIGPIPE"):
        # point stdout at /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    path, is_new = _database_path(args, settings)
    problem = _problem_before_open(args, path, settings)
    if problem is not None:
        return _fail(problem)
    if args.store_cli == "backup":
        return _backup(path, args.out, settings)
    try:
        store = await Store.open(path, settings.store)
    except StoreError as exc:
        return _fail(open_error(path, exc))
    try:
        code = await _run_command(store, args, settings)
    finally:
        await store.close()
    if is_new and code == 0:
        made = "key" if args.store_cli == "keys" else "organisation"
        sys.stderr.write(
            f"note: created a new database at {path}; a server started with --db/--config elsewhere"
            f" will not see this {made}\n"
        )
    return code


async def _run_command(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    try:
        if args.store_cli == "keys":
            return await _KEY_COMMANDS[args.keys_command](store, args, settings)
        if args.store_cli == "feedback":
            return await _feedback_export(store, args, settings)
        return await _ORG_COMMANDS[args.orgs_command](store, args, settings)
    except (NotFound, Conflict, ValueError) as exc:
        return _fail(str(exc))
    except StoreError as exc:
        return _fail(f"the database {store.path} could not be changed: {exc}")


async def _keys_create(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    org = await store.get_org(args.org)
    if org is None:
        if args.tier is None:
            return _fail(f"organisation {args.org!r} does not exist in {store.path}; give --tier to create it")
        budget = None if args.budget is UNSET else args.budget
        org = await store.create_org(args.org, args.tier, budget_usd=budget)
        _out(f"created organisation {org.name} (tier {org.tier}, budget {_money(org.budget_usd)}) in {store.path}")
    elif (args.tier is not None and args.tier != org.tier) or (args.budget not in (UNSET, org.budget_usd)):
        return _fail(
            f"organisation {org.name!r} exists with tier {org.tier}, budget {_money(org.budget_usd)};"
            " change it with `orgs set`"
        )
    expires_at = None if args.expires_in_days is None else time.time() + args.expires_in_days * 86400.0
    key, secret = await store.create_key(org.name, name=args.name, expires_at=expires_at, scope=args.scope)
    _out(f"created {key.scope} key {key.display} ({key.id}) for {org.name} in {store.path}\n")
    _out("secret (shown once, store it now):\n")
    _out(f"{secret}\n")
    return 0


async def _keys_list(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    org_names = {o.id: o.name for o in await store.list_orgs()}
    keys = await store.list_keys(args.org)  # NotFound for an unknown --org, before the header
    _out(_KEY_ROW.format("PREFIX", "LAST4", "ORGANISATION", "SCOPE", "STATE", "CREATED", "LAST USED", "NAME"))
    for key in keys:
        state = f"revoked {_time(key.revoked_at)}" if key.is_revoked else "active"
        if not key.is_revoked and key.expires_at is not None:
            state = f"{'expired' if key.is_expired(time.time()) else 'expires'} {_time(key.expires_at)}"
        org_name = org_names.get(key.org_id, key.org_id)
        created, last_used = _time(key.created_at), _time(key.last_used_at)
        _out(
            _KEY_ROW.format(
                key.prefix, f"...{key.last4}", org_name, key.scope, state, created, last_used, key.name or "-"
            )
        )
    return 0


async def _keys_revoke(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    ident = args.key
    if ident.startswith(SECRET_PREFIX) and len(ident) < MIN_PREFIX_MATCH_CHARS:
        return _fail(f"{ident!r} is too short: give at least {MIN_PREFIX_MATCH_CHARS} characters of a key's prefix")
    found = await store.find_keys(ident)
    live = [k for k in found if not k.is_revoked]
    if len(live) > 1:
        prefixes = ", ".join(k.prefix for k in live)
        return _fail(f"{ident!r} matches {len(live)} active keys ({prefixes}); give more of the prefix")
    if not live:
        revoked = f"; already revoked: {', '.join(k.prefix for k in found)}" if found else " (see `keys list`)"
        return _fail(f"no active key with prefix or id {ident!r}{revoked}")
    key = live[0]
    if not await store.revoke_key(key.id):  # another process revoked it since the lookup
        return _fail(f"key {key.prefix} is already revoked")
    _out(f"revoked {key.display} ({key.id}) in {store.path}\n")
    return 0


async def _orgs_list(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    for org in await store.list_orgs():
        _out(f"{org.name:<20} tier {org.tier:<12} budget {_money(org.budget_usd):<12} limits {_limits(org.limits)}\n")
    return 0


async def _orgs_create(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    org = await store.create_org(args.name, args.tier, budget_usd=args.budget)
    _out(f"created organisation {org.name} (tier {org.tier}, budget {_money(org.budget_usd)}) in {store.path}\n")
    return 0


async def _orgs_set(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    org = await store.get_org(args.name)
    if org is None:
        return _fail(f"no organisation named {args.name!r}")
    limits = _merge_limits(org.limits, args.limit) if args.limit else UNSET
    org = await store.update_org(args.name, tier=args.tier, budget_usd=args.budget, limits=limits)
    _out(
        f"changed {org.name} in {store.path}: tier {org.tier}, budget {_money(org.budget_usd)}, "
        f"limits {_limits(org.limits)}\n"
    )
    return 0


def _limits(limits: dict[str, Any]) -> str:
    """`requests_per_minute=120 tokens_per_minute=5000`, as `--limit` takes them; `-` for none."""
    return " ".join(f"{name}={value}" for name, value in sorted(limits.items())) or "-"


async def _feedback_export(store: Store, args: argparse.Namespace, settings: Settings) -> int:
    org_id = None
    if args.org is not None:
        org = await store.get_org(args.org)
        if org is None:
            return _fail(f"organisation {args.org!r} does not exist")
        org_id = org.id
    lines = [_feedback_line(f) for f in await store.export_feedback(org_id)]
    text = "".join(line + "\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            args.out.write_text(text, encoding="utf-8")
        except OSError as exc:
            return _fail(f"cannot write {args.out}: {exc.strerror or exc}")
        sys.stderr.write(f"wrote {len(lines)} feedback rows to {args.out}\n")
    return 0


def _database_path(args: argparse.Namespace, settings: Settings) -> tuple[Path, bool]:
    """The command's database file, absolute so that the lines naming it leave no doubt, and
    whether it is not there yet."""
    path = Path(os.path.abspath(args.db or settings.store.path))
    return path, not path.exists()


def _problem_before_open(args: argparse.Namespace, path: Path, settings: Settings) -> str | None:
    """What stops the command before the database is opened (and, for a new one, created)."""
    try:
        check_database_path(path)
        if getattr(args, "tier", None) is not None:
            _check_tier(args.tier, settings)
    except (StoreError, ValueError) as exc:
        return str(exc)
    if _is_missing_database(args, path):
        return f"no database at {path}; give the server's --db, or start the server once to create it"
    return None


def _is_missing_database(args: argparse.Namespace, path: Path) -> bool:
    """No file at `path` for a command that reads or changes what is there. Opening it would create
    an empty database (and its folder) only to report nothing in it; the commands that create an
    organisation may start a new one (`keys create` only with --tier: without it there is no
    organisation to give the key to)."""
    command = (args.store_cli, getattr(args, f"{args.store_cli}_command", None))
    creates = command == ("orgs", "create") or (command == ("keys", "create") and args.tier is not None)
    return not creates and not path.is_file()


def _backup(path: Path, out: Path, settings: Settings) -> int:
    out = Path(os.path.abspath(out))
    if out.exists():
        return _fail(f"{out} already exists; remove it or choose another --out")
    try:
        num_bytes = backup_database(path, out)
    except (OSError, sqlite3.Error) as exc:
        return _fail(f"cannot back up {path} to {out}: {exc}")
    _out(f"backed up {path} to {out} ({num_bytes} bytes, integrity checked)")
    # Kept outside the database: their defaults as api/files.py and engine/registry.py resolve them.
    files_dir = Path(settings.files.dir) if settings.files.dir else path.parent / "files"
    cache = settings.engine.prefix_cache_dir
    cache_dir = path.parent / "prefix-cache" if cache == "auto" else Path(cache) if cache else None
    _out("not in the database, copy these too (see docs/operations.md):")
    _out(f"  uploaded files (files.dir): {files_dir}")
    if cache_dir is not None:
        _out(f"  prefix cache (engine.prefix_cache_dir; optional, rebuilt as chats run): {cache_dir}")
    return 0


def backup_database(source: Path, out: Path) -> int:
    """Copy `source` to `out` with SQLite's online backup API and check the copy; returns its size.

    One backup step copies every page inside one read transaction: in WAL mode that is a
    consistent snapshot that a running server's writes neither block nor restart. The copy is
    written beside `out` and renamed, so `out` is either whole or absent."""
    partial = out.with_name(out.name + ".partial")
    src = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)  # never creates or migrates
    try:
        dst = sqlite3.connect(partial)
        try:
            src.backup(dst)
            result = dst.execute("PRAGMA quick_check").fetchone()[0]
            if result != "ok":
                raise sqlite3.DatabaseError(f"the copy fails quick_check: {result}")
        finally:
            dst.close()
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    return out.stat().st_size


def _feedback_line(f: Feedback) -> str:
    row = {
        "prompt": f.prompt,
        "answer": f.answer,
        "model": f.model,
        "rating": f.rating,
        "comment": f.comment,
        "edit": {"regenerated": f.regenerated, "edited_prompt": f.edited_prompt},
        "conversation_id": f.conversation_id,
        "message_id": f.message_id,
        "created_at": f.created_at,
        "updated_at": f.updated_at,
    }
    return json.dumps(row, ensure_ascii=False)


# `keys list`: one key per line, the name last (it may hold spaces) so columns stay countable;
# each width but the organisation's leaves room for the longest value there and a space.
_KEY_ROW = "{:<12} {:<8} {:<20} {:<10} {:<29} {:<21} {:<21} {}"
_KEY_COMMANDS = {"create": _keys_create, "list": _keys_list, "revoke": _keys_revoke}
_ORG_COMMANDS = {"list": _orgs_list, "create": _orgs_create, "set": _orgs_set}


def _with_db(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--db` and `--config` after the command too, as a user adds the ones the server was started with.
    `--config` has no default here (SUPPRESS): one given before the command must not be reset."""
    parser.add_argument("--db", help="database file (default: store.path from the config)")
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="the server's config file (default: config.toml); its store.path is the database",
    )
    return parser


def _budget(text: str) -> float | None:
    if text.strip().lower() in ("none", "off", ""):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_BUDGET_USD:  # inf and nan parse as floats, 1e400 is inf
        raise argparse.ArgumentTypeError(
            f"budget must be a finite number >= 0 and at most {MAX_BUDGET_USD:,.0f} (USD) or 'none', got {text!r}"
        )
    return value


def _expires_in_days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_EXPIRES_IN_DAYS:  # nan fails every comparison
        raise argparse.ArgumentTypeError(
            f"must be a number of days more than 0 and at most {MAX_EXPIRES_IN_DAYS:g}, got {text!r}"
        )
    return value


def _key_name(text: str) -> str:
    problem = key_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _org_name(text: str) -> str:
    problem = org_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _merge_limits(limits: dict[str, Any], items: list[str]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--limit expects KEY=VALUE, got {item!r}")
        changes[key] = None if text.strip().lower() == "none" else text
    return merge_org_limits(limits, changes)


def _check_tier(tier: str, settings: Settings) -> None:
    if settings.tiers and tier not in settings.tiers:
        raise ValueError(f"unknown tier {tier!r}; configured tiers: {', '.join(sorted(settings.tiers))}")


def _money(usd: float | None) -> str:
    return format_usd(usd)


def _time(t: float | None) -> str:
    if t is None:
        return "never"
    try:
        return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):  # stored before MAX_EXPIRES_IN_DAYS was checked
        return "after 9999-12-31" if t > 0 else "before 0001-01-01"


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _fail(message: str) -> int:
    sys.stderr.write(f"error: {message}\n")
    return 1
