"""Shared helpers of the native-engine tests: the block-pool invariant check and a step driver.

The driver runs the real Scheduler and BlockManager with a deterministic token function in
place of a model, so bookkeeping tests are fast and still exercise every code path.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable

from engine.native.block_manager import BlockManager, cdiv
from engine.native.scheduler import Scheduler
from engine.native.sequence import Sequence, SequenceStatus
from engine.types import GenerationRequest, SamplingParams

# Where the engine-level tests run the engine: "cpu" (CI), or "cuda" on a GPU host
# (`ENGINE_TEST_DEVICE=cuda pytest tests/engine`, scripts/cuda_check.sh). fp32 on either, so its
# greedy output can equal transformers' fp32 reference token for token.
TEST_DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
ON_DEVICE = dict(device=TEST_DEVICE, dtype="float32")


def check_invariants(bm, live: Iterable[Sequence], retired: Iterable[Sequence] = ()) -> None:
    """Per KV group: free + used = total; ref counts match owners and are >= 0; hash entries
    match tokens. `bm` is a BlockManager, a HybridBlockManager (both its groups are checked) or a
    StateSlotManager (its state rows too)."""
    live, retired = list(live), list(retired)
    for group in getattr(bm, "groups", (bm,)):
        _check_group(group, live, retired)
    if hasattr(bm, "free_slots"):  # StateSlotManager: each running sequence holds one recurrent-state row
        _check_state_slots(bm, live, retired)


def _check_state_slots(bm, live: list[Sequence], retired: list[Sequence]) -> None:
    held = [seq.state_slot for seq in live if seq.state_slot is not None]
    assert len(set(held)) == len(held), "two sequences share a state row"
    assert set(held).isdisjoint(bm.free_slots) and len(set(bm.free_slots)) == len(bm.free_slots)
    assert len(held) + len(bm.free_slots) == bm.num_slots, "a state row was lost"
    for seq in live:
        assert (seq.state_slot is not None) == (seq.status is SequenceStatus.RUNNING), f"{seq} state row"
    assert all(seq.state_slot is None for seq in retired), "a retired sequence still holds a state row"


def _check_group(bm: BlockManager, live: list[Sequence], retired: list[Sequence]) -> None:
    g = bm.group
    # Released entries (sliding windows) are stale ids the sequence no longer owns.
    owners = Counter(b for seq in live for b in seq.block_tables[g].block_ids[seq.block_tables[g].num_released :])
    free_ids = set(bm.free_block_ids)
    assert len(free_ids) == len(bm.free_block_ids), "a block is twice in the free list"
    used_ids = {b.block_id for b in bm.blocks if b.ref_count > 0}
    assert len(free_ids) + len(used_ids) == bm.num_blocks, "free + used != total"
    assert free_ids.isdisjoint(used_ids), "a referenced block is on the free list"
    for block in bm.blocks:
        assert block.ref_count >= 0, f"negative ref count on {block}"
        assert block.ref_count == owners[block.block_id], f"{block} has owners {owners[block.block_id]}"
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h and block.token_ids is not None
        # A block's key is its token ids, then (content hash, offset) of any images it holds.
        assert sum(isinstance(t, int) for t in block.token_ids) == bm.block_size
    for block in bm.blocks:
        if block.hash is not None:
            assert bm.hash_to_block_id.get(block.hash) == block.block_id, f"{block} hashed but not mapped"
    for seq in live:
        table = seq.block_tables[g]
        assert seq.status is not SequenceStatus.FINISHED
        assert seq.num_computed_tokens <= seq.num_tokens
        assert len(table.block_ids) >= cdiv(seq.num_computed_tokens, bm.block_size)
        if seq.status is SequenceStatus.WAITING:
            assert not table.block_ids and seq.num_computed_tokens == 0
        if bm.sliding_window is not None:  # nothing the next query's window reaches was released
            first_needed = max(seq.num_computed_tokens - bm.sliding_window + 1, 0)
            assert table.num_released <= first_needed // bm.block_size, f"{seq} released a block it needs"
        hashes = seq.full_block_hashes(seq.num_computed_tokens // bm.block_size, bm.block_size)
        for i, block_id in enumerate(table.block_ids):
            if i < table.num_released:
                continue
            block = bm.blocks[block_id]
            if block.ref_count > 1:
                assert block.hash is not None, f"shared block {block} is not a cached full block"
            if block.hash is not None:
                assert block.hash == hashes[i], f"{seq} group {g} block {i} hash mismatch"
                assert block.token_ids == seq.block_token_ids(i, bm.block_size), f"{seq} block {i} tokens"
    for seq in retired:
        assert seq.status is SequenceStatus.FINISHED and not seq.block_tables[g].block_ids, f"{seq} still owns blocks"


def fake_next_token(seq: Sequence) -> int:
    """A deterministic stand-in for a model: depends only on the sequence's tokens."""
    return (sum(seq.token_ids[-3:]) * 31 + seq.num_tokens * 7) % 1000 + 1


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int = 8,
    priority: int = 0,
    cache_salt: str | None = None,
) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id, tuple(prompt), sampling, priority=priority, cache_salt=cache_salt)


class SchedulerDriver:
    """Runs Scheduler steps with fake_next_token, checking invariants around every step."""

    def __init__(self, scheduler: Scheduler, *, max_model_len: int = 4096):
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.live: dict[str, Sequence] = {}
        self.retired: list[Sequence] = []
        self.batches = []
        self._next_seq_id = 0

    def add(self, request: GenerationRequest) -> Sequence:
        seq = Sequence(self._next_seq_id, request, eos_token_ids=(0,), max_model_len=self.max_model_len)
        self._next_seq_id += 1
        self.live[request.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        from engine.types import FinishReason

        seq = self.live.pop(request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.retired.append(seq)
        self.check()

    def check(self) -> None:
        check_invariants(self.scheduler.block_manager, self.live.values(), self.retired)

    def step(self, next_token: Callable[[Sequence], int] = fake_next_token) -> list[Sequence]:
        batch = self.scheduler.schedule()
        self.check()
        self.batches.append(batch)
        sampled = [
            next_token(seq) if seq.num_computed_tokens + n == seq.num_tokens else None
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
        ]
        updated = self.scheduler.postprocess(batch, sampled)
        for seq in updated:
            if seq.is_finished:
                self.retired.append(self.live.pop(seq.request_id))
        self.check()
        return updated

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler did not finish its work")
