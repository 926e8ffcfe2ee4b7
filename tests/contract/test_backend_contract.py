"""The backend contract: what every backend must do, run against each one in `BACKENDS`.

Streaming order, finish reasons, stop strings and the logprobs beside them, abort frees the
request, usage counts, errors and admission checks, through the `Backend` protocol only. Greedy decoding with
EOS ignored keeps the runs deterministic and short on the tiny random model.
"""

from __future__ import annotations

import asyncio

import pytest

from contract_harness import PROMPT_TEXT, check_stream_shape, collect, eventually, joined_text, make_request
from engine.types import EngineError, FinishReason, GenerationRequest, RequestRejected


def prompt_ids(under_test, text: str = PROMPT_TEXT) -> list[int]:
    return under_test.tokenizer.encode(text)


async def test_stream_has_one_final_event_last_and_cumulative_counts_never_decrease(backend_under_test):
    request = make_request(prompt_ids(backend_under_test), max_tokens=12)
    events = await collect(backend_under_test.backend, request)
    final = check_stream_shape(events, request)
    assert final.num_prompt_tokens == len(request.prompt_token_ids)


async def test_max_tokens_ends_with_length_and_counts_every_produced_token(backend_under_test):
    request = make_request(prompt_ids(backend_under_test), max_tokens=7)
    events = await collect(backend_under_test.backend, request)
    final = check_stream_shape(events, request)
    assert final.finish_reason is FinishReason.LENGTH
    assert final.num_completion_tokens == 7
    assert sum(len(e.token_ids) for e in events) == 7


async def test_text_deltas_concatenate_to_the_decoded_completion(backend_under_test):
    request = make_request(prompt_ids(backend_under_test), max_tokens=16)
    events = await collect(backend_under_test.backend, request)
    token_ids = [t for e in events for t in e.token_ids]
    assert joined_text(events) == backend_under_test.tokenizer.decode(token_ids)


async def test_greedy_output_is_the_same_on_a_second_run(backend_under_test):
    prompt = prompt_ids(backend_under_test)
    first = await collect(backend_under_test.backend, make_request(prompt, max_tokens=10))
    second = await collect(backend_under_test.backend, make_request(prompt, max_tokens=10))
    assert joined_text(first) == joined_text(second)


async def test_stop_string_ends_with_stop_and_is_left_out_of_the_text(backend_under_test):
    backend, prompt = backend_under_test.backend, prompt_ids(backend_under_test)
    reference = joined_text(await collect(backend, make_request(prompt, max_tokens=24)))
    assert len(reference) >= 4, f"the reference completion is too short to pick a stop string: {reference!r}"
    stop = reference[len(reference) // 2 : len(reference) // 2 + 2]
    request = make_request(prompt, max_tokens=24, stop=(stop,))
    events = await collect(backend, request)
    final = check_stream_shape(events, request)
    assert final.finish_reason is FinishReason.STOP
    assert joined_text(events) == reference[: reference.find(stop)]
    assert stop not in joined_text(events)


async def test_abort_by_request_id_ends_the_stream_with_abort_and_frees_the_request(backend_under_test):
    backend = backend_under_test.backend
    request = make_request(prompt_ids(backend_under_test), max_tokens=400)
    events = []
    async for event in backend.generate(request):
        events.append(event)
        if len(events) == 2:
            backend.abort(request.request_id)
    final = check_stream_shape(events, request)
    assert final.finish_reason is FinishReason.ABORT
    assert final.num_completion_tokens < 400
    assert await eventually(lambda: backend.stats().num_running == 0)
    assert backend.has_room()


async def test_closing_the_stream_early_aborts_and_frees_the_request(backend_under_test):
    backend = backend_under_test.backend
    stream = backend.generate(make_request(prompt_ids(backend_under_test), max_tokens=400))
    await anext(stream)
    assert backend.stats().num_running + backend.stats().num_waiting == 1
    await stream.aclose()
    assert await eventually(lambda: backend.stats().num_running == 0)
    assert backend.has_room()


async def test_cancelling_the_consumer_task_frees_the_request(backend_under_test):
    backend = backend_under_test.backend
    first_event = asyncio.Event()

    async def consume() -> None:
        async for _ in backend.generate(make_request(prompt_ids(backend_under_test), max_tokens=400)):
            first_event.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_event.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await eventually(lambda: backend.stats().num_running == 0)


async def test_abort_of_an_unknown_or_finished_request_is_harmless(backend_under_test):
    backend = backend_under_test.backend
    backend.abort("no-such-request")
    request = make_request(prompt_ids(backend_under_test), max_tokens=3)
    await collect(backend, request)
    backend.abort(request.request_id)
    final = check_stream_shape(await collect(backend, make_request(request.prompt_token_ids, max_tokens=3)), request)
    assert final.finish_reason is FinishReason.LENGTH


async def test_injected_failure_raises_engine_error_and_the_next_request_is_served(backend_under_test):
    backend, prompt = backend_under_test.backend, prompt_ids(backend_under_test)
    backend_under_test.inject_failure()
    with pytest.raises(EngineError):
        await collect(backend, make_request(prompt, max_tokens=5))
    assert await eventually(lambda: backend.stats().num_running == 0)
    request = make_request(prompt, max_tokens=5)
    final = check_stream_shape(await collect(backend, request), request)
    assert final.finish_reason is FinishReason.LENGTH
    assert backend.health()


async def test_check_request_rejects_a_prompt_longer_than_max_model_len(backend_under_test):
    backend = backend_under_test.backend
    too_long = make_request([5] * (backend.max_model_len + 1), max_tokens=1)
    with pytest.raises(RequestRejected):
        backend.check_request(too_long)
    backend.check_request(make_request(prompt_ids(backend_under_test), max_tokens=4))


async def test_concurrent_requests_stream_independently(backend_under_test):
    backend, prompt = backend_under_test.backend, prompt_ids(backend_under_test)
    other = prompt_ids(backend_under_test, "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    requests: list[GenerationRequest] = [
        make_request(prompt, max_tokens=9),
        make_request(prompt, max_tokens=9),
        make_request(other, max_tokens=5),
    ]
    results = await asyncio.gather(*(collect(backend, r) for r in requests))
    finals = [check_stream_shape(events, r) for events, r in zip(results, requests, strict=True)]
    assert [f.num_completion_tokens for f in finals] == [9, 9, 5]
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals)
    assert joined_text(results[0]) == joined_text(results[1])
    assert await eventually(lambda: backend.stats().num_running == 0)


async def test_health_is_true_while_serving_and_stats_count_generated_tokens(backend_under_test):
    backend = backend_under_test.backend
    assert backend.health()
    before = backend.stats().num_generation_tokens
    await collect(backend, make_request(prompt_ids(backend_under_test), max_tokens=6))
    assert backend.stats().num_generation_tokens - before >= 6


def _content_tokens(tokenizer, token_ids: list[int], content: str) -> list[int]:
    """The shortest run of the generated tokens whose text holds the whole content: the tokens whose
    text contributes to it (one straddling its end included), none past it."""
    for n in range(len(token_ids) + 1):
        if tokenizer.decode(token_ids[:n]).startswith(content):
            return token_ids[:n]
    raise AssertionError(f"the tokens never spell the content {content!r}")


async def test_logprobs_cover_exactly_the_tokens_of_the_text_a_stop_string_cuts(backend_under_test):
    """A stop string inside a token or across tokens: the logprobs sent are those of the tokens
    whose text is in the content, the one it cuts included, none of the stop string's own or after."""
    backend, tokenizer = backend_under_test.backend, backend_under_test.tokenizer
    prompt = prompt_ids(backend_under_test)
    reference = await collect(backend, make_request(prompt, max_tokens=24, logprobs=0))
    ids, text = [t for e in reference for t in e.token_ids], joined_text(reference)
    assert [lp.token for e in reference for lp in e.logprobs] == ids  # no stop string: every token's
    for start in range(1, min(len(text) - 2, 16)):
        stop = text[start : start + 2]
        events = await collect(backend, make_request(prompt, max_tokens=24, logprobs=0, stop=(stop,)))
        content = joined_text(events)
        assert content == text[: text.find(stop)], stop
        sent = [lp.token for e in events for lp in e.logprobs]
        assert sent == _content_tokens(tokenizer, ids, content), (stop, content)
