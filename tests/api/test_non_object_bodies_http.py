"""Every route that takes a body, walked from the app's route table: a body that is valid JSON but
not an object (or not JSON at all) is the caller's mistake, a 4xx in the envelope of the route's
API, never a 500 from a validator that calls `.get` on a list (vLLM's bug class). A route added
later is walked too."""

from __future__ import annotations

import re

import pytest

from tests.api.helpers import state_of

BODIES = [b'"s"', b"[]", b"42", b"null", b"true", b'{"a":']
# Ollama's model management: this server has none, and says so with a 501 whatever the body.
UNSUPPORTED = {"/api/copy", "/api/create", "/api/pull", "/api/push"}


async def _path_params(client) -> dict[str, str]:
    """Real ids where a route needs one, so that each is walked up to its body, not to a 404."""
    items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    made = await (await client.post("/v1/conversations", json={"items": items})).json()
    conversation = await (await client.get(f"/v1/conversations/{made['id']}")).json()
    share = await (await client.post(f"/v1/conversations/{made['id']}/shares", json={})).json()
    return {
        "conversation_id": made["id"],
        "message_id": conversation["messages"][-1]["id"],
        "share_id": share["id"],
        "name": "acme",
    }


@pytest.mark.parametrize("body", BODIES, ids=[b.decode() for b in BODIES])
async def test_every_route_taking_a_body_answers_a_non_object_body_with_a_4xx(make_client, body):
    client = await make_client("tiers.enterprise.requests_per_minute=100000")
    store = state_of(client).store
    await store.create_org("acme", "free")
    await store.create_org("ops", "free")
    _key, admin_secret = await store.create_key("ops", scope="admin")
    params = await _path_params(client)
    walked = []
    for route in client.server.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method not in ("POST", "PUT", "PATCH") or path in UNSUPPORTED:
            continue
        path = re.sub(r"\{(\w+)\}", lambda m: params.get(m.group(1), "missing"), path)
        headers = {"Content-Type": "application/json"}
        if path.startswith("/v1/admin/"):
            headers["Authorization"] = f"Bearer {admin_secret}"
        resp = await client.request(route.method, path, data=body, headers=headers)
        assert 400 <= resp.status < 500, (route.method, path, resp.status, await resp.text())
        assert resp.content_type == "application/json", (route.method, path)
        walked.append(path)
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/v1/admin/keys"} <= set(walked)
    assert (await client.get("/health")).status == 200
