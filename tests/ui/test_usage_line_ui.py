"""The sidebar's usage line with an organisation's budget: the budget is shown to cents, and
one under a cent as precisely as the spending beside it (not as "$0.00")."""

from __future__ import annotations

import pytest

from tests.ui.helpers import open_page, wait_until

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("budget_usd", "shown"), [("0.004", "$0.0040"), ("25", "$25.00")])
def test_the_budget_is_shown_as_precisely_as_it_was_set(browser, ui_server, budget_usd, shown):
    secret = ui_server.create_key(f"budget-{budget_usd}", "enterprise", budget_usd=budget_usd)
    watched = open_page(browser, ui_server.base_url)
    try:
        page = watched.page
        page.get_by_role("button", name="Use an API key…").click()
        page.get_by_label("Key", exact=True).fill(secret)
        page.get_by_role("button", name="Save").click()
        usage = page.locator("#usage-summary")
        wait_until(lambda: "budget" in usage.inner_text())
        assert usage.inner_text().endswith(f" \u00b7 $0 of {shown} budget")  # was "of $0.00" under a cent
    finally:
        watched.close()
