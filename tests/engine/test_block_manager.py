"""BlockManager: allocation, reference counts, the prefix cache and its LRU eviction."""

from __future__ import annotations

from engine.native.block_manager import BlockManager
from engine.native.sequence import Sequence, SequenceStatus
from native_harness import check_invariants, make_request

BS = 4


def new_seq(seq_id: int, prompt: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, make_request(f"r{seq_id}", prompt, cache_salt=salt), eos_token_ids=(0,), max_model_len=1024)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate with any cache hit, 'compute' the whole prompt, register full blocks."""
    prefix = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(prefix) * BS
    assert bm.can_allocate(seq, num_new, prefix)
    bm.allocate(seq, num_new, prefix)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_allocation_covers_the_tokens_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    seq = new_seq(0, list(range(1, 11)))
    prefill(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    check_invariants(bm, [seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0
    check_invariants(bm, [])


def test_prefix_hit_reuses_blocks_and_bumps_refcount():
    bm = BlockManager(16, BS)
    a = new_seq(0, list(range(1, 14)))  # 3 full blocks + 1 token
    prefill(bm, a)
    b = new_seq(1, list(range(1, 13)) + [99, 98])  # shares 3 full blocks
    prefix = bm.find_cached_prefix(b)
    assert prefix == a.block_table[:3]
    prefill(bm, b)
    assert b.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.num_hit_tokens == 12 and bm.num_queried_tokens == 13 + 14
    check_invariants(bm, [a, b])


def test_last_token_is_always_computed_even_when_whole_prompt_is_cached():
    bm = BlockManager(16, BS)
    a = new_seq(0, list(range(1, 9)))  # exactly 2 full blocks
    prefill(bm, a)
    b = new_seq(1, list(range(1, 9)))
    assert bm.find_cached_prefix(b) == a.block_table[:1]  # the block with the last token is recomputed


def test_cache_salt_separates_tenants():
    bm = BlockManager(16, BS)
    a = new_seq(0, list(range(1, 10)), salt="org-a")
    prefill(bm, a)
    assert bm.find_cached_prefix(new_seq(1, list(range(1, 10)), salt="org-b")) == []
    assert bm.find_cached_prefix(new_seq(2, list(range(1, 10)), salt=None)) == []
    assert len(bm.find_cached_prefix(new_seq(3, list(range(1, 10)), salt="org-a"))) == 2


def test_hit_rechecks_token_ids_behind_the_hash():
    bm = BlockManager(16, BS)
    a = new_seq(0, list(range(1, 10)))
    prefill(bm, a)
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)  # as if two contents collided on one hash
    assert bm.find_cached_prefix(new_seq(1, list(range(1, 10)))) == []


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(8, BS)
    a = new_seq(0, list(range(1, 10)))
    prefill(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    b = new_seq(1, list(range(1, 10)))
    assert bm.find_cached_prefix(b) == cached
    prefill(bm, b)
    assert b.block_table[:2] == cached
    check_invariants(bm, [b])


def test_free_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(6, BS)
    old = new_seq(0, [1] * 8 + [5])
    new = new_seq(1, [2] * 8 + [5])
    prefill(bm, old)
    bm.free(old)
    prefill(bm, new)
    bm.free(new)
    # Fill 4 blocks: the 2 never-cached blocks go first, then old's 2 cached blocks.
    filler = new_seq(2, list(range(100, 116)))
    prefill(bm, filler)
    assert bm.find_cached_prefix(new_seq(3, [1] * 8 + [5])) == []
    assert len(bm.find_cached_prefix(new_seq(4, [2] * 8 + [5]))) == 2
    check_invariants(bm, [filler])


def test_a_prompt_head_outlives_its_tail_in_the_cache():
    bm = BlockManager(4, BS)
    a = new_seq(0, list(range(1, 14)))  # 3 full blocks + 1 token: all 4 blocks
    prefill(bm, a)
    bm.free(a)
    filler = new_seq(1, [50, 51])  # takes the unhashed block, then the tail block
    prefill(bm, filler)
    filler2 = new_seq(2, [60, 61])
    prefill(bm, filler2)
    assert len(bm.find_cached_prefix(new_seq(3, list(range(1, 14))))) == 2


def test_duplicate_content_computed_concurrently_keeps_one_cache_entry():
    bm = BlockManager(16, BS)
    a, b = new_seq(0, list(range(1, 10))), new_seq(1, list(range(1, 10)))
    for seq in (a, b):  # both admitted before either registered its blocks
        bm.allocate(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    assert len(bm.hash_to_block_id) == 2
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    check_invariants(bm, [])


def hybrid(num_blocks: int, window: int, num_window_blocks: int | None = None):
    from engine.native.hybrid_blocks import HybridBlockManager

    return HybridBlockManager(
        BlockManager(num_blocks, BS), BlockManager(num_window_blocks or num_blocks, BS, sliding_window=window, group=1)
    )


def test_a_hybrid_prefix_hit_takes_global_blocks_and_only_the_last_window_of_sliding_ones():
    bm = hybrid(16, window=6)
    a = new_seq(0, list(range(1, 22)))  # 5 full blocks + 1 token
    prefill(bm, a)
    bm.release_outside_window(a)  # the next query (position 21) sees 16..21: blocks 0-3 go back
    assert a.block_tables[1].num_released == 4 and bm.window.num_used_blocks == 2
    b = new_seq(1, list(range(1, 21)) + [99])
    prefix = bm.find_cached_prefix(b)
    # 5 blocks hit: global 0-4; the first query after them (position 20) sees 15..20: blocks 3-4.
    assert [f for f, _ in prefix] == a.block_table[:5]
    assert [w for _, w in prefix] == [None, None, None] + a.block_tables[1].block_ids[3:5]
    prefill(bm, b)
    assert b.block_tables[1].num_released == 3 and b.num_computed_tokens == 21
    check_invariants(bm, [a, b])


def test_a_hybrid_hit_shrinks_to_where_the_sliding_window_is_still_cached():
    bm = hybrid(16, window=6, num_window_blocks=6)
    a = new_seq(0, list(range(1, 22)))
    prefill(bm, a)
    bm.release_outside_window(a)
    bm.free(a)
    filler = new_seq(1, list(range(100, 111)))  # 3 window blocks: evicts a's unhashed tail, then blocks 0 and 1
    prefill(bm, filler)
    b = new_seq(2, list(range(1, 21)) + [99])
    # Window blocks 0 and 1 are gone: hits of 1-2 blocks need block 0 or 1, hits of 3-5 blocks
    # need blocks 1-4 or 2-4 or 3-4 of the sliding group; the longest possible is 5.
    assert len(bm.find_cached_prefix(b)) == 5
    filler2 = new_seq(3, list(range(200, 207)))  # 2 more: evicts window blocks 2 and 3
    prefill(bm, filler2)
    assert bm.find_cached_prefix(b) == []  # every length needs an evicted sliding block
    check_invariants(bm, [filler, filler2])


def test_hybrid_scheduling_with_preemption_keeps_both_groups_consistent():
    from engine.native.scheduler import Scheduler, SchedulerConfig
    from native_harness import SchedulerDriver

    bm = hybrid(14, window=5, num_window_blocks=8)
    driver = SchedulerDriver(Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), bm))
    system = list(range(1, 14))
    for i in range(5):
        driver.add(make_request(f"r{i}", system + [50 + i] * (3 + i), max_tokens=12))
    driver.run()
    assert driver.scheduler.num_preemptions > 0 and bm.num_hit_tokens > 0
    assert bm.full.num_free_blocks == 14 and bm.window.num_free_blocks == 8
