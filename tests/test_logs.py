"""Log output: with log_json every line on stderr is one JSON object, the standard library's
(aiosqlite, aiohttp) included."""

from __future__ import annotations

import json
import logging

import structlog

from api.logs import configure_logging


def test_stdlib_log_lines_are_json_too_when_log_json_is_set(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    saved_structlog = structlog.get_config()
    try:
        configure_logging("debug", json_lines=True)
        logging.getLogger("aiosqlite").debug("executing %s", "PRAGMA")
        structlog.get_logger("t").info("store_opened", path="x")
        lines = capsys.readouterr().err.splitlines()
    finally:
        root.handlers, root.level = saved[0], saved[1]
        structlog.configure(**saved_structlog)
    events = [json.loads(line) for line in lines]
    assert events[0]["event"] == "executing PRAGMA" and events[0]["logger"] == "aiosqlite"
    assert events[0]["level"] == "debug" and "timestamp" in events[0]
    assert events[1]["event"] == "store_opened" and events[1]["path"] == "x"
