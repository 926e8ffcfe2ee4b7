"""The KV block pool: free list, reference counts, block tables and the prefix cache.

Torch-free; it hands out block ids and never touches KV tensors. A full, computed block is
registered under a chained hash of (parent hash, token ids) salted per tenant; a freed block
keeps its hash, so the free list doubles as the cache and the oldest-freed block is evicted first.
A manager serves one KV group (sequence.BlockTable): every layer, or in a model that mixes
sliding and global layers, one kind of them (hybrid_blocks.py pairs two). In a sliding group a
sequence gives back the blocks that fell out of the window of every query it will still run,
so its KV there stays window-sized.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from engine.native.sequence import Sequence


@dataclass(slots=True)
class Block:
    """One KV block's bookkeeping (mutable: ref counts move every step)."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full, computed and registered
    token_ids: tuple[object, ...] | None = None  # its tokens (and image keys), re-checked on every cache hit


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        group: int = 0,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the window of every layer of the group (None: global layers)
        self.group = group  # which of a sequence's block_tables this manager fills
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front is evicted first: never-cached blocks go to the front, cached ones to the back.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (some still hold cached prefixes, evictable at will)."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached run of this sequence's leading full blocks.

        At least one token is always left to compute (its logits give the next token), so a
        cached block is never written to.
        """
        if not self.enable_prefix_caching or seq.block_tables[self.group].block_ids:
            return []
        bs = self.block_size
        hit_ids: list[int] = []
        for i, h in enumerate(seq.full_block_hashes((seq.num_tokens - 1) // bs, bs)):
            block_id = self._cached(seq, i, h)
            if block_id is None:
                break
            hit_ids.append(block_id)
        return hit_ids

    def find_cached_window(self, seq: Sequence, num_blocks: int) -> list[int | None] | None:
        """For a sliding group: the cached blocks a query right after the first `num_blocks`
        blocks attends to (None for the leading ones outside its window), or None if one of
        those is not cached."""
        if self.sliding_window is None:
            raise ValueError("find_cached_window is asked of a sliding group only")
        bs = self.block_size
        first_needed = max(num_blocks * bs - self.sliding_window + 1, 0) // bs
        hashes = seq.full_block_hashes(num_blocks, bs)
        window_ids = [self._cached(seq, i, hashes[i]) for i in range(first_needed, num_blocks)]
        if None in window_ids:
            return None
        return [None] * first_needed + window_ids

    def _cached(self, seq: Sequence, index: int, block_hash: bytes) -> int | None:
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != seq.block_token_ids(index, self.block_size):
            return None
        return block_id

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: SequenceOf[int | None] = ()) -> bool:
        """Would `num_new_tokens` more tokens fit (after taking `prefix_block_ids`, if any)?"""
        if prefix_block_ids:
            num_needed = cdiv(len(prefix_block_ids) * self.block_size + num_new_tokens, self.block_size)
            num_needed -= len(prefix_block_ids)
            num_reused_free = sum(1 for b in prefix_block_ids if b is not None and self.blocks[b].ref_count == 0)
            return num_needed <= self.num_free_blocks - num_reused_free
        table = seq.block_tables[self.group]
        num_needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table.block_ids)
        return num_needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: SequenceOf[int | None] = ()) -> None:
        """Grow the block table to hold `num_new_tokens` more tokens; call can_allocate first.

        Leading None entries of a prefix (a sliding group's blocks outside the window) start
        out released."""
        table = seq.block_tables[self.group]
        if not table.block_ids and self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(prefix_block_ids) * self.block_size
        if prefix_block_ids:
            live = [block_id for block_id in prefix_block_ids if block_id is not None]
            for block_id in live:
                self._take(block_id)
            table.num_released = len(prefix_block_ids) - len(live)
            table.block_ids = [live[0]] * table.num_released + live  # released entries: stale, never read
            table.num_hashed = len(prefix_block_ids)
            seq.num_computed_tokens = len(prefix_block_ids) * self.block_size
        num_needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table.block_ids)
        if num_needed > self.num_free_blocks:
            raise RuntimeError(f"allocate without room: need {num_needed}, free {self.num_free_blocks}")
        for _ in range(num_needed):
            table.block_ids.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; it keeps no blocks and no computed tokens."""
        table = seq.block_tables[self.group]
        # Last blocks first, so a prompt's head outlives its tail in the LRU order.
        for block_id in reversed(table.block_ids[table.num_released :]):
            self._release(block_id)
        table.clear()
        seq.num_computed_tokens = 0

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks before the window of the next query (position num_computed_tokens);
        later queries' windows start later still. Call after cache_full_blocks."""
        if self.sliding_window is None:
            return
        table = seq.block_tables[self.group]
        first_needed = seq.num_computed_tokens - self.sliding_window + 1  # earliest key still attended to
        num_outside = max(first_needed, 0) // self.block_size
        for block_id in table.block_ids[table.num_released : num_outside]:
            self._release(block_id)
        table.num_released = max(table.num_released, num_outside)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.hash is None:
                self.free_block_ids.move_to_end(block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = seq.block_tables[self.group]
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= table.num_hashed:
            return
        hashes = seq.full_block_hashes(num_full, self.block_size)
        for i in range(table.num_hashed, num_full):
            # Same content computed twice concurrently: keep the first, leave this one unhashed.
            if hashes[i] in self.hash_to_block_id:
                continue
            block = self.blocks[table.block_ids[i]]
            block.hash = hashes[i]
            block.token_ids = seq.block_token_ids(i, self.block_size)
            self.hash_to_block_id[block.hash] = block.block_id
        table.num_hashed = num_full

    def recent_cached_blocks(self) -> list[Block]:
        """The free blocks that hold cached prefixes, the most recently used first (what a
        restart should keep: engine/native/prefix_store.py)."""
        return [self.blocks[b] for b in reversed(self.free_block_ids) if self.blocks[b].hash is not None]

    def restore_cached_block(self, block_hash: bytes, token_ids: tuple[object, ...]) -> int | None:
        """Register a block read back from disk: a free block that holds no prefix takes it, as
        the most recently used cached block. Its K/V are the caller's to write. None when no
        such block is left or the hash is known already."""
        if block_hash in self.hash_to_block_id or not self.free_block_ids:
            return None
        block_id = next(iter(self.free_block_ids))  # never-cached blocks are at the front
        block = self.blocks[block_id]
        if block.hash is not None:
            return None
        block.hash, block.token_ids = block_hash, token_ids
        self.hash_to_block_id[block_hash] = block_id
        self.free_block_ids.move_to_end(block_id)
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the least recently used cached prefix
            del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id
