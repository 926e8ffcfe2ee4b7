"""The TensorRT-LLM adapter beyond the shared contract, driving the stand-in `tensorrt_llm`.

How the LLM is built, what each submission carries, the in-flight cap, unconfirmed aborts,
stop strings TensorRT-LLM misses, executor death, stats, shutdown, and the optional import.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from contract_harness import PROMPT_TEXT, check_stream_shape, collect, eventually, joined_text, make_request
from engine.tokenizer import Tokenizer
from engine.trtllm.backend import BackendState, TrtllmBackend
from engine.types import EngineError, FinishReason, RequestRejected
from settings import ConfigError, TrtllmConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# 40 distinct-ish words: enough tokens for a full 32-token block in the prefix cache.
LONG_PROMPT = PROMPT_TEXT + " ".join(["the quick brown fox jumps over the lazy dog"] * 5)


@pytest.fixture
async def start_trtllm(standin_trtllm, tiny_model_dir):
    started: list[TrtllmBackend] = []

    async def start(**config) -> TrtllmBackend:
        config = {"max_batch_size": 8, "max_num_tokens": 256, "stats_interval_s": 0.05, **config}
        backend = TrtllmBackend(
            tiny_model_dir, TrtllmConfig(**config), Tokenizer.from_dir(tiny_model_dir), max_model_len=512
        )
        await backend.start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        await backend.shutdown()


def ids(backend: TrtllmBackend, text: str = PROMPT_TEXT) -> list[int]:
    return backend._tokenizer.encode(text)


async def test_llm_is_built_off_the_event_loop_thread_from_the_config(start_trtllm, standin_trtllm):
    backend = await start_trtllm(
        scheduler_policy="max_utilization",
        kv_cache_free_gpu_memory_fraction=0.5,
        enable_chunked_prefill=False,
        max_batch_size=16,
    )
    llm = backend._llm
    assert llm.built_on_thread != threading.current_thread().name
    assert (llm.args.max_batch_size, llm.args.max_num_tokens, llm.args.max_seq_len) == (16, 256, 512)
    assert llm.args.kv_cache_config.free_gpu_memory_fraction == 0.5
    assert llm.args.scheduler_config.capacity_scheduler_policy.name == "MAX_UTILIZATION"
    assert llm.args.enable_iter_perf_stats is True and llm.args.enable_chunked_prefill is False


async def test_each_request_gets_fresh_sampling_params_token_ids_and_streaming(start_trtllm):
    backend = await start_trtllm()
    prompt = ids(backend)
    await collect(backend, make_request(prompt, max_tokens=4, min_tokens=2, presence_penalty=0.25))
    await collect(backend, make_request(prompt, max_tokens=5))
    first, second = backend._llm.submissions
    assert first.sampling_params is not second.sampling_params
    assert (first.sampling_params.max_tokens, second.sampling_params.max_tokens) == (4, 5)
    assert (first.sampling_params.min_tokens, first.sampling_params.presence_penalty) == (2, 0.25)
    assert first.inputs == prompt and first.streaming is True
    assert first.thread_name == threading.current_thread().name  # submitted from the loop thread


async def test_cache_salt_separates_prefix_cache_hits_between_organisations(start_trtllm):
    backend = await start_trtllm()
    prompt = ids(backend, LONG_PROMPT)
    assert len(prompt) >= 40
    await collect(backend, make_request(prompt, max_tokens=2, cache_salt="org-a"))
    same_org = await collect(backend, make_request(prompt, max_tokens=2, cache_salt="org-a"))
    other_org = await collect(backend, make_request(prompt, max_tokens=2, cache_salt="org-b"))
    assert same_org[-1].num_cached_tokens > 0
    assert other_org[-1].num_cached_tokens == 0
    assert backend._llm.submissions[0].cache_salt == "org-a"
    stats = backend.stats()
    assert stats.prefix_cache_hits == same_org[-1].num_cached_tokens
    assert stats.prefix_cache_queries == 3 * len(prompt)


async def test_cache_salt_is_left_out_where_generate_async_does_not_take_it(start_trtllm, standin_trtllm, monkeypatch):
    from standin_tensorrt_llm.llm import LLMWithoutCacheSalt

    monkeypatch.setattr(standin_trtllm, "LLM", LLMWithoutCacheSalt)
    backend = await start_trtllm()
    final = (await collect(backend, make_request(ids(backend), max_tokens=3, cache_salt="org-a")))[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert backend._llm.submissions[0].cache_salt is None


async def test_in_flight_cap_turns_has_room_false_and_holds_the_next_request_back(start_trtllm):
    backend = await start_trtllm(max_in_flight=2)
    prompt = ids(backend)
    streams = [backend.generate(make_request(prompt, max_tokens=400)) for _ in range(2)]
    for stream in streams:
        await anext(stream)
    assert not backend.has_room()
    third = asyncio.create_task(collect(backend, make_request(prompt, max_tokens=3)))
    await asyncio.sleep(0.05)
    assert len(backend._llm.submissions) == 2 and not third.done()
    await streams[0].aclose()
    events = await asyncio.wait_for(third, 10)
    assert events[-1].finish_reason is FinishReason.LENGTH
    await streams[1].aclose()
    assert backend.has_room()


async def test_an_abort_trtllm_never_confirms_still_ends_the_stream_and_frees_the_slot(start_trtllm):
    backend = await start_trtllm()
    backend.abort_grace_s = 0.2
    backend._llm.standin.max_batch_size = 1
    backend._llm.standin.drop_queued_aborts = True  # TensorRT-LLM before the #9280 fix
    prompt = ids(backend)
    running = backend.generate(make_request(prompt, max_tokens=400))
    await anext(running)
    queued_request = make_request(prompt, max_tokens=5)
    queued = asyncio.create_task(collect(backend, queued_request))
    assert await eventually(lambda: len(backend._llm.submissions) == 2)
    backend.abort(queued_request.request_id)
    events = await asyncio.wait_for(queued, 10)
    assert [e.finish_reason for e in events] == [FinishReason.ABORT]
    await running.aclose()
    assert await eventually(lambda: backend.stats().num_running == 0)


async def test_stop_strings_are_cut_exactly_whether_or_not_trtllm_matches_them_on_tokens(start_trtllm):
    backend = await start_trtllm()
    prompt = ids(backend)
    reference = joined_text(await collect(backend, make_request(prompt, max_tokens=30)))
    for start in range(1, min(len(reference) - 2, 16)):
        stop = reference[start : start + 2]
        request = make_request(prompt, max_tokens=30, stop=(stop,))
        events = await collect(backend, request)
        final = check_stream_shape(events, request)
        assert final.finish_reason is FinishReason.STOP, stop
        assert joined_text(events) == reference[: reference.find(stop)], stop
    assert await eventually(lambda: backend.stats().num_running == 0)


async def test_a_dead_executor_fails_requests_with_engine_error_and_turns_health_false(start_trtllm):
    backend = await start_trtllm()
    stream = backend.generate(make_request(ids(backend), max_tokens=400))
    await anext(stream)
    backend._llm.standin.kill("CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineError, match="illegal memory access"):
        async for _ in stream:
            pass
    with pytest.raises(EngineError):
        await collect(backend, make_request(ids(backend), max_tokens=3))
    assert not backend.health() and backend.state is BackendState.FAILED
    assert backend.stats().num_running == 0


async def test_the_prompts_logprobs_are_refused_naming_echo(start_trtllm):
    backend = await start_trtllm()
    request = make_request(ids(backend)[:6], max_tokens=1)
    request = replace(request, sampling=replace(request.sampling, prompt_logprobs=1))
    with pytest.raises(RequestRejected, match="native engine only") as exc:
        backend.check_request(request)
    assert exc.value.param == "echo"


async def test_a_prompt_trtllm_refuses_is_rejected_and_the_backend_keeps_serving(start_trtllm):
    backend = await start_trtllm(enable_chunked_prefill=False, max_num_tokens=8)
    long_request = make_request(ids(backend), max_tokens=3)
    with pytest.raises(RequestRejected, match="max_num_tokens"):
        backend.check_request(long_request)
    with pytest.raises(RequestRejected):  # TensorRT-LLM's own ValueError, if check_request was skipped
        await collect(backend, long_request)
    final = (await collect(backend, make_request(ids(backend)[:6], max_tokens=3)))[-1]
    assert final.finish_reason is FinishReason.LENGTH and backend.health()


async def test_stats_come_from_the_iteration_stats_drain(start_trtllm):
    backend = await start_trtllm()
    await collect(backend, make_request(ids(backend), max_tokens=5))
    assert await eventually(lambda: backend.stats().num_kv_blocks_total == 4096)
    stats = backend.stats()
    assert stats.num_kv_blocks_free <= 4096
    assert stats.num_generation_tokens == 5


async def test_shutdown_ends_open_streams_with_abort_and_shuts_the_llm_down(start_trtllm):
    backend = await start_trtllm()
    request = make_request(ids(backend), max_tokens=400)
    stream = backend.generate(request)
    events = [await anext(stream)]
    await backend.shutdown()
    events += [event async for event in stream]
    assert check_stream_shape(events, request).finish_reason is FinishReason.ABORT
    assert backend._llm.is_shut_down and not backend.health()


async def test_generate_before_start_is_an_engine_error(tiny_model_dir):
    backend = TrtllmBackend(tiny_model_dir, TrtllmConfig(), Tokenizer.from_dir(tiny_model_dir), max_model_len=512)
    assert not backend.has_room()
    with pytest.raises(EngineError, match="not serving"):
        await collect(backend, make_request([1, 2, 3]))


async def test_start_without_tensorrt_llm_installed_is_a_config_error(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed, even where it is
    backend = TrtllmBackend(tiny_model_dir, TrtllmConfig(), Tokenizer.from_dir(tiny_model_dir), max_model_len=512)
    with pytest.raises(ConfigError, match=r"docs/trtllm\.md"):
        await backend.start()


def test_unknown_scheduler_policy_or_unknown_context_length_is_a_config_error(tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    with pytest.raises(ConfigError, match="scheduler_policy"):
        TrtllmBackend(tiny_model_dir, TrtllmConfig(scheduler_policy="fifo"), tokenizer, max_model_len=512)
    with pytest.raises(ConfigError, match="max_seq_len"):
        TrtllmBackend(tiny_model_dir, TrtllmConfig(), tokenizer, max_model_len=None)


def test_the_server_side_imports_never_import_tensorrt_llm(tiny_model_dir):
    code = (
        "import sys; from engine.registry import build_model; from settings import ModelConfig, Settings; "
        f"h = build_model('m', ModelConfig(path={str(tiny_model_dir)!r}, backend='trtllm'), Settings()); "
        "assert type(h.backend).__name__ == 'TrtllmBackend'; assert 'tensorrt_llm' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_adapter_streams_under_uvloop(standin_trtllm, tiny_model_dir):
    import uvloop

    async def main() -> list:
        backend = TrtllmBackend(
            tiny_model_dir, TrtllmConfig(stats_interval_s=0.05), Tokenizer.from_dir(tiny_model_dir), max_model_len=512
        )
        await backend.start()
        try:
            return await collect(backend, make_request(ids(backend), max_tokens=6))
        finally:
            await backend.shutdown()

    events = uvloop.run(main())
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].num_completion_tokens == 6


async def test_aborting_a_request_that_waits_for_a_slot_ends_it_at_once_unsubmitted(start_trtllm):
    backend = await start_trtllm(max_in_flight=1)
    prompt = ids(backend)
    running = backend.generate(make_request(prompt, max_tokens=400))
    await anext(running)
    waiting_request = make_request(prompt, max_tokens=3)
    waiting = asyncio.create_task(collect(backend, waiting_request))
    await asyncio.sleep(0.05)
    backend.abort(waiting_request.request_id)
    events = await asyncio.wait_for(waiting, 5)
    assert [(e.finish_reason, e.num_completion_tokens) for e in events] == [(FinishReason.ABORT, 0)]
    assert len(backend._llm.submissions) == 1
    await running.aclose()
    assert backend.has_room()


async def test_shutdown_turns_away_requests_waiting_for_a_slot(start_trtllm):
    backend = await start_trtllm(max_in_flight=1)
    running = backend.generate(make_request(ids(backend), max_tokens=400))
    await anext(running)
    waiting = asyncio.create_task(collect(backend, make_request(ids(backend), max_tokens=3)))
    await asyncio.sleep(0.05)
    await backend.shutdown()
    assert (await asyncio.wait_for(waiting, 5))[-1].finish_reason is FinishReason.ABORT
    await running.aclose()


async def test_stats_keep_flowing_after_an_idle_period_ends_the_stats_iterator(start_trtllm):
    backend = await start_trtllm(stats_interval_s=0.05)
    await collect(backend, make_request(ids(backend), max_tokens=3))
    assert await eventually(lambda: backend.stats().num_kv_blocks_free == 4096)
    await asyncio.sleep(0.3)  # idle: get_stats_async times out and stays ended until a new submission
    stream = backend.generate(make_request(ids(backend), max_tokens=400))
    await anext(stream)
    assert await eventually(lambda: backend.stats().num_kv_blocks_free < 4096)
    await stream.aclose()


async def test_a_logit_bias_is_refused_naming_it(start_trtllm):
    backend = await start_trtllm()
    request = make_request(ids(backend)[:6], max_tokens=1)
    request = replace(request, sampling=replace(request.sampling, logit_bias=((3, -100.0),)))
    with pytest.raises(RequestRejected, match="native engine only") as exc:
        backend.check_request(request)
    assert exc.value.param == "logit_bias"
