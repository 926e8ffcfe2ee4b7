"""End to end: `server.py` as a subprocess on a tiny model, driven by the real `openai` SDK
and by `curl -N`; greedy output equals `transformers`; SIGTERM drains gracefully."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.tokenizer import Tokenizer
from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What does the word river mean?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    proc = ServerProcess(
        [
            "--model",
            str(tiny_model_dir),
            "--db",
            str(tmp / "chat.db"),
            "--set",
            "safety.enabled=false",
            "--set",
            "engine.kv_cache_bytes=8000000",
        ],
        log_path=tmp / "server.log",
    )
    with proc:
        proc.api_key = create_key(tmp / "chat.db")  # the SDK always sends a key, so it must be real
        yield proc


def create_key(db) -> str:
    out = subprocess.run(
        [sys.executable, "server.py", "keys", "create", "--org", "e2e", "--tier", "enterprise", "--db", str(db)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return next(line for line in out.splitlines() if line.startswith("sk-"))


def hf_greedy(model_dir, messages, max_new_tokens: int) -> tuple[str, int]:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template(messages))
    new = hf_continue(model_dir, ids, max_new_tokens, list(tok.eos_token_ids))
    if new and new[-1] in tok.eos_token_ids:
        new = new[:-1]
    return tok.decode(new), len(new)


def hf_continue(model_dir, ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of token ids (an id past the vocabulary: never stops)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_ids,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def client_for(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_openai_sdk_non_streaming_greedy_equals_transformers(server, tiny_model_dir):
    client = client_for(server)
    name = tiny_model_dir.name
    resp = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=24)
    expected, num_tokens = hf_greedy(tiny_model_dir, QUESTION, 24)
    assert resp.choices[0].message.content == expected
    assert resp.usage.completion_tokens == num_tokens or resp.choices[0].finish_reason == "stop"
    assert resp.model == name and resp.id.startswith("chatcmpl-")


def test_openai_sdk_streaming_joins_to_the_same_text(server, tiny_model_dir):
    client = client_for(server)
    stream = client.chat.completions.create(
        model=tiny_model_dir.name,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    expected, _ = hf_greedy(tiny_model_dir, QUESTION, 24)
    assert "".join(parts) == expected
    assert finish in ("stop", "length") and usage.completion_tokens > 0


def test_openai_sdk_legacy_completions_continue_the_raw_prompt(server, tiny_model_dir):
    """`client.completions.create`: the prompt without a chat template, streamed or not, as
    transformers continues its tokens."""
    client = client_for(server)
    tok = Tokenizer.from_dir(tiny_model_dir)
    prompt = "The old mill by the river"
    ids = tok.encode_prompt(prompt)
    expected = tok.decode(hf_continue(tiny_model_dir, ids, 12, [10**9]))
    extra = {"extra_body": {"ignore_eos": True}}
    resp = client.completions.create(model=tiny_model_dir.name, prompt=prompt, temperature=0, max_tokens=12, **extra)
    assert resp.choices[0].text == expected and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12
    stream = client.completions.create(
        model=tiny_model_dir.name, prompt=prompt, temperature=0, max_tokens=12, stream=True, **extra
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_openai_sdk_sees_api_errors_as_exceptions(server, tiny_model_dir):
    import openai

    client = client_for(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=tiny_model_dir.name, messages=QUESTION, temperature=5)
    assert info.value.body["param"] == "temperature"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_sse_lines_ending_with_done(server, tiny_model_dir):
    body = json.dumps(
        {"model": tiny_model_dir.name, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    out = subprocess.run(
        ["curl", "-sN", server.base_url + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    frames = [f for f in out.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert all(f.startswith(("data: ", ": ")) for f in frames)
    assert '"role":"assistant"' in frames[0]


def test_sigterm_lets_a_running_stream_finish_then_exits(tiny_model_dir, tmp_path):
    import urllib.request

    from tests.e2e.test_durability import write_config

    # The fake backend at 50 ms a token makes a stream last about 3 s: long enough to
    # still be running when SIGTERM arrives, well inside the 20 s grace period.
    proc = ServerProcess(
        [
            "--config",
            write_config(tmp_path, tiny_model_dir),
            "--db",
            str(tmp_path / "chat.db"),
            "--set",
            "server.shutdown_grace_s=20",
        ],
        fake=FakeBehaviour(token_delay_s=0.05),
        log_path=tmp_path / "server.log",
    ).start()
    result: dict = {}

    def run_stream():
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": " ".join(["w"] * 60)}]}
        req = urllib.request.Request(
            proc.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            result["text"] = resp.read().decode()

    thread = threading.Thread(target=run_stream)
    thread.start()
    time.sleep(1.0)
    code = proc.terminate(timeout_s=40)
    thread.join(30)
    assert code == 0
    assert result["text"].rstrip().endswith("data: [DONE]")
    assert result["text"].count('"content":"w') + result["text"].count('"content":" w') == 60


def test_sigterm_cuts_a_stream_longer_than_the_grace_with_an_error_event_and_bills_it(tiny_model_dir, tmp_path):
    import sqlite3

    from tests.e2e.test_durability import write_config

    grace_s = 2.0
    db = tmp_path / "chat.db"
    proc = ServerProcess(
        [
            "--config",
            write_config(tmp_path, tiny_model_dir),
            "--db",
            str(db),
            "--set",
            f"server.shutdown_grace_s={grace_s}",
        ],
        fake=FakeBehaviour(token_delay_s=0.05),
        log_path=tmp_path / "server.log",
    ).start()
    result, thread = _long_stream(proc, 200)  # 200 tokens at 50 ms: 10 s, far longer than the grace
    time.sleep(1.0)
    signalled = time.monotonic()
    code = proc.terminate(timeout_s=30)
    exited_after_s = time.monotonic() - signalled
    thread.join(30)
    assert code == 0
    assert exited_after_s < grace_s + 5.0, exited_after_s  # not twice the grace, as aiohttp's run_app took
    frames = [f for f in result["text"].split("\n\n") if f]
    assert json.loads(frames[-1].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert "data: [DONE]" not in frames
    num_streamed = result["text"].count('"content":"w') + result["text"].count('"content":" w')
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT status, completion_tokens FROM usage WHERE request_id = ?", (result["request_id"],)
        ).fetchall()
    assert rows and rows[0][0] == "aborted" and rows[0][1] >= num_streamed > 0  # billed for what was generated


def test_after_sigterm_and_a_restart_the_first_request_is_warm(tiny_model_dir, tmp_path):
    import urllib.request

    # engine.prefix_cache_dir ("auto": prefix-cache/ beside the database): written at the
    # graceful stop that SIGTERM starts, read back by the next process before it serves.
    argv = ["--model", str(tiny_model_dir), "--db", str(tmp_path / "chat.db"), "--set", "safety.enabled=false"]
    argv += ["--set", "engine.kv_cache_bytes=8000000"]
    body = {"model": "tiny-llama", "messages": [{"role": "system", "content": "Be brief. " * 20}, *QUESTION]}
    body.update(max_tokens=4, temperature=0)

    def cached_tokens(proc: ServerProcess) -> tuple[int, int]:
        req = urllib.request.Request(
            proc.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            usage = json.loads(resp.read())["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    first = ServerProcess(argv, log_path=tmp_path / "first.log").start()
    cold, num_prompt = cached_tokens(first)
    assert first.terminate(timeout_s=40) == 0
    assert list((tmp_path / "prefix-cache").glob("*.safetensors"))
    with ServerProcess(argv, log_path=tmp_path / "second.log") as second:
        warm, _ = cached_tokens(second)
    assert cold == 0 and warm == (num_prompt - 1) // 16 * 16
    assert "prefix_cache_restored" in (tmp_path / "second.log").read_text()


def test_a_second_signal_ends_the_grace_at_once(tiny_model_dir, tmp_path):
    """Ctrl-C pressed again while a long grace runs: the running answers are cut now (an error
    event, billed as when the grace runs out) and the server stops in seconds."""
    import sqlite3

    from tests.e2e.test_durability import write_config

    db = tmp_path / "chat.db"
    proc = ServerProcess(
        ["--config", write_config(tmp_path, tiny_model_dir), "--db", str(db), "--set", "server.shutdown_grace_s=120"],
        fake=FakeBehaviour(token_delay_s=0.05),
        log_path=tmp_path / "server.log",
    ).start()
    result, thread = _long_stream(proc, 400)  # 400 tokens at 50 ms: 20 s
    time.sleep(1.0)
    assert proc.proc is not None
    signalled = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.proc.send_signal(signal.SIGINT)
    code = proc.proc.wait(30)
    exited_after_s = time.monotonic() - signalled
    thread.join(30)
    assert code == 0 and exited_after_s < 10.0, exited_after_s  # not the 120 s grace
    frames = [f for f in result["text"].split("\n\n") if f]
    assert json.loads(frames[-1].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    with sqlite3.connect(db) as con:
        (status,) = con.execute("SELECT status FROM usage WHERE request_id = ?", (result["request_id"],)).fetchone()
    assert status == "aborted"


def test_a_third_signal_while_shutting_down_exits_the_process_at_once():
    """Whatever the shutdown is stuck on, the third signal ends the process (exit status 1)."""
    script = (
        "import asyncio, os, signal\n"
        "from api.runner import _escalate_on_signals\n"
        "async def main():\n"
        "    hurry = _escalate_on_signals(asyncio.get_running_loop())\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    await hurry.wait()\n"
        "    print('hurried', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    await asyncio.sleep(30)  # a shutdown that hangs\n"
        "asyncio.run(main())\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "hurried" in done.stdout and "shutdown_forced" in done.stdout, done.stderr
    assert time.monotonic() - started < 10.0


def _long_stream(proc: ServerProcess, num_words: int) -> tuple[dict, threading.Thread]:
    """A streamed echo of `num_words` words on a thread: its X-Request-Id and body land in the dict."""
    import urllib.request

    result: dict = {}

    def run_stream() -> None:
        words = " ".join(["w"] * num_words)
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": words}]}
        req = urllib.request.Request(
            proc.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            result["request_id"] = resp.headers["X-Request-Id"]
            result["text"] = resp.read().decode()

    thread = threading.Thread(target=run_stream)
    thread.start()
    return result, thread
