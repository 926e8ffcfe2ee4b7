"""Recurrent-state rows for models with Gated DeltaNet layers (Qwen3.5), held beside KV blocks.

Such a model's attention layers keep a paged KV cache (block_manager.py); its linear-attention
layers keep one fixed-size state per sequence (linear_attention.py), a row of the runner's
pools. This class wraps the KV block manager behind the scheduler's interface: a sequence
gets a row with its first blocks and gives it back exactly where its blocks go back (finish,
abort, preemption: `free`). A preempted sequence recomputes from its tokens, so its state
restarts from zeros with its first chunk. A state summarizes a whole prefix and cannot be
shared or rewound, so these models run without prefix caching and speculation (llm_engine.py).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from engine.native.block_manager import BlockManager
from engine.native.sequence import Sequence


class StateSlotManager:
    def __init__(self, blocks: BlockManager, num_slots: int):
        if blocks.enable_prefix_caching:
            raise ValueError("a recurrent state cannot be shared: build the block manager without prefix caching")
        self.blocks = blocks
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: row 0 first
        self.num_slots = num_slots

    @property
    def groups(self) -> tuple[BlockManager]:
        """The KV groups' managers, as HybridBlockManager.groups (one here)."""
        return (self.blocks,)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def num_queried_tokens(self) -> int:
        return self.blocks.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.blocks.num_hit_tokens

    @property
    def enable_prefix_caching(self) -> bool:
        return False

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        return []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[int] = ()) -> bool:
        has_row = seq.state_slot is not None or bool(self.free_slots)
        return has_row and self.blocks.can_allocate(seq, num_new_tokens, prefix)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[int] = ()) -> None:
        if seq.state_slot is None and not self.free_slots:
            raise RuntimeError("allocate without a free state row")
        self.blocks.allocate(seq, num_new_tokens, prefix)
        if seq.state_slot is None:
            seq.state_slot = self.free_slots.pop()

    def cache_full_blocks(self, seq: Sequence) -> None:
        self.blocks.cache_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def release_outside_window(self, seq: Sequence) -> None:
        self.blocks.release_outside_window(seq)
