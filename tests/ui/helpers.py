"""Helpers for the browser tests: the real server over the fake backend, a Playwright page
that records dialogs, console errors and every request, and small UI actions.

The fake backend (testing/fake_backend.py) repeats the last user message, so a test chooses
the model's answer (hostile Markdown included) by what it types. Screenshots go to artifacts/ui/.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = ROOT / "artifacts" / "ui"
TOKEN_DELAY_S = 0.05  # slow enough to watch the answer grow and to stop it midway
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 820}

CONFIG = """
[server]
static_dir = "{static}"
heartbeat_s = 1.0

[safety]
enabled = false

[models.echo-large]
path = "{model}"
max_model_len = 16384
price_input_per_mtok = 0.50
price_cached_input_per_mtok = 0.05
price_output_per_mtok = 1.50
fallback = "echo-small"

[models.echo-small]
path = "{model}"
max_model_len = 16384
price_input_per_mtok = 0.10
price_cached_input_per_mtok = 0.01
price_output_per_mtok = 0.30

[tiers.free]
models = ["echo-small"]
max_tokens = 1024
max_context_tokens = 16384
budget_fallback = false

[tiers.enterprise]
models = ["echo-large", "echo-small"]
max_tokens = 4096
max_context_tokens = 16384
requests_per_minute = {rpm}
"""


@dataclass
class UiServer:
    proc: ServerProcess
    config_path: Path
    db_path: Path

    @property
    def base_url(self) -> str:
        return self.proc.base_url

    def get_json(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def usage_rows(self, conversation_id: str) -> list[dict]:
        """Ledger rows of one conversation, read straight from the SQLite file."""
        with sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=5) as conn:
            conn.row_factory = sqlite3.Row
            rows = conn.execute(
                "SELECT request_id, status, prompt_tokens, completion_tokens, cost_usd FROM usage"
                " WHERE conversation_id = ? ORDER BY created_at",
                (conversation_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def create_key(self, org: str, tier: str, *, budget_usd: str = "none") -> str:
        """`server.py keys create` against the running server's database; returns the secret."""
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "server.py"),
                "--config",
                str(self.config_path),
                "keys",
                "create",
                "--org",
                org,
                "--tier",
                tier,
                "--budget",
                budget_usd,
                "--db",
                str(self.db_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1].strip()

    def stop(self) -> None:
        self.proc.__exit__(None, None, None)


def start_ui_server(
    tmp: Path, model_dir: Path, *, rpm: int = 600, max_num_running: int = 0, extra_config: str = ""
) -> UiServer:
    """`extra_config`: TOML tables appended to CONFIG (e.g. a [sharing] section)."""
    config = tmp / "config.toml"
    config.write_text(CONFIG.format(static=ROOT / "static", model=model_dir, rpm=rpm) + extra_config)
    db_path = tmp / "chat.db"
    proc = ServerProcess(
        ["--config", str(config), "--db", str(db_path)],
        fake=FakeBehaviour(token_delay_s=TOKEN_DELAY_S, max_num_running=max_num_running),
        log_path=tmp / "server.log",
    )
    proc.start()
    return UiServer(proc, config, db_path)


def restart_ui_server(server: UiServer) -> UiServer:
    """Starts the server again on the same port, config and database (after a kill)."""
    proc = ServerProcess(server.proc.args, fake=FakeBehaviour(), log_path=server.proc.log_path)
    proc.port = server.proc.port
    proc.start()
    return UiServer(proc, server.config_path, server.db_path)


@dataclass
class Watched:
    """A page plus what it did: dialogs opened, console errors, requests sent."""

    page: object
    base_url: str
    dialogs: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def foreign_requests(self) -> list[str]:
        return [u for u in self.requests if not u.startswith((self.base_url + "/", "data:"))]

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        self.page.context.close()


def open_page(
    browser, base_url: str, *, color_scheme: str = "light", viewport: dict | None = None, path: str = "/"
) -> Watched:
    context = browser.new_context(color_scheme=color_scheme, viewport=viewport or DESKTOP, reduced_motion="reduce")
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
    page = context.new_page()
    watched = Watched(page, base_url)

    def on_dialog(dialog):
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on("console", lambda m: watched.console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: watched.page_errors.append(str(e)))
    page.on("request", lambda r: watched.requests.append(r.url))
    page.goto(base_url + path)
    page.wait_for_selector("body.ready")
    return watched


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.1):
    """Polls `predicate` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


# ---- UI actions ---------------------------------------------------------------------------
def type_and_send(page, text: str) -> None:
    box = page.get_by_label("Message", exact=True)
    box.fill(text)
    box.press("Enter")


def last_answer(page):
    return page.locator("article.msg-assistant").last


def wait_for_answer_done(page, timeout_s: float = 60.0) -> None:
    """Waits until no answer is streaming (the Send button is back)."""
    page.locator("#send").wait_for(state="visible", timeout=timeout_s * 1000)
    # Polled from here: wait_for_function polls with eval, which the page's CSP forbids.
    wait_until(lambda: page.locator("#messages").get_attribute("aria-busy") == "false", timeout_s)


def conversation_id(page) -> str:
    return page.evaluate("window.location.hash.slice(1)")


def model_options(page) -> list[str]:
    return page.locator("#model-select option").all_inner_texts()


def sidebar_titles(page) -> list[str]:
    return page.locator("#conversation-list .conv-open").all_inner_texts()
