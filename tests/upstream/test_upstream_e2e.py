"""End to end: two real instances of this server on a tiny model as upstreams, and a third in
front of them with `backend = "openai"`. The upstreams require an API key, as they would on
other machines; the front door has it from its environment (`api_key_env`). One set of
processes serves the whole module; the test that kills and restarts an upstream runs last.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess

pytestmark = pytest.mark.slow

UPSTREAM_NAME = "tiny-llama"
QUESTION = [{"role": "user", "content": "What does the word river mean?"}]
SLOW_WORDS = 150  # the echo model at 20 ms a token: a stream of ~3 s
KEY_ENV = "UPSTREAM_TEST_KEY"


def upstream_config(tmp_path, model_dir) -> str:
    path = tmp_path / "upstream.toml"
    path.write_text(f"""
[server]
local_tier = "enterprise"
[safety]
enabled = false
[engine]
kv_cache_bytes = 8000000
[models.{UPSTREAM_NAME}]
path = "{model_dir}"
backend = "native"
[models.echo]
path = "{model_dir}"
[tiers.enterprise]
models = ["{UPSTREAM_NAME}", "echo"]
max_tokens = 400
max_context_tokens = 100000
max_concurrent_streams = 64
requests_per_minute = 100000
tokens_per_minute = 100000000
""")
    return str(path)


def front_config(tmp_path, model_dir, urls: list[str], dead_port: int) -> str:
    urls_toml = json.dumps(urls)
    path = tmp_path / "front.toml"
    path.write_text(f"""
[server]
local_tier = "enterprise"
[safety]
enabled = true
classifier = false
output_classifier = false
deny = {{ weapons = ["forbidden-upstream-test-phrase"] }}
[upstream]
connect_timeout_s = 2.0
breaker_open_s = 0.5
[models.tiny]
backend = "openai"
urls = {urls_toml}
upstream_model = "{UPSTREAM_NAME}"
api_key_env = "{KEY_ENV}"
tokenizer = "{model_dir}"
max_in_flight = 8
[models.tiny-est]
backend = "openai"
urls = {urls_toml}
upstream_model = "{UPSTREAM_NAME}"
api_key_env = "{KEY_ENV}"
[models.slow]
backend = "openai"
urls = {urls_toml}
upstream_model = "echo"
api_key_env = "{KEY_ENV}"
tokenizer = "{model_dir}"
[models.dead]
backend = "openai"
urls = ["http://127.0.0.1:{dead_port}/v1"]
fallback = "tiny"
[models.dead-alone]
backend = "openai"
urls = ["http://127.0.0.1:{dead_port}/v1"]
[tiers.enterprise]
models = ["tiny", "tiny-est", "slow", "dead", "dead-alone"]
max_tokens = 400
max_context_tokens = 100000
max_concurrent_streams = 64
requests_per_minute = 100000
tokens_per_minute = 100000000
""")
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("upstream")
    fake = FakeBehaviour(token_delay_s=0.02)  # only the model "echo" (--fake echo)
    config = upstream_config(tmp, tiny_model_dir)
    key = create_key(config, tmp / "up0.db")
    shutil.copy(tmp / "up0.db", tmp / "up1.db")  # one key for both replicas (docs/scale-out.md)
    ups = [
        ServerProcess(
            ["--config", config, "--db", str(tmp / f"up{i}.db"), "--set", "server.require_keys=true", "--fake", "echo"],
            fake=fake,
            log_path=tmp / f"up{i}.log",
        )
        for i in range(2)
    ]
    dead_port = ServerProcess([]).port  # a free port nobody listens on
    urls = [u.base_url + "/v1" for u in ups]
    front_toml = front_config(tmp, tiny_model_dir, urls, dead_port)
    front_key = create_key(front_toml, tmp / "front.db")  # the openai SDK always sends a key
    front = ServerProcess(
        ["--config", front_toml, "--db", str(tmp / "front.db")], env={KEY_ENV: key}, log_path=tmp / "front.log"
    )
    try:
        with ThreadPoolExecutor(len(ups)) as pool:  # the upstreams start side by side
            list(pool.map(ServerProcess.start, ups))
        front.start()
        yield {"ups": ups, "front": front, "db": tmp / "front.db", "tmp": tmp, "key": key, "front_key": front_key}
    finally:
        for proc in (front, *ups):
            proc.kill()


def create_key(config: str, db: Path) -> str:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "server.py"),
            "--config",
            config,
            "--db",
            str(db),
            "keys",
            "create",
            "--org",
            "front-door",
            "--tier",
            "enterprise",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    ).stdout
    return next(line for line in out.splitlines() if line.startswith("sk-"))


# -- helpers ------------------------------------------------------------------------------
def post(
    base_url: str, body: dict, timeout_s: float = 60, key: str | None = None, path: str = "/v1/chat/completions"
) -> tuple[int, dict, dict]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def stream(base_url: str, body: dict, key: str | None = None, path: str = "/v1/chat/completions") -> list[dict | str]:
    """Every `data:` payload of a stream, decoded; '[DONE]' as a string."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        base_url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **auth},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    frames = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def stream_text(frames) -> str:
    return "".join(c["delta"].get("content") or "" for f in frames if isinstance(f, dict) for c in f.get("choices", []))


def metric(base_url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def wait_until(check, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def served_by(cluster, model: str) -> list[float]:
    return [
        metric(cluster["front"].base_url, "chat_upstream_requests_total", model=model, replica=u.base_url + "/v1")
        for u in cluster["ups"]
    ]


def greedy(messages, max_tokens=24, model="tiny", **extra) -> dict:
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}


# -- tests --------------------------------------------------------------------------------
def test_greedy_answer_through_the_front_equals_the_upstreams_own(cluster):
    front, up = cluster["front"], cluster["ups"][0]
    assert post(up.base_url, greedy(QUESTION, model=UPSTREAM_NAME))[0] == 401  # the upstreams require keys
    status, _, own = post(up.base_url, greedy(QUESTION, model=UPSTREAM_NAME), key=cluster["key"])
    assert status == 200
    for model in ("tiny", "tiny-est"):
        status, headers, relayed = post(front.base_url, greedy(QUESTION, model=model))
        assert status == 200, relayed
        assert relayed["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
        assert relayed["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"]
        assert relayed["model"] == model and relayed["id"] == "chatcmpl-" + headers["X-Request-Id"].removeprefix("req_")
        for key in ("prompt_tokens", "completion_tokens"):
            assert relayed["usage"][key] == own["usage"][key], (model, key)


def test_streaming_is_relayed_with_exact_text_and_usage(cluster):
    front, up = cluster["front"], cluster["ups"][1]
    body = greedy(QUESTION, max_tokens=40, stream_options={"include_usage": True})
    own = stream(up.base_url, {**body, "model": UPSTREAM_NAME}, key=cluster["key"])
    relayed = stream(front.base_url, body)
    assert relayed[-1] == "[DONE]"
    assert stream_text(relayed) == stream_text(own) != ""
    assert len({f["id"] for f in relayed if isinstance(f, dict)}) == 1  # our own completion id throughout
    assert relayed[-2]["usage"]["completion_tokens"] == own[-2]["usage"]["completion_tokens"]
    assert relayed[-2]["usage"]["prompt_tokens"] == own[-2]["usage"]["prompt_tokens"]
    num_content_chunks = sum(
        1 for f in relayed if isinstance(f, dict) and f["choices"] and f["choices"][0]["delta"].get("content")
    )
    assert num_content_chunks > 1  # chunk by chunk, not one block at the end
    assert metric(front.base_url, "chat_upstream_time_to_first_token_seconds_count", model="tiny") >= 1


def test_a_legacy_completion_is_relayed_to_the_upstreams_completions(cluster):
    front, up = cluster["front"], cluster["ups"][0]
    body = {"prompt": "The river runs past the old mill and", "temperature": 0, "max_tokens": 12, "logprobs": 2}
    status, _, own = post(up.base_url, {**body, "model": UPSTREAM_NAME}, key=cluster["key"], path="/v1/completions")
    assert status == 200, own
    for model in ("tiny", "tiny-est"):  # a local tokenizer, or none: the upstream's usage is billed either way
        status, headers, relayed = post(front.base_url, {**body, "model": model}, path="/v1/completions")
        assert status == 200, relayed
        assert relayed["object"] == "text_completion" and relayed["id"] == "cmpl-" + headers["X-Request-Id"][4:]
        assert relayed["choices"][0]["text"] == own["choices"][0]["text"] != ""
        assert relayed["choices"][0]["logprobs"]["tokens"] == own["choices"][0]["logprobs"]["tokens"]
        own_values = own["choices"][0]["logprobs"]["token_logprobs"]  # the upstream ran it again: equal to 1e-3
        assert relayed["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(own_values, abs=1e-3)
        assert relayed["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
        assert relayed["usage"]["completion_tokens"] == own["usage"]["completion_tokens"]
    frames = stream(front.base_url, {**body, "model": "tiny"}, path="/v1/completions")
    assert frames[-1] == "[DONE]"
    assert "".join(c["text"] for f in frames[:-1] for c in f["choices"]) == own["choices"][0]["text"]
    status, _, error = post(front.base_url, {**body, "model": "tiny", "prompt": [1, 2, 3]}, path="/v1/completions")
    assert status == 400 and error["error"]["param"] == "prompt"  # token ids: only for models served here


def ledger_row(cluster, request_id: str) -> tuple | None:
    with sqlite3.connect(f"file:{cluster['db']}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT status, prompt_tokens, completion_tokens, usage_source FROM usage WHERE request_id = ?",
            (request_id,),
        ).fetchone()


def test_the_ledger_bills_the_upstreams_usage_and_says_so(cluster):
    status, headers, body = post(cluster["front"].base_url, greedy(QUESTION, model="tiny-est"))
    assert status == 200
    request_id = headers["X-Request-Id"]
    wait_until(lambda: ledger_row(cluster, request_id) is not None, what="the ledger row")
    usage = body["usage"]
    assert ledger_row(cluster, request_id) == (
        "finished",
        usage["prompt_tokens"],
        usage["completion_tokens"],
        "upstream",
    )


def test_a_conversations_next_turn_goes_to_the_same_replica_and_hits_its_cache(cluster):
    for i in range(3):  # three conversations: least-outstanding spreads them, affinity keeps each
        first = [{"role": "user", "content": f"Conversation {i}: tell me about rivers, the sea and the weather."}]
        before = served_by(cluster, "tiny")
        status, _, turn1 = post(cluster["front"].base_url, greedy(first, max_tokens=20))
        assert status == 200
        after1 = served_by(cluster, "tiny")
        replica = max(range(2), key=lambda r: after1[r] - before[r])
        history = [
            *first,
            {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And what about the lazy dog?"},
        ]
        status, _, turn2 = post(cluster["front"].base_url, greedy(history, max_tokens=8))
        assert status == 200
        after2 = served_by(cluster, "tiny")
        assert after2[replica] - after1[replica] == 1 and sum(after2) - sum(after1) == 1
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # at least one KV block reused


def test_a_stored_conversation_keeps_its_replica_across_turns(cluster):
    front = cluster["front"]
    req = urllib.request.Request(
        front.base_url + "/v1/conversations", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        conversation_id = json.loads(resp.read())["id"]
    replicas = []
    for question in ("Tell me about the sea and the weather today.", "And the river?", "And the fox?"):
        before = served_by(cluster, "tiny")
        status, _, answer = post(
            front.base_url,
            greedy([{"role": "user", "content": question}], max_tokens=12, conversation_id=conversation_id),
        )
        assert status == 200, answer
        after = served_by(cluster, "tiny")
        replicas.append(max(range(2), key=lambda r: after[r] - before[r]))
    assert len(set(replicas)) == 1  # the history lives in our SQLite; its KV cache on one replica
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_structured_output_and_a_forced_tool_call_are_answered_by_the_upstream(cluster):
    front = cluster["front"]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    status, _, body = post(
        front.base_url,
        greedy(
            QUESTION,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
        ),
    )
    assert status == 200, body
    assert set(json.loads(body["choices"][0]["message"]["content"])) == {"city"}  # a random model: only the grammar
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    status, _, body = post(
        front.base_url,
        greedy(
            QUESTION, max_tokens=80, tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
    )
    assert status == 200, body
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def sdk(cluster):
    return openai.OpenAI(
        base_url=cluster["front"].base_url + "/v1", api_key=cluster["front_key"], max_retries=0, timeout=60
    )


def assert_same_logprobs(relayed: list[dict], own: list[dict]) -> None:
    """Same tokens, bytes and alternatives; logprobs equal up to float noise (a prefix-cache hit
    upstream computes the prompt in other chunks)."""
    assert [e["token"] for e in relayed] == [e["token"] for e in own] and own
    for r, o in zip(relayed, own, strict=True):
        assert r["bytes"] == o["bytes"] and r["logprob"] == pytest.approx(o["logprob"], abs=1e-3)
        assert [t["token"] for t in r["top_logprobs"]] == [t["token"] for t in o["top_logprobs"]]
        assert [t["logprob"] for t in r["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in o["top_logprobs"]], abs=1e-3
        )


def test_logprobs_are_the_upstreams_own_relayed_through_the_sdk_streamed_and_not(cluster):
    ask = greedy(QUESTION, max_tokens=12, logprobs=True, top_logprobs=3)
    status, _, own = post(cluster["ups"][0].base_url, {**ask, "model": UPSTREAM_NAME}, key=cluster["key"])
    assert status == 200, own
    own_entries = own["choices"][0]["logprobs"]["content"]
    assert len(own_entries) == own["usage"]["completion_tokens"] and len(own_entries[0]["top_logprobs"]) == 3
    unary = sdk(cluster).chat.completions.create(**ask)
    assert unary.choices[0].message.content == own["choices"][0]["message"]["content"]
    assert_same_logprobs([e.model_dump() for e in unary.choices[0].logprobs.content], own_entries)
    chunks = list(sdk(cluster).chat.completions.create(**ask, stream=True))
    streamed = [
        e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert_same_logprobs(streamed, own_entries)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == unary.choices[0].message.content


def test_responses_logprobs_are_relayed_from_the_upstream_through_the_sdk(cluster):
    status, _, own = post(
        cluster["ups"][1].base_url,
        greedy(QUESTION, max_tokens=8, model=UPSTREAM_NAME, logprobs=True, top_logprobs=2),
        key=cluster["key"],
    )
    assert status == 200, own
    ask = dict(
        model="tiny",
        input=QUESTION[0]["content"],
        max_output_tokens=8,
        temperature=0,
        store=False,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    out = sdk(cluster).responses.create(**ask)
    part = out.output[-1].content[0]
    assert part.text == own["choices"][0]["message"]["content"]
    assert_same_logprobs([e.model_dump() for e in part.logprobs], own["choices"][0]["logprobs"]["content"])
    events = list(sdk(cluster).responses.create(**ask, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in part.logprobs]


def test_the_responses_api_at_the_front_is_served_by_the_upstream(cluster):
    front = cluster["front"]
    before = sum(served_by(cluster, "tiny"))
    req = urllib.request.Request(
        front.base_url + "/v1/responses",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {
                "model": "tiny",
                "input": "What does the word river mean?",
                "max_output_tokens": 16,
                "temperature": 0,
                "store": False,
            }
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.loads(resp.read())
    assert body["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens reached
    assert body["output"][-1]["content"][0]["text"]
    assert body["usage"]["output_tokens"] > 0 and sum(served_by(cluster, "tiny")) == before + 1


def test_the_prompt_screen_runs_in_front_and_nothing_reaches_the_upstream(cluster):
    before = served_by(cluster, "tiny")
    status, _, body = post(
        cluster["front"].base_url, greedy([{"role": "user", "content": "say forbidden-upstream-test-phrase"}])
    )
    assert status == 200 and body["choices"][0]["finish_reason"] == "content_filter"
    assert served_by(cluster, "tiny") == before


def test_an_upstream_client_error_is_passed_on_with_its_message(cluster):
    # No local tokenizer and no max_model_len: the upstream's own context check answers.
    long_prompt = [{"role": "user", "content": "river " * 300}]
    status, _, body = post(cluster["front"].base_url, greedy(long_prompt, max_tokens=400, model="tiny-est"))
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert "maximum context length" in body["error"]["message"]


def test_an_unreachable_model_falls_back_visibly_or_gives_503_with_retry_after(cluster):
    status, headers, body = post(cluster["front"].base_url, greedy(QUESTION, model="dead"))
    assert status == 200 and headers["x-fallback-from"] == "dead" and body["model"] == "tiny"
    assert headers["x-fallback-reason"] == "unavailable"
    status, headers, body = post(cluster["front"].base_url, greedy(QUESTION, model="dead-alone"))
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "model_unavailable"
    assert metric(cluster["front"].base_url, "chat_upstream_breaker_state", model="dead-alone") == 2


def test_a_disconnect_at_the_front_aborts_the_upstream_request(cluster):
    front = cluster["front"]

    def upstream_aborts() -> float:
        return sum(
            metric(u.base_url, "chat_requests_finished_total", model="echo", finish_reason="abort")
            for u in cluster["ups"]
        )

    before = upstream_aborts()
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    body = {"model": "slow", "stream": True, "messages": [{"role": "user", "content": " ".join(["w"] * SLOW_WORDS)}]}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    request_id = resp.getheader("X-Request-Id")
    while '"content":"w' not in (line := resp.readline().decode()) and '"content":" w' not in line:
        assert line, "the stream ended before its first token"
    conn.sock.close()  # the client goes away mid-answer
    conn.close()
    wait_until(lambda: upstream_aborts() == before + 1, what="the upstream to count an aborted request")
    wait_until(
        lambda: metric(front.base_url, "chat_upstream_requests_in_flight", model="slow") == 0,
        what="the front to release the upstream slot",
    )
    wait_until(lambda: ledger_row(cluster, request_id) is not None, what="the ledger row")
    status, _, completion_tokens, usage_source = ledger_row(cluster, request_id)
    assert status == "aborted" and 0 < completion_tokens < SLOW_WORDS and usage_source == "tokenizer"  # as counted


def test_killing_an_upstream_mid_stream_errors_that_stream_and_new_requests_go_to_the_other(cluster):
    front, ups = cluster["front"], cluster["ups"]
    result: dict = {}
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    body = {"model": "slow", "stream": True, "messages": [{"role": "user", "content": " ".join(["w"] * SLOW_WORDS)}]}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    head = []  # read until the client has its first token: from here on no retry may happen
    while '"content":"w' not in (line := resp.readline().decode()) and '"content":" w' not in line:
        assert line, "the stream ended before its first token"
        head.append(line)
    victim = next(
        i
        for i, u in enumerate(ups)
        if metric(front.base_url, "chat_upstream_requests_in_flight", model="slow", replica=u.base_url + "/v1")
    )
    port = ups[victim].port
    ups[victim].kill()
    result["text"] = "".join(head) + line + resp.read().decode()
    conn.close()
    frames = [line[6:] for line in result["text"].split("\n") if line.startswith("data: ")]
    assert json.loads(frames[-1])["error"]["code"] == "model_unavailable"  # a server-side cut: no [DONE]
    label = dict(model="slow", replica=ups[victim].base_url + "/v1")
    assert metric(front.base_url, "chat_upstream_breaker_state", **label) == 2

    survivor = ups[1 - victim].base_url + "/v1"
    before = metric(front.base_url, "chat_upstream_requests_total", model="tiny", replica=survivor)
    for _ in range(3):
        status, _, answer = post(front.base_url, greedy(QUESTION))
        assert status == 200, answer
    assert metric(front.base_url, "chat_upstream_requests_total", model="tiny", replica=survivor) >= before + 3

    restarted = ServerProcess(
        ups[victim].args, fake=FakeBehaviour(token_delay_s=0.02), log_path=cluster["tmp"] / "restarted.log"
    )
    restarted.port = port
    ups[victim] = restarted.start()
    wait_until(
        lambda: metric(front.base_url, "chat_upstream_breaker_state", **label) == 1,
        what="the probe to let the replica back in (half-open)",
    )
    for i in range(4):  # the half-open replica takes one trial request; its success closes the breaker
        messages = [{"role": "user", "content": f"new conversation {i}"}]  # no affinity to the survivor
        status, _, answer = post(front.base_url, greedy(messages, max_tokens=4, model="slow"))
        assert status == 200, answer
    assert metric(front.base_url, "chat_upstream_breaker_state", **label) == 0
