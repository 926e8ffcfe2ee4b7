"""KV blocks of a model that mixes sliding-window and global layers (Gemma 2 and 3): two pools.

Group 0 holds the global layers' KV and grows with the sequence; group 1 holds the sliding
layers' and gives back what fell out of every future window, so a long chat's memory on those
layers stays window-sized. Each group has its own BlockManager (free list, ref counts, prefix
cache); this class pairs them behind BlockManager's interface for the scheduler. A prefix hit
needs group 0's whole prefix and group 1's last window before the hit point (the idea of
vLLM's hybrid KV cache coordinator). Torch-free, like the managers.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from engine.native.block_manager import BlockManager
from engine.native.sequence import Sequence

# One entry per cached leading block: (global group's block id, sliding group's or None when
# outside the window of the first query after the hit).
PrefixEntry = tuple[int, int | None]


class HybridBlockManager:
    def __init__(self, full: BlockManager, window: BlockManager):
        if full.group != 0 or window.group != 1 or window.sliding_window is None or full.sliding_window is not None:
            raise ValueError("a hybrid block manager pairs a global group 0 with a sliding group 1")
        if full.block_size != window.block_size:
            raise ValueError("both KV groups must use one block size")
        self.full = full
        self.window = window
        self.groups = (full, window)

    # The global group bounds how long a sequence can get; counts and statistics are its own.
    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_queried_tokens(self) -> int:
        return self.full.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.full.num_hit_tokens

    @property
    def enable_prefix_caching(self) -> bool:
        return self.full.enable_prefix_caching

    def find_cached_prefix(self, seq: Sequence) -> list[PrefixEntry]:
        """The longest run of leading blocks whose global blocks and last window are both cached."""
        full_ids = self.full.find_cached_prefix(seq)
        for num_blocks in range(len(full_ids), 0, -1):
            window_ids = self.window.find_cached_window(seq, num_blocks)
            if window_ids is not None:
                return list(zip(full_ids[:num_blocks], window_ids, strict=True))
        return []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[PrefixEntry] = ()) -> bool:
        full_ids, window_ids = _split(prefix)
        return self.full.can_allocate(seq, num_new_tokens, full_ids) and self.window.can_allocate(
            seq, num_new_tokens, window_ids
        )

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[PrefixEntry] = ()) -> None:
        full_ids, window_ids = _split(prefix)
        self.full.allocate(seq, num_new_tokens, full_ids)
        self.window.allocate(seq, num_new_tokens, window_ids)

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        self.window.free(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        self.full.cache_full_blocks(seq)
        self.window.cache_full_blocks(seq)

    def release_outside_window(self, seq: Sequence) -> None:
        self.window.release_outside_window(seq)


def _split(prefix: SequenceOf[PrefixEntry]) -> tuple[list[int], list[int | None]]:
    return [entry[0] for entry in prefix], [entry[1] for entry in prefix]
