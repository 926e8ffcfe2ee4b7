"""Turns a ScheduledBatch into flat model inputs and attention metadata, one per KV group.

Rows come decode tokens first, then prefill chunks. Each KV group (block_manager.py) has its
own block tables, so its own slots, decode tables and chunk contexts; a hybrid model's sliding
layers read the metadata in `window_group`. Per-step Python work is proportional to sequences,
not tokens, wherever it can be. Reads sequences, never changes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.native.attention import AttentionMetadata, PrefillChunk
from engine.native.linear_attention import RecurrentBatch
from engine.native.scheduler import ScheduledBatch
from engine.native.sequence import Sequence


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    decodes: tuple[int, ...]  # batch indices of the decode rows (rows 0..len-1)
    prefills: tuple[int, ...]  # batch indices of the prefill chunks, in row order
    chunk_ends: tuple[int, ...]  # for each prefill chunk, one past its last row


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the metadata depends on besides the batch."""

    block_size: int
    group_windows: tuple[int | None, ...]  # per KV group, the window of its layers (None: global)
    device: torch.device
    decode_kernel: Callable | None  # CpuKernels.paged_decode_attention; None: PyTorch decode only
    # Per KV group, a block no sequence is given (the pool's last): padding rows of a decode step
    # padded to a fixed shape (cuda_graphs.py) write and read only there. None: no padding.
    scratch_blocks: tuple[int, ...] | None = None
    recurrent: bool = False  # Gated DeltaNet layers (Qwen3.5): each row's recurrent-state row goes in the metadata


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """A decode-only step padded to `rows` rows over `length` context positions (cuda_graphs.py)."""

    rows: int
    length: int


class BatchInputBuilder:
    def __init__(self, layout: KVLayout):
        self.layout = layout

    def build(self, batch: ScheduledBatch, padded: DecodeShape | None = None) -> BatchInputs:
        """padded (a decode-only batch of at most padded.rows sequences, none longer than
        padded.length): rows past the batch's are padding, a token 0 at position 0 whose K/V
        goes to the scratch block and which attends to that alone; every row's context is laid
        out over padded.length positions, masked past its own."""
        decodes = tuple(i for i, n in enumerate(batch.num_scheduled_tokens) if n == 1)
        prefills = tuple(i for i, n in enumerate(batch.num_scheduled_tokens) if n > 1)
        decode_seqs = [batch.seqs[i] for i in decodes]
        positions = [seq.num_computed_tokens for seq in decode_seqs]
        input_ids = [seq.token_ids[p] for seq, p in zip(decode_seqs, positions, strict=True)]
        position_arrays = [np.asarray(positions, dtype=np.int64)]
        chunks: list[tuple[Sequence, int, int]] = []  # (sequence, num_tokens, first row)
        for i in prefills:
            seq, n = batch.seqs[i], batch.num_scheduled_tokens[i]
            start = seq.num_computed_tokens
            chunks.append((seq, n, len(input_ids)))
            input_ids.extend(seq.token_ids[start : start + n])
            position_arrays.append(np.arange(start, start + n, dtype=np.int64))
        if padded is not None:
            assert not chunks and len(decode_seqs) <= padded.rows and self.layout.scratch_blocks is not None
            num_padding = padded.rows - len(decode_seqs)
            input_ids.extend([0] * num_padding)
            position_arrays.append(np.zeros(num_padding, dtype=np.int64))
        metas = [
            self._group_metadata(g, decode_seqs, positions, chunks, padded)
            for g in range(len(self.layout.group_windows))
        ]
        meta = metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], window_group=metas[1])
        if self.layout.recurrent:
            meta = dataclasses.replace(meta, recurrent=self._recurrent_batch(decode_seqs, chunks))
        return BatchInputs(
            input_ids=self._to_device(np.asarray(input_ids, dtype=np.int64)),
            positions=self._to_device(np.concatenate(position_arrays)),
            meta=meta,
            decodes=decodes,
            prefills=prefills,
            chunk_ends=tuple(row + n for _, n, row in chunks),
        )

    def _recurrent_batch(self, decode_seqs: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> RecurrentBatch:
        """A row at position 0 starts its sequence (prefix caching is off for these models: a
        sequence's first chunk, or its first after preemption) and so starts from a zero state,
        a one-token one among the decode rows as well as a chunk."""
        slots = [seq.state_slot for seq in decode_seqs]
        assert None not in slots  # a running sequence holds a row (state_slots.py)
        fresh = [seq.state_slot for seq in decode_seqs if seq.num_computed_tokens == 0]
        chunk_rows = []
        for seq, n, row in chunks:
            assert seq.state_slot is not None
            chunk_rows.append((seq.state_slot, row, n, seq.num_computed_tokens == 0))
        return RecurrentBatch(
            self._to_device(np.asarray(slots, dtype=np.int64)),
            tuple(chunk_rows),
            self._to_device(np.asarray(fresh, dtype=np.int64)) if fresh else None,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.layout.device, non_blocking=True)

    def _group_metadata(
        self,
        group: int,
        decode_seqs: list[Sequence],
        positions: list[int],
        chunks: list[tuple[Sequence, int, int]],
        padded: DecodeShape | None,
    ) -> AttentionMetadata:
        bs = self.layout.block_size
        slots = [
            seq.block_tables[group].block_ids[p // bs] * bs + p % bs
            for seq, p in zip(decode_seqs, positions, strict=True)
        ]
        if padded is not None:
            assert self.layout.scratch_blocks is not None
            slots.extend([self.layout.scratch_blocks[group] * bs] * (padded.rows - len(decode_seqs)))
        slot_arrays = [np.asarray(slots, dtype=np.int64)]
        prefill_chunks = []
        for seq, n, row in chunks:
            chunk, chunk_slots = self._prefill_chunk(group, seq, n, row)
            prefill_chunks.append(chunk)
            slot_arrays.append(chunk_slots)
        slot_mapping = np.concatenate(slot_arrays)
        return AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            slot_blocks=self._to_device(slot_mapping // bs),
            slot_offsets=self._to_device(slot_mapping % bs),
            num_decode_tokens=len(decode_seqs) if padded is None else padded.rows,
            prefills=tuple(prefill_chunks),
            block_size=bs,
            **self._decode_metadata(group, decode_seqs, positions, padded),
        )

    def _decode_metadata(
        self, group: int, seqs: list[Sequence], positions: list[int], padded: DecodeShape | None
    ) -> dict[str, Any]:
        meta: dict[str, Any] = dict(
            decode_block_tables=None,
            decode_context_lens=None,
            decode_max_context_len=0,
            decode_slots=None,
            decode_mask=None,
            decode_window_mask=None,
        )
        if not seqs and padded is None:
            return meta
        bs, window, kernel = self.layout.block_size, self.layout.group_windows[group], self.layout.decode_kernel
        num_rows = len(seqs) if padded is None else padded.rows
        context_lens = np.ones(num_rows, dtype=np.int32)  # a padding row: its one scratch slot
        context_lens[: len(seqs)] += np.asarray(positions, dtype=np.int32)
        max_len = int(context_lens.max()) if padded is None else padded.length
        max_blocks = -(-max_len // bs)
        tables = np.empty((num_rows, max_blocks), dtype=np.int32)
        for row, seq in zip(tables, seqs, strict=False):
            table = seq.block_tables[group].live_block_ids()[:max_blocks]
            row[: len(table)] = table
            row[len(table) :] = table[0]  # padding points at written slots: finite, masked out
        if padded is not None:
            assert kernel is None and self.layout.scratch_blocks is not None  # padded for PyTorch ops
            tables[len(seqs) :] = self.layout.scratch_blocks[group]
        meta["decode_max_context_len"] = max_len
        if kernel is not None:
            meta.update(
                decode_block_tables=torch.from_numpy(tables),
                decode_context_lens=torch.from_numpy(context_lens),
                decode_kernel=kernel,
            )
        # The kernel attends within windows and soft-caps itself; without it, the gather path.
        if kernel is None:
            slot_grid = (tables[:, :, None] * bs + np.arange(bs, dtype=np.int32)).reshape(num_rows, -1)[:, :max_len]
            index = np.arange(max_len)[None, :]
            # Released positions (outside every window, masked) read the first live slot: written, finite.
            first_live = np.zeros((num_rows, 1), dtype=np.int64)
            first_live[: len(seqs), 0] = [seq.block_tables[group].num_released * bs for seq in seqs]
            slot_grid = np.where(index < first_live, tables[:, :1] * bs, slot_grid)
            valid = index < context_lens[:, None]
            meta["decode_slots"] = self._to_device(np.where(valid, slot_grid, slot_grid[:, :1]).astype(np.int64))
            meta["decode_mask"] = self._to_device(valid[:, None, None, :])
            if window is not None:  # positions p - window + 1 .. p
                in_window = valid & (index > context_lens[:, None] - 1 - window)
                meta["decode_window_mask"] = self._to_device(in_window[:, None, None, :])
        return meta

    def _prefill_chunk(
        self, group: int, seq: Sequence, num_tokens: int, row_start: int
    ) -> tuple[PrefillChunk, np.ndarray]:
        bs, window = self.layout.block_size, self.layout.group_windows[group]
        start = seq.num_computed_tokens
        block_table = seq.block_tables[group]
        table = np.asarray(block_table.live_block_ids(), dtype=np.int64)
        context = np.arange(start + num_tokens, dtype=np.int64)
        context_slots = table[context // bs] * bs + context % bs
        released = block_table.num_released * bs  # positions before it: outside every window, masked
        context_slots[:released] = table[block_table.num_released] * bs
        chunk_positions = context[start:]
        end = row_start + num_tokens
        window_mask = None
        if window is not None:  # [q_len, context_len]: causal, within the window
            keys = context[start:] if start == 0 else context
            causal = keys[None, :] <= chunk_positions[:, None]
            window_mask = self._to_device(causal & (keys[None, :] > chunk_positions[:, None] - window))
        if start == 0:  # no cached context: attend within the chunk, plain causal
            chunk = PrefillChunk(row_start, end, len(context), None, None, None, window_mask)
        else:
            mask = context[None, :] <= chunk_positions[:, None]  # [q_len, context_len], bottom-right causal
            blocks = table[: -(-len(context) // bs)]
            chunk = PrefillChunk(
                row_start,
                end,
                len(context),
                self._to_device(blocks),
                self._to_device(context_slots),
                self._to_device(mask),
                window_mask,
                gather_keys_by_slot=released > 0,
            )
        return chunk, context_slots[start:]
