"""The KV block pool: free list, reference counts, block tables and the prefix cache.

Torch-free; it hands out block ids and never touches KV tensors. A full, computed block is
registered under a chained hash of (parent hash, token ids) salted per tenant; a freed block
keeps its hash, so the free list doubles as the cache and the oldest-freed block is evicted first.
For a model whose every layer attends to a sliding window, a sequence gives back the blocks
that fell out of the window of every query it will still run, so its KV stays window-sized.
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
    token_ids: tuple[int, ...] | None = None  # its tokens, re-checked on every cache hit


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's window (None: some layer sees everything)
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
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        hit_ids: list[int] = []
        for i, h in enumerate(seq.full_block_hashes((seq.num_tokens - 1) // bs, bs)):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != seq.block_token_ids(i, bs):
                break
            hit_ids.append(block_id)
        return hit_ids

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: SequenceOf[int] = ()) -> bool:
        """Would `num_new_tokens` more tokens fit (after taking `prefix_block_ids`, if any)?"""
        if prefix_block_ids:
            num_needed = cdiv(len(prefix_block_ids) * self.block_size + num_new_tokens, self.block_size)
            num_needed -= len(prefix_block_ids)
            num_reused_free = sum(1 for b in prefix_block_ids if self.blocks[b].ref_count == 0)
            return num_needed <= self.num_free_blocks - num_reused_free
        num_needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return num_needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: SequenceOf[int] = ()) -> None:
        """Grow the block table to hold `num_new_tokens` more tokens; call can_allocate first."""
        if not seq.block_table and self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(prefix_block_ids) * self.block_size
        if prefix_block_ids:
            for block_id in prefix_block_ids:
                self._take(block_id)
            seq.block_table = list(prefix_block_ids)
            seq.num_computed_tokens = seq.num_hashed_blocks = len(prefix_block_ids)
            seq.num_computed_tokens *= self.block_size
        num_needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if num_needed > self.num_free_blocks:
            raise RuntimeError(f"allocate without room: need {num_needed}, free {self.num_free_blocks}")
        for _ in range(num_needed):
            seq.block_table.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; it keeps no blocks and no computed tokens."""
        # Last blocks first, so a prompt's head outlives its tail in the LRU order.
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks before the window of the next query (position num_computed_tokens);
        later queries' windows start later still. Call after cache_full_blocks."""
        if self.sliding_window is None:
            return
        first_needed = seq.num_computed_tokens - self.sliding_window + 1  # earliest key still attended to
        num_outside = max(first_needed, 0) // self.block_size
        for block_id in seq.block_table[seq.num_released_blocks : num_outside]:
            self._release(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, num_outside)

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
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = seq.full_block_hashes(num_full, self.block_size)
        for i in range(seq.num_hashed_blocks, num_full):
            # Same content computed twice concurrently: keep the first, leave this one unhashed.
            if hashes[i] in self.hash_to_block_id:
                continue
            block = self.blocks[seq.block_table[i]]
            block.hash = hashes[i]
            block.token_ids = seq.block_token_ids(i, self.block_size)
            self.hash_to_block_id[block.hash] = block.block_id
        seq.num_hashed_blocks = num_full

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
