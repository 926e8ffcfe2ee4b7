"""The admin command line as an operator uses it: budgets must be finite, an organisation needs a
name, a command that reads a database refuses one that does not exist (instead of creating it),
a file that cannot be written is one line, `backup` copies the data; and the one-server lock
sees through another name for the same database."""

from __future__ import annotations

import os
import socket
import sqlite3

import pytest

from api.startup import PortInUse, bind_listening_socket
from store.lock import DatabaseInUse, ServerLock
from store.store import Store
from tests.store.cli_helpers import cli_parser
from tests.store.cli_helpers import run as _cli


@pytest.mark.parametrize("budget", ["inf", "-inf", "1e400", "nan", "-1", "lots"])
@pytest.mark.parametrize("command", [["keys", "create", "--org", "acme"], ["orgs", "create", "acme"]])
def test_every_budget_argument_must_be_a_finite_number_at_least_0(capsys, command, budget):
    with pytest.raises(SystemExit):
        cli_parser().parse_args([*command, "--tier", "free", f"--budget={budget}"])
    assert "budget must be a finite number >= 0" in capsys.readouterr().err


def test_orgs_set_refuses_an_infinite_budget_too(capsys):
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["orgs", "set", "acme", "--budget", "inf"])
    assert "budget must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["keys", "create", "--org", " "], ["orgs", "create", ""]])
def test_an_organisation_needs_a_name(capsys, command):
    with pytest.raises(SystemExit):
        cli_parser().parse_args([*command, "--tier", "free"])
    assert "an organisation needs a name" in capsys.readouterr().err


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "command",
    [["keys", "list"], ["orgs", "list"], ["keys", "revoke", "sk-abcdef"], ["feedback", "export"], ["orgs", "set", "x"]],
)
async def test_a_command_on_a_database_that_does_not_exist_refuses_and_creates_nothing(tmp_path, capsys, command):
    db = tmp_path / "no-such-dir" / "chat.db"
    if command[:2] == ["orgs", "set"]:
        command = [*command, "--tier", "free"]
    assert await _cli(*command, "--db", str(db)) == 1
    assert (
        capsys.readouterr().err
        == f"error: no database at {db}; give the server's --db, or start the server once to create it\n"
    )
    assert not db.parent.exists()


@pytest.mark.asyncio
async def test_feedback_export_to_a_folder_that_does_not_exist_is_one_line(tmp_path, capsys):
    db = tmp_path / "chat.db"
    assert await _cli("orgs", "create", "acme", "--tier", "free", "--db", str(db)) == 0
    out = tmp_path / "nonexistent" / "f.jsonl"
    capsys.readouterr()
    assert await _cli("feedback", "export", "--out", str(out), "--db", str(db)) == 1
    assert capsys.readouterr().err == f"error: cannot write {out}: No such file or directory\n"


@pytest.mark.asyncio
async def test_backup_copies_what_is_still_in_the_wal_and_says_where_uploads_live(tmp_path, capsys, store_config):
    db, copy = tmp_path / "chat.db", tmp_path / "copy.db"
    store = await Store.open(db, store_config)  # held open: its last writes are in chat.db-wal
    try:
        await store.create_org("acme", "free")
        assert await _cli("backup", "--out", str(copy), "--db", str(db)) == 0
    finally:
        await store.close()
    out = capsys.readouterr().out
    assert f"backed up {db} to {copy}" in out and f"uploaded files (files.dir): {tmp_path / 'files'}" in out
    with sqlite3.connect(copy) as conn:
        assert conn.execute("SELECT name FROM orgs").fetchall() == [("acme",)]
    assert not (tmp_path / "copy.db.partial").exists()


def test_the_server_lock_catches_a_symlink_and_a_hard_link_to_the_same_database(tmp_path):
    db = tmp_path / "chat.db"
    first = ServerLock(db)
    first.acquire()
    try:
        (tmp_path / "elsewhere").mkdir()
        symlink, hardlink = tmp_path / "elsewhere" / "sym.db", tmp_path / "elsewhere" / "hard.db"
        symlink.symlink_to(db)
        os.link(db, hardlink)
        with pytest.raises(DatabaseInUse, match=f"pid {os.getpid()}"):
            ServerLock(symlink).acquire()
        with pytest.raises(DatabaseInUse, match="under another name"):
            ServerLock(hardlink).acquire()
    finally:
        first.release()
    again = ServerLock(hardlink)  # released: free for the next server
    again.acquire()
    again.release()


def test_a_busy_port_held_by_this_databases_server_says_a_second_one_needs_its_own_database(tmp_path):
    """`make run` twice: `--port 8001` alone, as the message said, stopped again at the lock."""
    db = tmp_path / "chat.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse) as alone:  # no server on this database: --port is enough
            bind_listening_socket("127.0.0.1", port, db)
        assert str(alone.value).endswith(f"--port {port + 1}") and not (tmp_path / "chat.db.lock").exists()
        first = ServerLock(db)
        first.acquire()
        try:
            assert ServerLock(db).holder() == str(os.getpid())
            with pytest.raises(PortInUse) as held:
                bind_listening_socket("127.0.0.1", port, db)
        finally:
            first.release()
    assert f"holds this one's database {db} (pid {os.getpid()})" in str(held.value)
    assert str(held.value).endswith(f"--port {port + 1} --db PATH")
    assert ServerLock(db).holder() is None  # released; the probe took nothing
