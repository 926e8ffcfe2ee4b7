"""NativeBackend: concurrent requests batched in the step thread, text and stop strings, and
every way a request can end early (aclose, cancellation, abort, shutdown) freeing its blocks."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.native.backend import NativeBackend
from engine.native.loader import ModelLoadError
from engine.tokenizer import Tokenizer
from engine.torch_threads import PoolOwner, PoolOwnerExecutor
from engine.types import FinishReason, GenerationRequest, RequestRejected, SamplingParams
from native_harness import ON_DEVICE
from settings import EngineConfig

VARIANT = "tied-gqa-parameters"


@pytest.fixture
async def backend(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    config = EngineConfig(**ON_DEVICE, kv_cache_bytes=24 * 8192, max_num_seqs=8, max_num_batched_tokens=64)
    backend = NativeBackend(model_dir, config, Tokenizer.from_dir(model_dir))
    await backend.start()
    yield backend
    await backend.shutdown()


def request(request_id: str, prompt: list[int], max_tokens: int = 16, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True, **sampling})
    return GenerationRequest(request_id, tuple(prompt), params)


async def collect(backend: NativeBackend, req: GenerationRequest):
    return [event async for event in backend.generate(req)]


async def wait_until_idle(backend: NativeBackend) -> None:
    async def idle():
        while True:
            s = backend.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_free == s.num_kv_blocks_total:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(idle(), timeout=30)
    assert backend.engine.num_requests == 0


async def test_concurrent_requests_are_batched_and_match_transformers(backend, tiny_models):
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    results = await asyncio.gather(*(collect(backend, request(f"r{i}", p)) for i, p in enumerate(prompts)))
    for prompt, events in zip(prompts, results, strict=True):
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == tiny_models.greedy(VARIANT, prompt, 16, None)
        assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].num_completion_tokens == 16
        assert [e.num_completion_tokens for e in events] == list(range(1, 17))
    assert backend.engine.num_steps < 6 * 16  # steps carried several sequences at once
    await wait_until_idle(backend)


async def test_streamed_text_is_the_decoded_completion(backend, tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models.path(VARIANT))
    prompt = tokenizer.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    events = await collect(backend, request("t", prompt, max_tokens=24))
    tokens = [t for e in events for t in e.token_ids]
    assert "".join(e.text for e in events) == tokenizer.decode(tokens)


async def test_stop_string_ends_the_stream_without_the_stop_text(backend, tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models.path(VARIANT))
    prompt = [40, 41, 42, 43]
    events = await collect(backend, request("full", prompt, max_tokens=24))
    full = "".join(e.text for e in events)
    streamed = "".join(e.text for e in events[:-1])  # random weights: the final flush may be broken bytes
    stop = streamed[len(streamed) // 2 : len(streamed) // 2 + 2]
    assert len(stop) == 2, "the continuation should have text to stop on"
    events = await collect(backend, request("stopped", prompt, max_tokens=24, stop=(stop,)))
    assert events[-1].finish_reason is FinishReason.STOP
    assert "".join(e.text for e in events) == full[: full.index(stop)]
    assert len(events) < 24 and stop not in tokenizer.decode([t for e in events for t in e.token_ids][:-1])
    await wait_until_idle(backend)


async def test_closing_the_iterator_aborts_and_frees_blocks(backend):
    stream = backend.generate(request("closed", list(range(3, 60)), max_tokens=300))
    first = await stream.__anext__()
    assert first.num_completion_tokens == 1
    await stream.aclose()
    await wait_until_idle(backend)


async def test_cancelling_the_consumer_aborts_and_frees_blocks(backend):
    started = asyncio.Event()

    async def consume():
        async for _ in backend.generate(request("cancelled", list(range(3, 40)), max_tokens=300)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(backend)


async def test_abort_by_id_ends_the_stream_with_abort(backend):
    stream = backend.generate(request("aborted", [7, 8, 9], max_tokens=300))
    await stream.__anext__()
    backend.abort("aborted")
    rest = [e async for e in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    await wait_until_idle(backend)


async def test_request_larger_than_the_whole_cache_is_rejected_with_numbers(backend):
    capacity = backend.stats().num_kv_blocks_total * 16
    too_big = request("big", [5] * 100, max_tokens=capacity)
    assert 100 + capacity <= 512  # within the context window: the cache refuses it
    assert backend.max_model_len == min(512, capacity + 1)  # what the API sizes requests by
    with pytest.raises(RequestRejected, match=rf"needs {100 + capacity} tokens.*holds {capacity}"):
        backend.check_request(too_big)
    with pytest.raises(RequestRejected, match="context window is 512"):
        backend.check_request(request("long", [5] * 500, max_tokens=100))


async def test_has_room_until_batch_slots_are_taken(backend):
    assert backend.has_room()
    streams = [backend.generate(request(f"s{i}", [9, i + 3], max_tokens=300)) for i in range(8)]
    for s in streams:
        await s.__anext__()
    assert not backend.has_room()
    for s in streams:
        await s.aclose()
    await wait_until_idle(backend)
    assert backend.has_room()


async def test_shutdown_ends_in_flight_streams_with_abort(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    backend = NativeBackend(model_dir, EngineConfig(**ON_DEVICE, kv_cache_bytes=1 << 20), Tokenizer.from_dir(model_dir))
    await backend.start()
    stream = backend.generate(request("inflight", [3, 4, 5], max_tokens=300))
    await stream.__anext__()
    await backend.shutdown()
    rest = [e async for e in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert not backend.has_room()


async def test_next_chat_turn_reuses_the_previous_turns_blocks(backend, tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models.path(VARIANT))
    messages = [
        {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 3},
        {"role": "user", "content": "What does the word river mean?"},
    ]
    first_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    first = await collect(backend, request("turn1", first_prompt, max_tokens=12))
    messages += [
        {"role": "assistant", "content": "".join(e.text for e in first)},
        {"role": "user", "content": "And the sea?"},
    ]
    second_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert second_prompt[: len(first_prompt)] == first_prompt  # the history renders byte-stably
    second = await collect(backend, request("turn2", second_prompt, max_tokens=4))
    assert second[-1].num_cached_tokens >= len(first_prompt) // 16 * 16 > 0


async def test_the_model_loads_and_steps_in_one_thread(backend):
    import threading

    seen = []
    engine = backend.engine
    original = engine.step

    def step():
        seen.append(threading.get_ident())
        return original()

    engine.step = step
    await collect(backend, request("t", [5, 6, 7], max_tokens=3))
    assert set(seen) == {backend._stepper.thread.ident} and backend._stepper.thread.ident != threading.get_ident()


async def test_a_model_that_fails_to_load_fails_start_and_leaves_no_thread(tmp_path, tiny_models):
    import threading

    model_dir = tiny_models.path(VARIANT)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    backend = NativeBackend(broken, EngineConfig(**ON_DEVICE, kv_cache_bytes=24 * 8192), Tokenizer.from_dir(model_dir))
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        await backend.start()
    assert backend._stepper is None and backend.engine is None and not backend.has_room()
    await backend.shutdown()  # still safe
    await asyncio.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name.startswith("native-engine-step")]


async def test_engines_on_one_device_share_one_step_thread_which_ends_with_the_last(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    config = EngineConfig(**ON_DEVICE, kv_cache_bytes=24 * 8192, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = (NativeBackend(model_dir, config, Tokenizer.from_dir(model_dir)) for _ in range(2))
    await first.start()
    await second.start()
    assert first._stepper is second._stepper and first._stepper.thread.is_alive()
    a, b = await asyncio.gather(
        collect(first, request("a", [5, 6, 7], max_tokens=6)), collect(second, request("b", [5, 6, 7], max_tokens=6))
    )
    assert [e.token_ids for e in a] == [e.token_ids for e in b]  # same model, same prompt, interleaved steps
    thread = first._stepper.thread
    await first.shutdown()
    assert thread.is_alive() and second.health()
    assert len(await collect(second, request("c", [8, 9], max_tokens=4))) == 4
    await second.shutdown()
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive()


async def test_a_start_cancelled_while_loading_leaves_no_engine_in_the_step_thread(tiny_models, monkeypatch):
    from engine.native import backend as backend_module

    # The load is held until start() has been cancelled, so the cancel lands mid-load every time
    # (a short wait_for timeout raced the load and sometimes lost on a quiet machine).
    entered, release = threading.Event(), threading.Event()
    real_from_model_dir = backend_module.LLMEngine.from_model_dir

    def held_load(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real_from_model_dir(*args, **kwargs)

    monkeypatch.setattr(backend_module.LLMEngine, "from_model_dir", held_load)
    model_dir = tiny_models.path(VARIANT)
    backend = NativeBackend(
        model_dir, EngineConfig(**ON_DEVICE, kv_cache_bytes=24 * 8192), Tokenizer.from_dir(model_dir)
    )
    starting = asyncio.ensure_future(backend.start())
    assert await asyncio.to_thread(entered.wait, 30)  # the step thread is loading
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    release.set()
    for _ in range(100):  # the load finishes, reads the _Stop left for it, and the thread ends
        if not [t for t in threading.enumerate() if t.name.startswith("native-engine-step")]:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the step thread kept the cancelled engine")
    assert backend._stopped.is_set() or backend.engine is None


async def test_side_work_runs_on_the_cpu_step_thread_between_steps_and_elsewhere_after_shutdown(tiny_models):
    # The safety classifier hands its batches to PoolOwnerExecutor: while a native CPU engine
    # runs they run on its step thread (its OpenMP pool), also while requests are decoding.
    # A CPU engine whatever TEST_DEVICE is: an engine on CUDA owns no CPU pool.
    model_dir = tiny_models.path(VARIANT)
    config = EngineConfig(device="cpu", kv_cache_bytes=24 * 8192, max_num_seqs=8, max_num_batched_tokens=64)
    backend = NativeBackend(model_dir, config, Tokenizer.from_dir(model_dir))
    await backend.start()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, "fallback") as fallback:
        executor = PoolOwnerExecutor(lambda: fallback)
        try:
            generating = asyncio.ensure_future(collect(backend, request("r", [5] * 9, max_tokens=32)))
            names = await asyncio.gather(
                *(loop.run_in_executor(executor, lambda: threading.current_thread().name) for _ in range(4))
            )
            assert set(names) == {"native-engine-step-cpu"}
            assert len(await generating) == 32
        finally:
            await backend.shutdown()
        for _ in range(500):  # the step thread runs what it still holds, then leaves
            if not (probe := PoolOwner.post(lambda: None)):
                break
            probe.result(timeout=5)
            await asyncio.sleep(0.01)
        assert (await loop.run_in_executor(executor, lambda: threading.current_thread().name)).startswith("fallback")


def _logprob_stream(tokenizer: Tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()):
    """Feed a _Stream one token per step, as the engine would (the last one finishing with STOP);
    returns (the text sent, the token ids whose logprobs were sent)."""
    from engine.native.backend import _Stream
    from engine.native.llm_engine import RequestOutput
    from engine.types import TokenLogprob

    stream = _Stream(request("lp", [40, 41], logprobs=0, stop=stop), tokenizer)
    text, sent = "", []
    for i, token in enumerate(token_ids):
        last = i == len(token_ids) - 1
        out = RequestOutput(
            "lp", (token,), 2, 0, i + 1, FinishReason.STOP if last else None, (TokenLogprob(token, -0.5),)
        )
        event = stream.advance(out)
        text += event.text
        sent += [lp.token_id for lp in event.logprobs]
        if event.finish_reason is not None:
            break
    return text, sent


def test_logprobs_go_out_with_their_text_never_for_a_final_eos_or_past_a_stop_string(tiny_models):
    """The API's logprobs list the tokens of the content (OpenAI's shape): joining their text gives
    the content. The EOS that ended an answer and tokens after a stop string's start were listed."""
    tokenizer = Tokenizer.from_dir(tiny_models.path(VARIANT))
    words = tokenizer.encode("the river runs down to the sea")
    eos = tokenizer.encode("<|im_end|>")
    assert len(eos) == 1 and tokenizer.decode(eos) == ""
    text, sent = _logprob_stream(tokenizer, words + eos)
    assert text == "the river runs down to the sea" and sent == words  # not the EOS
    assert tokenizer.decode(sent) == text

    text, sent = _logprob_stream(tokenizer, words + eos, stop=("down",))
    assert text == "the river runs " and sent == words[: len(sent)]
    # each token sent holds text of the content (the last one may also hold the stop's start), none after it
    assert len(tokenizer.decode(sent[:-1])) < len(text) <= len(tokenizer.decode(sent)) < len(text) + len("down")


async def test_the_step_thread_hands_the_heaps_free_pages_back_once_after_work_then_sleeps(backend, monkeypatch):
    """Steps free large temporaries among long-lived arrays, and glibc keeps such pages: once the
    thread has been idle IDLE_TRIM_S after working it trims the heap, once, and then sleeps."""
    import engine.native.backend as native_backend

    monkeypatch.setattr(native_backend, "IDLE_TRIM_S", 0.05)
    stepper = backend._stepper
    await collect(backend, request("warm", [5, 6, 7], max_tokens=4))
    await _trims_reach(stepper, stepper.num_trims or 1)
    trims = stepper.num_trims
    await asyncio.sleep(0.3)
    assert stepper.num_trims == trims  # nothing ran since: no trim again
    await collect(backend, request("again", [5, 6, 7], max_tokens=4))
    await _trims_reach(stepper, trims + 1)


async def _trims_reach(stepper, count: int) -> None:
    for _ in range(500):
        if stepper.num_trims >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{stepper.num_trims} trims, expected {count}")


async def test_a_step_thread_busy_without_a_pause_still_trims_the_heap_between_steps(backend, monkeypatch):
    """Under constant load no idle second comes: then it trims between two steps every BUSY_TRIM_S."""
    import engine.native.backend as native_backend

    monkeypatch.setattr(native_backend, "IDLE_TRIM_S", 3600.0)  # no idle trim in this test
    monkeypatch.setattr(native_backend, "BUSY_TRIM_S", 0.0)  # a trim after every busy step
    stepper = backend._stepper
    trims = stepper.num_trims
    events = await collect(backend, request("long", [5, 6, 7], max_tokens=24))
    assert sum(len(e.token_ids) for e in events) == 24
    assert stepper.num_trims - trims >= 12  # about one per decode step, while the request ran
