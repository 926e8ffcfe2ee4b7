"""Coalescing identical greedy requests: fan-out, per-waiter usage, leaving, aborting."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.types import EngineError, FinishReason, GenerationRequest, SamplingParams
from gateway.coalesce import Coalescer
from testing.fake_backend import FakeBackend, FakeBehaviour

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
GATED = FakeBehaviour(is_gated=True)  # every event waits for backend.release()


def request(request_id: str, prompt=(1, 2, 3), sampling=GREEDY, cache_salt="org-1") -> GenerationRequest:
    return GenerationRequest(request_id, prompt, sampling, cache_salt=cache_salt)


async def collect(coalescer: Coalescer, backend, req: GenerationRequest) -> list:
    return [event async for event in coalescer.generate(backend, req)]


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_identical_greedy_requests_share_one_generation_and_each_gets_every_event():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    waiters = [asyncio.create_task(collect(coalescer, backend, request(f"r{i}"))) for i in range(3)]
    await settle()
    backend.release(3)
    results = await asyncio.gather(*waiters)
    assert len(backend.requests) == 1
    assert (coalescer.num_generations, coalescer.num_joined, coalescer.num_in_flight) == (1, 2, 0)
    for events in results:  # every waiter is billed for the whole prompt and completion
        assert "".join(e.text for e in events) == "xyz"
        last = events[-1]
        assert (last.num_prompt_tokens, last.num_completion_tokens, last.finish_reason) == (3, 3, FinishReason.LENGTH)


async def test_a_late_joiner_replays_the_events_it_missed():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    first = asyncio.create_task(collect(coalescer, backend, request("r1")))
    await settle()
    backend.release(2)
    await settle()
    late = asyncio.create_task(collect(coalescer, backend, request("r2")))
    await settle()
    backend.release(1)
    assert [e.text for e in await late] == ["x", "y", "z"]
    assert [e.text for e in await first] == ["x", "y", "z"]
    assert len(backend.requests) == 1 and coalescer.num_joined == 1


async def test_a_waiter_that_leaves_does_not_abort_the_others():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    leaver = coalescer.generate(backend, request("r1"))
    stayer = asyncio.create_task(collect(coalescer, backend, request("r2")))
    backend.release(1)
    assert (await leaver.__anext__()).text == "x"
    await leaver.aclose()
    backend.release(2)
    assert [e.text for e in await stayer] == ["x", "y", "z"]
    assert backend.aborted == [] and backend.finished == ["r1"]


async def test_the_generation_is_aborted_when_the_last_waiter_leaves():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    tasks = [asyncio.create_task(collect(coalescer, backend, request(f"r{i}"))) for i in range(2)]
    await settle()
    backend.release(1)
    await settle()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await settle()
    assert backend.aborted == ["r0"]
    assert coalescer.num_in_flight == 0
    # an identical request afterwards starts afresh instead of joining the dead generation
    again = asyncio.create_task(collect(coalescer, backend, request("r9")))
    await settle()
    backend.release(3)
    assert [e.text for e in await again] == ["x", "y", "z"]
    assert [r.request_id for r in backend.requests] == ["r0", "r9"]


async def test_sampled_requests_are_never_coalesced():
    backend = FakeBackend(words=("x",))
    coalescer = Coalescer()
    sampled = SamplingParams(max_tokens=1, temperature=0.7, seed=1)
    await asyncio.gather(*(collect(coalescer, backend, request(f"r{i}", sampling=sampled)) for i in range(3)))
    assert len(backend.requests) == 3


@pytest.mark.parametrize(
    "other",
    [
        request("b", prompt=(1, 2, 4)),
        request("b", cache_salt="org-2"),
        request("b", sampling=SamplingParams(max_tokens=2, temperature=0.0)),
        request("b", sampling=SamplingParams(max_tokens=3, temperature=0.0, stop=("\n",))),
    ],
)
async def test_requests_differing_in_prompt_salt_or_params_get_their_own_generation(other):
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    tasks = [asyncio.create_task(collect(coalescer, backend, r)) for r in (request("a"), other)]
    await settle()
    backend.release(6)
    await asyncio.gather(*tasks)
    assert len(backend.requests) == 2


async def test_a_different_seed_still_coalesces_for_greedy_requests():
    backend = FakeBackend(words=("x",), behaviour=GATED)
    coalescer = Coalescer()
    seeded = SamplingParams(max_tokens=3, temperature=0.0, seed=7)
    tasks = [asyncio.create_task(collect(coalescer, backend, r)) for r in (request("a"), request("b", sampling=seeded))]
    await settle()
    backend.release(1)
    await asyncio.gather(*tasks)
    assert len(backend.requests) == 1


async def test_an_engine_error_reaches_every_waiter():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=FakeBehaviour(fail_after=1))
    coalescer = Coalescer()
    results = await asyncio.gather(
        *(collect(coalescer, backend, request(f"r{i}")) for i in range(2)), return_exceptions=True
    )
    assert all(isinstance(r, EngineError) for r in results)
    assert coalescer.num_in_flight == 0


async def test_a_finished_generation_is_not_joined():
    backend = FakeBackend(words=("x",))
    coalescer = Coalescer()
    await collect(coalescer, backend, request("r1"))
    await collect(coalescer, backend, request("r2"))
    assert len(backend.requests) == 2 and coalescer.num_joined == 0


async def test_leaving_a_sampled_request_early_aborts_it():
    backend = FakeBackend(words=("x", "y", "z"), behaviour=GATED)
    coalescer = Coalescer()
    sampled = SamplingParams(max_tokens=3, temperature=1.0)
    async with contextlib.aclosing(coalescer.generate(backend, request("r1", sampling=sampled))) as events:
        backend.release(1)
        assert (await events.__anext__()).text == "x"
    assert backend.aborted == ["r1"]


async def test_same_tokens_with_different_images_are_not_coalesced():
    from engine.types import ImageInput

    backend = FakeBackend(words=("x",), behaviour=GATED)
    coalescer = Coalescer()
    first = GenerationRequest("r1", (1, 2, 3), GREEDY, cache_salt="org-1", images=(ImageInput(1, 2, "red", None),))
    second = GenerationRequest("r2", (1, 2, 3), GREEDY, cache_salt="org-1", images=(ImageInput(1, 2, "blue", None),))
    again = GenerationRequest("r3", (1, 2, 3), GREEDY, cache_salt="org-1", images=(ImageInput(1, 2, "red", None),))
    tasks = [asyncio.create_task(collect(coalescer, backend, r)) for r in (first, second, again)]
    await settle()
    backend.release(3)
    await asyncio.gather(*tasks)
    assert [r.request_id for r in backend.requests] == ["r1", "r2"]  # the same picture joined r1
