"""Browser fixtures: one server per session (fake backend, tiny tokenizer, safety off) and
Debian's Chromium driven by Playwright; skipped where Chromium or Playwright is missing."""

from __future__ import annotations

import pytest

from tests.ui.helpers import CHROMIUM, CHROMIUM_ARGS, open_page, start_ui_server


@pytest.fixture(scope="session")
def ui_server(tiny_model_dir, tmp_path_factory):
    server = start_ui_server(tmp_path_factory.mktemp("ui"), tiny_model_dir)
    try:
        yield server
    finally:
        server.stop()


# Module scope, not session: Playwright's sync API keeps an event loop running in this thread
# while it is open, and every asyncio test collected after tests/ui would then fail to start.
@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def ui(browser, ui_server):
    watched = open_page(browser, ui_server.base_url)
    yield watched
    watched.close()
