"""The admin command line: `keys revoke` by a short prefix, the `keys list` table, the help
texts, and server.py's parsing (`serve` flags before or after the word, quiet store logs)."""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import server
from settings import Settings, TierConfig
from store.cli import add_cli, run_cli
from store.store import Store

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = Settings(tiers={"plus": TierConfig()})


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _set_prefix(db_path: Path, key_id: str, prefix: str) -> None:
    """Give a key a chosen prefix: real ones are random, these tests need collisions."""
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE api_keys SET prefix = ? WHERE id = ?", (prefix, key_id))


async def _revoke(db_path: Path, ident: str) -> int:
    return await run_cli(_cli("keys", "revoke", ident, "--db", str(db_path)), SETTINGS)


async def _is_revoked(store: Store, key_id: str) -> bool:
    key = await store.get_key(key_id)  # read from the file: the CLI revoked through its own Store
    assert key is not None
    return key.is_revoked


def _stdout_lines(capsys: pytest.CaptureFixture) -> list[str]:
    """What the command printed, without the store's log lines (structlog prints to stdout until
    server.py configures it)."""
    return [line for line in capsys.readouterr().out.splitlines() if "[info" not in line and "[debug" not in line]


@pytest.mark.asyncio
async def test_find_keys_matches_the_start_of_a_prefix_exactly_and_ids_whole(store: Store, db_path: Path) -> None:
    await store.create_org("acme", "plus")
    made = [(await store.create_key("acme"))[0] for _ in range(3)]
    for key, prefix in zip(made, ("sk-a_c12345", "sk-aXc12345", "sk-Abc12345"), strict=True):
        _set_prefix(db_path, key.id, prefix)

    # "_" is not a wildcard and case counts (LIKE would get both wrong).
    assert [k.id for k in await store.find_keys("sk-a_c")] == [made[0].id]
    assert [k.id for k in await store.find_keys("sk-a")] == []  # under 6 characters: ids only
    assert [k.id for k in await store.find_keys(made[2].id)] == [made[2].id]
    assert await store.find_keys(made[2].id[:-1]) == []
    assert await store.find_keys("") == []


@pytest.mark.asyncio
async def test_keys_revoke_takes_a_unique_short_prefix_and_names_the_keys_an_ambiguous_one_matches(
    store: Store, db_path: Path, capsys: pytest.CaptureFixture
) -> None:
    await store.create_org("acme", "plus")
    first, second, third = [(await store.create_key("acme"))[0] for _ in range(3)]
    _set_prefix(db_path, first.id, "sk-abc11111")
    _set_prefix(db_path, second.id, "sk-abc22222")

    assert await _revoke(db_path, "sk-ab") == 1
    assert "too short" in capsys.readouterr().err
    assert await _revoke(db_path, "sk-abc") == 1
    err = capsys.readouterr().err
    assert "2 active keys" in err and "sk-abc11111" in err and "sk-abc22222" in err
    assert not await _is_revoked(store, first.id)

    assert await _revoke(db_path, "sk-abc1") == 0
    assert _stdout_lines(capsys)[-1].startswith("revoked sk-abc11111...")
    assert await _is_revoked(store, first.id) and not await _is_revoked(store, second.id)
    assert await _revoke(db_path, "sk-abc1") == 1
    assert "already revoked: sk-abc11111" in capsys.readouterr().err
    # Only active keys count: the revoked one no longer makes "sk-abc" ambiguous.
    assert await _revoke(db_path, "sk-abc") == 0
    assert await _is_revoked(store, second.id)

    assert await _revoke(db_path, third.id) == 0  # a key id still works
    assert await _is_revoked(store, third.id)
    assert await _revoke(db_path, "sk-zzzzzz") == 1
    assert "no active key with prefix or id 'sk-zzzzzz'" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_keys_list_has_a_header_and_a_dash_for_a_key_without_a_name(
    store: Store, db_path: Path, capsys: pytest.CaptureFixture
) -> None:
    await store.create_org("acme", "plus")
    unnamed, _ = await store.create_key("acme")
    named, _ = await store.create_key("acme", name="ci runner")

    assert await run_cli(_cli("keys", "list", "--db", str(db_path)), SETTINGS) == 0
    header, *rows = _stdout_lines(capsys)
    assert header.split()[:5] == ["PREFIX", "LAST4", "ORGANISATION", "SCOPE", "STATE"]
    assert header.rstrip().endswith("NAME")
    assert [row.split()[0] for row in rows] == [unnamed.prefix, named.prefix]  # one key per line
    assert rows[0].rstrip().endswith(" -")
    assert rows[1].endswith(" ci runner")
    # The columns line up under the header.
    assert rows[0].index("acme") == header.index("ORGANISATION")
    assert rows[0].index("never") == header.index("LAST USED")


def test_keys_create_help_says_what_tier_and_budget_do_for_an_existing_organisation(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit):
        _cli("keys", "create", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "tier of a new organisation; for an existing one it must equal that organisation's tier" in text
    assert "(change it with `orgs set`)" in text


def test_serve_flags_come_before_or_after_serve_and_before_keys() -> None:
    assert server.parse_args(["--port", "8000"]).port == 8000
    assert server.parse_args(["--port", "8000", "serve"]).port == 8000  # not reset by `serve`
    args = server.parse_args(["--set", "a.b=1", "serve", "--port", "9", "--model", "m", "--set", "c.d=2"])
    assert (args.command, args.port, args.model, args.overrides) == ("serve", 9, Path("m"), ["a.b=1", "c.d=2"])
    assert server.parse_args(["serve", "--config", "x.toml"]).config == Path("x.toml")
    assert server.parse_args(["serve"]).config == server.DEFAULT_CONFIG
    args = server.parse_args(["--db", "a.db", "keys", "list", "--db", "b.db"])
    assert (args.command, args.serve_db, args.db) == ("keys", "a.db", "b.db")


def test_config_after_an_admin_command_picks_the_servers_config_as_the_readme_says() -> None:
    # README: `keys create --org me --tier enterprise` "(add the --db or --config the server was started with)".
    for command in (["keys", "create", "--org", "me"], ["keys", "list"], ["orgs", "set", "acme"], ["backup"]):
        extra = ["--out", "b.db"] if command == ["backup"] else []
        args = server.parse_args([*command, *extra, "--config", "srv/config.toml"])
        assert args.config == Path("srv/config.toml"), command
    assert server.parse_args(["--config", "a.toml", "keys", "list"]).config == Path("a.toml")  # not reset
    assert server.parse_args(["keys", "list"]).config == server.DEFAULT_CONFIG


def test_serve_help_lists_the_serving_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        server.parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--port", "--host", "--model", "--set", "--config", "--db"):
        assert flag in text


def _server(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "server.py"), *argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_keys_commands_print_no_info_logs(tmp_path: Path) -> None:
    result = _server("keys", "create", "--org", "acme", "--tier", "free", "--db", str(tmp_path / "c.db"), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("sk-")
    # No "store_opened", no "store_migrated": only the note that the file is new.
    assert result.stderr.startswith(f"note: created a new database at {tmp_path / 'c.db'};")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.slow
def test_a_missing_model_folder_from_the_flag_says_so_without_the_config_file_remark(tmp_path: Path) -> None:
    result = _server("--model", "no-such-model", "--db", str(tmp_path / "c.db"), cwd=tmp_path)
    assert result.returncode == 1
    assert f"config error: --model: the folder {tmp_path / 'no-such-model'} does not exist" in result.stderr
    assert "config file" not in result.stderr
