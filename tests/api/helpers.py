"""Helpers for in-process HTTP tests: settings for two echoing fake models, SSE parsing, error checks."""

from __future__ import annotations

import orjson

from api.state import STATE
from settings import Settings, load_settings
from testing.tiny_model import CHAT_TEMPLATE


def echo_settings(tmp_path, model_dir, extra: tuple[str, ...] = ()) -> Settings:
    base = [
        f'models.echo.path="{model_dir}"',
        f'models.echo2.path="{model_dir}"',
        "models.echo.price_input_per_mtok=1.0",
        "models.echo.price_output_per_mtok=2.0",
        'tiers.free.models=["echo2"]',
        'tiers.enterprise.models=["echo", "echo2"]',
        "tiers.enterprise.priority=2",
        "tiers.enterprise.max_tokens=64",
        "tiers.enterprise.max_context_tokens=400",
        f'store.path="{tmp_path / "chat.db"}"',
        "safety.enabled=false",
        "server.max_body_bytes=20000",
        "server.heartbeat_s=0.05",
    ]
    return load_settings(None, [*base, *extra])


def native_settings(tmp_path, model_dir, name: str = "tiny", extra: tuple[str, ...] = ()) -> Settings:
    """One model on the real native engine (CPU, a small KV cache) for the enterprise and free
    tiers, safety off: for HTTP tests that check what the engine really answers."""
    base = [
        f'models.{name}.path="{model_dir}"',
        f'tiers.enterprise.models=["{name}"]',
        f'tiers.free.models=["{name}"]',
        f'store.path="{tmp_path / "chat.db"}"',
        "safety.enabled=false",
        "engine.kv_cache_bytes=4000000",
        'engine.device="cpu"',
    ]
    return load_settings(None, [*base, *extra])


def state_of(client):
    return client.server.app[STATE]


async def org_headers(client, name: str, tier: str) -> dict:
    """A new organisation `name` in `tier`, and the headers of a key of its."""
    store = state_of(client).store
    await store.create_org(name, tier)
    _key, secret = await store.create_key(name)
    return {"Authorization": f"Bearer {secret}"}


async def sse_events(resp) -> tuple[list[dict | str], list[str]]:
    """Read a whole SSE body: (data payloads, with '[DONE]' as a str; comment lines)."""
    text = (await resp.read()).decode()
    assert text.endswith("\n\n"), "every SSE frame ends with a blank line"
    events, comments = [], []
    for frame in text.split("\n\n")[:-1]:
        assert "\n" not in frame, f"one line per frame: {frame!r}"
        if frame.startswith(": "):
            comments.append(frame[2:])
        else:
            assert frame.startswith("data: "), frame
            payload = frame[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events, comments


async def assert_error(resp, status: int, *, code: str | None = None, param: str | None = None) -> dict:
    """Every error path has one shape: OpenAI's envelope, a request id, the right status."""
    assert resp.status == status, await resp.text()
    assert resp.headers.get("X-Request-Id", "").startswith("req_")
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# A reasoning model's template: the tiny model's, closing an empty <think></think> when enable_thinking
# is false (as Qwen3's does).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
# The echo backend answers with the last user message: this one plays a reasoning model.
THINKS = [{"role": "user", "content": "<think>\nCount the words.\n</think>\n\nThree words here."}]
