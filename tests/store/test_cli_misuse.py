"""The admin command line misused: each mistake is one `error:` line (or argparse's usage error)
before anything is written. A change names the database file it went to, and a new database
file is announced; a path that cannot be a database, another program's SQLite file, values too
large to store or show, and names that break `keys list` are refused; values stored before
those checks still list; a closed output pipe ends the command quietly."""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.keys import MAX_ORG_NAME_CHARS
from tests.store.cli_helpers import cli_parser
from tests.store.cli_helpers import run as _cli

ROOT = Path(__file__).resolve().parents[2]


def _out_lines(capsys: pytest.CaptureFixture) -> tuple[list[str], str]:
    """(stdout lines without the store's log lines, stderr)."""
    captured = capsys.readouterr()
    return [line for line in captured.out.splitlines() if "[info" not in line and "[debug" not in line], captured.err


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]


@pytest.mark.asyncio
async def test_every_change_names_the_absolute_database_file_and_a_new_one_is_announced(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "data" / "chat.db"
    assert await _cli("keys", "create", "--org", "acme", "--tier", "free", "--db", "data/chat.db") == 0
    out, err = _out_lines(capsys)
    assert out[0] == f"created organisation acme (tier free, budget none) in {db}"
    assert out[1].startswith("created inference key sk-") and out[1].endswith(f" for acme in {db}")
    assert err == (
        f"note: created a new database at {db}; a server started with --db/--config elsewhere will not see this key\n"
    )

    assert await _cli("keys", "create", "--org", "acme", "--db", str(db)) == 0  # the file exists now: no note
    out, err = _out_lines(capsys)
    assert out[0].endswith(f" for acme in {db}") and err == ""
    prefix = out[0].split()[3].split("...")[0]
    assert await _cli("keys", "revoke", prefix, "--db", str(db)) == 0
    assert _out_lines(capsys)[0][-1].endswith(f" in {db}")
    assert await _cli("orgs", "set", "acme", "--budget", "5", "--db", str(db)) == 0
    assert _out_lines(capsys)[0] == [f"changed acme in {db}: tier free, budget $5.00, limits -"]
    assert await _cli("orgs", "create", "beta", "--tier", "free", "--db", str(tmp_path / "other.db")) == 0
    out, err = _out_lines(capsys)
    assert out == [f"created organisation beta (tier free, budget none) in {tmp_path / 'other.db'}"]
    assert "will not see this organisation" in err


@pytest.mark.asyncio
@pytest.mark.parametrize("command", [["keys", "create", "--org", "acme", "--tier", "free"], ["keys", "list"]])
async def test_a_database_path_that_is_a_folder_or_under_a_file_is_one_error_line(tmp_path, capsys, command):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    assert await _cli(*command, "--db", str(tmp_path / "folder")) == 1
    assert capsys.readouterr().err == (
        f"error: cannot open the database {tmp_path / 'folder'}: Is a directory;"
        f" give a file in it: {tmp_path / 'folder' / 'chat.db'}\n"
    )
    assert await _cli(*command, "--db", str(tmp_path / "file" / "x.db")) == 1
    db = tmp_path / "file" / "x.db"
    assert capsys.readouterr().err == (
        f"error: cannot open the database {db}: Not a directory ({tmp_path / 'file'} is a file)\n"
    )


@pytest.mark.asyncio
async def test_a_file_that_is_not_a_database_is_named_once_in_the_error(tmp_path, capsys):
    db = tmp_path / "chat.db"
    db.write_bytes(b"\x07garbage, not SQLite" * 300)
    assert await _cli("keys", "create", "--org", "acme", "--tier", "free", "--db", str(db)) == 1
    err = capsys.readouterr().err
    assert err == f"error: cannot open the database {db}: file is not a database\n"


@pytest.mark.asyncio
@pytest.mark.parametrize("user_version", [0, 3])
async def test_another_programs_sqlite_file_is_refused_and_left_as_it_was(tmp_path, capsys, user_version):
    db = tmp_path / "notes.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE notes (x)")
        conn.execute(f"PRAGMA user_version = {user_version}")
    assert await _cli("keys", "create", "--org", "acme", "--tier", "free", "--db", str(db)) == 1
    assert capsys.readouterr().err == (
        f"error: {db} is not this server's database (it has tables: notes);"
        " give --db a new path or this server's database\n"
    )
    assert _tables(db) == ["notes"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL


@pytest.mark.asyncio
async def test_a_schema_version_without_our_tables_is_not_our_database_either(tmp_path, capsys):
    db = tmp_path / "chat.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version = 5")
    assert await _cli("orgs", "list", "--db", str(db)) == 1
    assert capsys.readouterr().err == (
        f"error: {db} is not this server's database (it has no tables);"
        " give --db a new path or this server's database\n"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["keys", "create", "--org", "acme", "--tier", "free", "--budget"],
        ["orgs", "create", "acme", "--tier", "free", "--budget"],
        ["orgs", "set", "acme", "--budget"],
    ],
)
@pytest.mark.parametrize("budget", ["1e19", "1e25", "1000000000001"])
def test_a_budget_over_a_trillion_dollars_is_refused_before_anything_is_written(capsys, command, budget):
    with pytest.raises(SystemExit):
        cli_parser().parse_args([*command, budget])
    assert "budget must be a finite number >= 0 and at most 1,000,000,000,000 (USD)" in capsys.readouterr().err


@pytest.mark.parametrize("days", ["0", "-1", "nan", "inf", "1e300", "3000000", "soon"])
def test_expires_in_days_must_be_more_than_0_and_at_most_100_years(capsys, days):
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["keys", "create", "--org", "acme", "--tier", "free", f"--expires-in-days={days}"])
    assert f"must be a number of days more than 0 and at most 36500, got {days!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, problem",
    [
        ("new\nline", "cannot hold tabs, newlines or other control characters"),
        ("tab\torg", "cannot hold tabs, newlines or other control characters"),
        ("a" * (MAX_ORG_NAME_CHARS + 1), f"at most {MAX_ORG_NAME_CHARS} characters, got {MAX_ORG_NAME_CHARS + 1}"),
    ],
)
@pytest.mark.parametrize(
    "command", [["keys", "create", "--tier", "free", "--org"], ["orgs", "create", "--tier", "free"]]
)
def test_an_organisation_name_that_would_break_keys_list_is_refused(capsys, command, name, problem):
    with pytest.raises(SystemExit):
        cli_parser().parse_args([*command, name])
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("name", ["two\nlines", "tab\tlabel", "x" * 201])
def test_a_key_label_that_would_break_keys_list_is_refused(capsys, name):
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["keys", "create", "--org", "acme", "--tier", "free", "--name", name])
    assert "a key's name" in capsys.readouterr().err


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "args",
    [["--tier", "gold"], []],  # an unknown tier; no tier, so no organisation to give the key to
    ids=["unknown-tier", "no-tier"],
)
async def test_keys_create_that_fails_on_a_new_database_leaves_no_file(tmp_path, capsys, args):
    db = tmp_path / "data" / "chat.db"
    assert await _cli("keys", "create", "--org", "acme", *args, "--db", str(db)) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert not db.parent.exists()


@pytest.mark.asyncio
async def test_values_stored_before_the_checks_still_list(tmp_path, capsys):
    db = tmp_path / "chat.db"
    assert await _cli("keys", "create", "--org", "acme", "--tier", "free", "--db", str(db)) == 0
    with sqlite3.connect(db) as conn:  # what the CLI and the admin API used to accept
        conn.execute("UPDATE orgs SET budget_usd = 1e25")
        conn.execute("UPDATE api_keys SET expires_at = ?", (time.time() + 1e300,))
    capsys.readouterr()
    assert await _cli("orgs", "list", "--db", str(db)) == 0
    assert "budget $10,000,000,000,000,000,000,000,000 " in capsys.readouterr().out
    assert await _cli("keys", "list", "--db", str(db)) == 0
    assert " expires after 9999-12-31 " in capsys.readouterr().out


@pytest.mark.asyncio
async def test_an_infinite_expiry_or_budget_stored_lists_as_never_and_none(tmp_path, capsys):
    """Infinity in the database read "expires after 9999-12-31" and "budget $Infinity"."""
    db = tmp_path / "chat.db"
    assert await _cli("keys", "create", "--org", "acme", "--tier", "free", "--db", str(db)) == 0
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE orgs SET budget_usd = ?", (math.inf,))
        conn.execute("UPDATE api_keys SET expires_at = ?", (math.inf,))
    capsys.readouterr()
    assert await _cli("orgs", "list", "--db", str(db)) == 0
    assert " budget none " in capsys.readouterr().out
    assert await _cli("keys", "list", "--db", str(db)) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if " acme " in line]
    assert " active " in row and "expire" not in row


@pytest.mark.slow
def test_output_cut_by_a_closed_pipe_ends_quietly(tmp_path):
    db = tmp_path / "chat.db"
    made = subprocess.run(
        [sys.executable, "server.py", "keys", "create", "--org", "acme", "--tier", "free", "--db", str(db)],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=120,
    )
    assert made.stdout
    read_end, write_end = os.pipe()
    os.close(read_end)  # `keys list | head -0`: every write meets a closed pipe
    try:
        result = subprocess.run(
            [sys.executable, "server.py", "keys", "list", "--db", str(db)],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""  # no BrokenPipeError traceback
