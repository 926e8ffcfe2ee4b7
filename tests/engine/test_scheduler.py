"""Scheduler: token budget, chunked prefill, admission, preemption and abort, with the
block-pool invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from engine.native.block_manager import BlockManager
from engine.native.scheduler import Scheduler, SchedulerConfig
from engine.native.sequence import SequenceStatus
from engine.native.state_slots import StateSlotManager
from engine.types import FinishReason
from native_harness import SchedulerDriver, make_request


def driver(
    num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, caching=True, prefill_cap=None
) -> SchedulerDriver:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return SchedulerDriver(Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefill_cap), bm))


def reference_outputs(requests) -> dict[str, list[int]]:
    """Each request run alone in a roomy pool: what any schedule must reproduce."""
    out = {}
    for request in requests:
        d = driver(num_blocks=512, caching=False, max_num_batched_tokens=4096)
        seq = d.add(request)
        d.run()
        out[request.request_id] = seq.completion_token_ids
    return out


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    d = driver(max_num_batched_tokens=16)
    seq = d.add(make_request("a", list(range(1, 41)), max_tokens=3))
    chunks = []
    while not seq.is_finished:
        d.step()
        chunks.append(d.batches[-1].num_scheduled_tokens[0])
    assert chunks == [16, 16, 8, 1, 1]
    assert seq.num_completion_tokens == 3 and seq.finish_reason is FinishReason.LENGTH


def test_decodes_are_scheduled_before_prefill_chunks_and_share_the_step():
    d = driver(max_num_batched_tokens=16)
    runners = [d.add(make_request(f"r{i}", [i + 1] * 5, max_tokens=20)) for i in range(3)]
    d.step()  # all three prefill in one step (15 tokens)
    long = d.add(make_request("long", list(range(1, 60)), max_tokens=2))
    d.step()
    batch = d.batches[-1]
    assert batch.seqs[:3] == tuple(runners) and batch.num_scheduled_tokens == (1, 1, 1, 13)
    assert batch.seqs[3] is long and batch.num_tokens == 16


def test_prefill_is_capped_while_decodes_ride_along_and_not_when_alone():
    d = driver(max_num_batched_tokens=32, prefill_cap=6)
    first = d.add(make_request("first", list(range(1, 21)), max_tokens=30))
    d.step()
    assert d.batches[-1].num_scheduled_tokens == (20,)  # nothing decoding: the whole budget
    long = d.add(make_request("long", list(range(1, 40)), max_tokens=2))
    second = d.add(make_request("second", list(range(1, 5)), max_tokens=2))
    d.step()
    # One decode plus at most 6 prompt tokens, shared in priority order.
    assert d.batches[-1].seqs == (first, long) and d.batches[-1].num_scheduled_tokens == (1, 6)
    while long.num_uncomputed_tokens > 1:
        d.step()
        batch = d.batches[-1]
        assert (
            sum(
                n
                for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
                if s.num_completion_tokens == 0 or n > 1
            )
            <= 6
        )
    d.run()
    assert long.num_completion_tokens == 2 and second.num_completion_tokens == 2


def test_prefill_cap_grows_with_the_decodes_in_the_step():
    d = driver(max_num_batched_tokens=64, prefill_cap=6)
    for i in range(5):
        d.add(make_request(f"d{i}", [i + 1] * 2, max_tokens=20))
    d.step()
    d.step()  # five streams decoding
    d.add(make_request("long", list(range(1, 40)), max_tokens=2))
    d.step()
    assert d.batches[-1].num_scheduled_tokens == (1, 1, 1, 1, 1, 10)  # max(6, 2 x 5 decodes)


def test_max_num_seqs_caps_the_running_set():
    d = driver(max_num_seqs=2)
    for i in range(4):
        d.add(make_request(f"r{i}", [i + 1] * 3, max_tokens=4))
    d.step()
    assert len(d.scheduler.running) == 2 and len(d.scheduler.waiting) == 2
    d.run()
    assert len(d.retired) == 4


def test_preemption_evicts_lowest_priority_first_then_newest():
    d = driver(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    high = d.add(make_request("high", [1] * 4, max_tokens=12, priority=5))
    low_old = d.add(make_request("low_old", [2] * 4, max_tokens=12, priority=0))
    low_new = d.add(make_request("low_new", [3] * 4, max_tokens=12, priority=0))
    d.step()  # three prompts of one block each; every decode then needs a second block
    assert {s.status for s in (high, low_old, low_new)} == {SequenceStatus.RUNNING}
    while low_new.status is SequenceStatus.RUNNING and d.scheduler.num_preemptions == 0:
        d.step()
    assert low_new.status is SequenceStatus.WAITING
    assert high.status is low_old.status is SequenceStatus.RUNNING
    d.run()
    assert all(s.finish_reason is FinishReason.LENGTH for s in (high, low_old, low_new))


def test_waiting_high_priority_request_preempts_lower_running_work():
    d = driver(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low = d.add(make_request("low", [1] * 12, max_tokens=3, priority=0))
    d.step()
    high = d.add(make_request("high", [2] * 8, max_tokens=3, priority=9))
    d.step()
    assert high.status is SequenceStatus.RUNNING and low.status is SequenceStatus.WAITING
    assert d.scheduler.num_preemptions == 1
    d.run()
    assert high.finish_reason is low.finish_reason is FinishReason.LENGTH


def test_preempted_sequences_recompute_and_produce_the_same_tokens():
    rng = random.Random(1)
    requests = [
        make_request(
            f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(3, 30))], max_tokens=rng.randrange(1, 20)
        )
        for i in range(12)
    ]
    expected = reference_outputs(requests)
    d = driver(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    seqs = [d.add(r) for r in requests]
    d.run()
    assert d.scheduler.num_preemptions > 0
    assert {s.request_id: s.completion_token_ids for s in seqs} == expected


def test_shared_prefix_is_computed_once_and_reported_as_cached():
    d = driver(block_size=4, max_num_batched_tokens=64)
    system = list(range(1, 17))
    first = d.add(make_request("first", system + [20, 21], max_tokens=2))
    d.run()
    second = d.add(make_request("second", system + [30], max_tokens=2))
    d.step()
    assert second.num_cached_tokens == 16 and d.batches[-1].num_scheduled_tokens == (1,)
    d.run()
    assert first.num_cached_tokens == 0


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_every_stage_frees_all_blocks(stage):
    d = driver(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    # 7 + 6 blocks at the end: more than the pool, so the lower-priority victim gets preempted.
    other = d.add(make_request("other", [9] * 8, max_tokens=20, priority=1))
    victim = d.add(make_request("victim", list(range(1, 13)), max_tokens=12))
    if stage == "waiting":
        d.scheduler.config = SchedulerConfig(1, 8)
        d.step()
        assert victim.status is SequenceStatus.WAITING
    elif stage == "prefilling":
        d.step()
        d.step()
        assert victim.status is SequenceStatus.RUNNING and 0 < victim.num_computed_tokens < 12
    elif stage == "decoding":
        while victim.num_completion_tokens == 0:
            d.step()
        assert victim.status is SequenceStatus.RUNNING
    else:
        while d.scheduler.num_preemptions == 0:
            d.step()
        assert victim.status is SequenceStatus.WAITING and victim.num_completion_tokens > 0
    d.abort("victim")
    assert victim.block_table == [] and victim.finish_reason is FinishReason.ABORT
    assert victim not in d.scheduler.running and victim not in d.scheduler.waiting
    d.run()
    assert other.finish_reason is FinishReason.LENGTH
    assert d.scheduler.block_manager.num_free_blocks == 8


def test_random_workload_keeps_invariants_and_matches_unpressured_outputs():
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 90) for _ in range(12)] for _ in range(3)]
    requests = []
    for i in range(40):
        prompt = rng.choice(prefixes)[: rng.randrange(0, 13)] + [
            rng.randrange(1, 90) for _ in range(rng.randrange(1, 20))
        ]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 25), priority=rng.randrange(3)))
    expected = reference_outputs(requests)
    d = driver(num_blocks=20, block_size=4, max_num_seqs=5, max_num_batched_tokens=16)
    pending = list(requests)
    seqs = []
    aborted = set()
    while pending or d.scheduler.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                seqs.append(d.add(pending.pop(0)))
        if rng.random() < 0.05 and d.live:
            request_id = rng.choice(sorted(d.live))
            d.abort(request_id)
            aborted.add(request_id)
        d.step()
    assert d.scheduler.num_preemptions > 0 and d.scheduler.block_manager.num_hit_tokens > 0
    for seq in seqs:
        if seq.request_id not in aborted:
            assert seq.completion_token_ids == expected[seq.request_id]
    assert d.scheduler.block_manager.num_free_blocks == 20


def test_a_state_row_is_held_while_running_and_comes_back_on_finish_abort_and_preemption():
    """A model with a recurrent state (Qwen3.5): StateSlotManager gives a sequence a row with its
    first blocks and takes it back wherever its blocks go; the harness checks every row after
    every step (one per running sequence, none lost)."""
    bm = StateSlotManager(BlockManager(12, 4, enable_prefix_caching=False), num_slots=2)
    d = SchedulerDriver(Scheduler(SchedulerConfig(3, 64), bm))
    a, b, c = (d.add(make_request(name, [i + 1] * 8, max_tokens=30)) for i, name in enumerate("abc"))
    d.step()
    assert (a.state_slot, b.state_slot, c.state_slot) == (0, 1, None)  # blocks for c, but no row
    assert c.status is SequenceStatus.WAITING
    d.abort("c")  # waiting: it held nothing
    while d.scheduler.num_preemptions == 0:
        d.step()
    assert b.status is SequenceStatus.WAITING and b.state_slot is None and bm.num_used_slots == 1
    d.abort("a")  # running: its row comes back, and b takes it
    assert bm.num_used_slots == 0
    d.step()
    assert b.status is SequenceStatus.RUNNING and b.state_slot is not None and b.num_computed_tokens > 0
    d.run()
    assert b.finish_reason is FinishReason.LENGTH and bm.num_used_slots == 0 and sorted(bm.free_slots) == [0, 1]
