"""The block printed once the server is up: the key command it shows must reach this server's database."""

from __future__ import annotations

import shlex

from api.startup import ready_text
from settings import PROJECT_DIR, load_settings


def test_the_keys_command_names_the_database_when_it_is_not_the_default(tmp_path):
    db = tmp_path / "my chats" / "chat.db"
    text = ready_text(load_settings(None, [f'store.path="{db}"']), is_keyless=False)
    assert f"keys create --db {shlex.quote(str(db))} --org NAME" in text  # pasted as is, it writes there


def test_the_default_database_needs_no_flag():
    text = ready_text(load_settings(PROJECT_DIR / "config.toml"), is_keyless=False)
    assert "keys create --org NAME --tier free" in text
