"""The only code that touches tensors: loads the model, owns the KV pool, runs steps, samples.

Turns a ScheduledBatch into flat model inputs (decode rows first, then prefill chunks) and
attention metadata, runs one forward pass, computes logits only for rows that produce a token,
and samples. Per-step Python work is proportional to sequences, not tokens, wherever it can be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from engine.native import kernels
from engine.native.attention import AttentionMetadata, PrefillChunk, allocate_kv_cache
from engine.native.families import ModelArgs
from engine.native.kernels import KernelMode
from engine.native.loader import checkpoint_dtype, load_model_args, load_model_weights
from engine.native.model import Model, prepare_linear_layers
from engine.native.quant import Quantization
from engine.native.sampler import Sampler, SamplingRow, SeenTokens
from engine.native.scheduler import ScheduledBatch
from engine.native.sequence import Sequence
from engine.native.vision import VisionTower, is_llava
from engine.types import EngineError
from settings import EngineConfig

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"engine.device is {name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device, saved: torch.dtype | None = None) -> torch.dtype:
    """The engine dtype; `saved` is the checkpoint's. auto: on CUDA the checkpoint's 16-bit dtype
    as shipped (bf16 for a 32-bit one), on the CPU fp32 (bf16/fp16 matmuls are slower there
    without AMX, and the compiled kernels are fp32)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise EngineError(f"engine.dtype {name!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise EngineError("cannot read MemAvailable from /proc/meminfo; set engine.kv_cache_bytes")


def _quantization(name: str) -> Quantization:
    try:
        return Quantization(name)
    except ValueError:
        raise EngineError(f"engine.quantization {name!r} is not one of {', '.join(q.value for q in Quantization)}") from None


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [num_sampled] rows of the flat batch whose logits are needed
    sampled_batch_indices: tuple[int, ...]  # for each logit row, its index in the batch
    sampling_rows: list[SamplingRow]


class ModelRunner:
    def __init__(self, model_dir: Path | str, config: EngineConfig, *, max_model_len: int | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.args: ModelArgs = load_model_args(Path(model_dir))
        saved_dtype = checkpoint_dtype(Path(model_dir))
        self.dtype = resolve_dtype(config.dtype, self.device, saved_dtype)
        self.max_model_len = max_model_len or self.args.max_position_embeddings
        self.block_size = config.block_size
        self.kernel_mode = kernels.resolve_mode(
            enabled=config.native_kernels, isa=config.kernel_isa, device=self.device, dtype=self.dtype
        )
        self.use_kernel = self.kernel_mode is not KernelMode.TORCH
        self.cpu = kernels.load_kernels(self.kernel_mode) if self.use_kernel else None
        self.quantization = _quantization(config.quantization)
        # A LLaVA checkpoint: the language model under 'language_model.', plus the vision tower.
        self.vision = VisionTower(Path(model_dir), self.dtype, self.device) if is_llava(Path(model_dir)) else None
        prefix = "language_model." if self.vision is not None else ""
        weights = load_model_weights(Path(model_dir), self.args, self.dtype, self.device, name_prefix=prefix)
        weights = prepare_linear_layers(weights, self.cpu, self.quantization)
        self.model = Model(self.args, weights, self.max_model_len, cpu=self.cpu)
        # Sliding layers and soft-capped scores are attended on the gather path, also when the
        # decode kernel serves the other layers.
        self.sliding_window = self.args.sliding_window
        self.gather_decode = not self.use_kernel or self.sliding_window is not None or self.args.attn_logit_softcap is not None
        self.num_kv_blocks = self._num_kv_blocks()
        a = self.args
        self.kv_pool, self.kv_caches = allocate_kv_cache(
            a.num_layers, self.num_kv_blocks, self.block_size, a.num_kv_heads, a.head_dim, self.dtype, self.device
        )
        self.sampler = Sampler(a.vocab_size)
        log.info(
            "model_loaded",
            model_dir=str(model_dir),
            model_type=self.args.model_type,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            checkpoint_dtype=str(saved_dtype).removeprefix("torch.") if saved_dtype else "unknown",
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            kernel_mode=self.kernel_mode.value,
            quantization=self.quantization.value,
            fused_layer_kernels=self.model.fused_cpu_ops,
            one_call_decode_step=self.model.uses_decode_stack,
        )

    @property
    def kv_bytes_per_block(self) -> int:
        a = self.args
        return a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_bytes
        if budget <= 0:
            budget = int(free_memory_bytes(self.device) * self.config.kv_cache_memory_fraction)
        # More than every slot's longest sequence twice over (the rest as prefix cache) is waste.
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        num_blocks = min(budget // self.kv_bytes_per_block, 2 * self.config.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise EngineError(f"KV cache budget of {budget} bytes holds no block of {self.kv_bytes_per_block} bytes")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run one step; returns the sampled token per sequence (None: prefill not yet done)."""
        inputs = self.prepare(batch)
        # Vision models: this step's image tokens take their images' embeddings (encoded now, batched).
        image_rows = None if self.vision is None else self.vision.step_embeddings(batch.seqs, batch.num_scheduled_tokens)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, image_rows)
        sampled: list[int | None] = [None] * len(batch.seqs)
        if inputs.sampled_batch_indices:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))
            tokens = self.sampler(logits, inputs.sampling_rows)
            for batch_index, token in zip(inputs.sampled_batch_indices, tokens, strict=True):
                sampled[batch_index] = token
        return sampled

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        decodes = [i for i, n in enumerate(batch.num_scheduled_tokens) if n == 1]
        prefills = [i for i, n in enumerate(batch.num_scheduled_tokens) if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i in decodes:
            seq = batch.seqs[i]
            p = seq.num_computed_tokens
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        decode_meta = self._decode_metadata([batch.seqs[i] for i in decodes], positions)
        slot_arrays = [np.asarray(slots, dtype=np.int64)]
        position_arrays = [np.asarray(positions, dtype=np.int64)]
        chunks = []
        for i in prefills:
            seq, n = batch.seqs[i], batch.num_scheduled_tokens[i]
            chunk, chunk_slots, chunk_positions = self._prefill_chunk(seq, n, len(input_ids))
            input_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
            chunks.append(chunk)
            slot_arrays.append(chunk_slots)
            position_arrays.append(chunk_positions)
        slot_mapping = np.concatenate(slot_arrays)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            slot_blocks=self._to_device(slot_mapping // bs),
            slot_offsets=self._to_device(slot_mapping % bs),
            num_decode_tokens=len(decodes),
            prefills=tuple(chunks),
            block_size=bs,
            **decode_meta,
        )
        rows, batch_indices, sampling_rows = self._sampling_rows(batch, decodes, chunks, prefills)
        return StepInputs(
            input_ids=self._to_device(np.asarray(input_ids, dtype=np.int64)),
            positions=self._to_device(np.concatenate(position_arrays)),
            meta=meta,
            logit_rows=self._to_device(np.asarray(rows, dtype=np.int64)),
            sampled_batch_indices=tuple(batch_indices),
            sampling_rows=sampling_rows,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _decode_metadata(self, seqs: list[Sequence], positions: list[int]) -> dict:
        meta = dict(
            decode_block_tables=None, decode_context_lens=None, decode_max_context_len=0, decode_slots=None,
            decode_mask=None, decode_window_mask=None,
        )
        if not seqs:
            return meta
        bs = self.block_size
        context_lens = np.asarray(positions, dtype=np.int32) + 1
        max_len = int(context_lens.max())
        max_blocks = -(-max_len // bs)
        tables = np.empty((len(seqs), max_blocks), dtype=np.int32)
        for row, seq in zip(tables, seqs):
            table = _live_table(seq)[:max_blocks]
            row[: len(table)] = table
            row[len(table) :] = table[0]  # padding points at written slots: finite, masked out
        meta["decode_max_context_len"] = max_len
        if self.use_kernel:
            meta.update(
                decode_block_tables=torch.from_numpy(tables), decode_context_lens=torch.from_numpy(context_lens),
                decode_kernel=self.cpu.paged_decode_attention,
            )
        else:
            meta["decode_block_tables"] = self._to_device(tables)
        if self.gather_decode:
            slot_grid = (tables[:, :, None] * bs + np.arange(bs, dtype=np.int32)).reshape(len(seqs), -1)[:, :max_len]
            index = np.arange(max_len)[None, :]
            # Released positions (outside every window, masked) read the first live slot: written, finite.
            first_live = np.asarray([seq.num_released_blocks * bs for seq in seqs])[:, None]
            slot_grid = np.where(index < first_live, tables[:, :1] * bs, slot_grid)
            valid = index < context_lens[:, None]
            meta["decode_slots"] = self._to_device(np.where(valid, slot_grid, slot_grid[:, :1]).astype(np.int64))
            meta["decode_mask"] = self._to_device(valid[:, None, None, :])
            if self.sliding_window is not None:  # positions p - window + 1 .. p
                in_window = valid & (index > context_lens[:, None] - 1 - self.sliding_window)
                meta["decode_window_mask"] = self._to_device(in_window[:, None, None, :])
        return meta

    def _prefill_chunk(self, seq: Sequence, num_tokens: int, row_start: int) -> tuple[PrefillChunk, np.ndarray, np.ndarray]:
        bs = self.block_size
        start = seq.num_computed_tokens
        table = np.asarray(_live_table(seq), dtype=np.int64)
        context = np.arange(start + num_tokens, dtype=np.int64)
        context_slots = table[context // bs] * bs + context % bs
        released = seq.num_released_blocks * bs  # positions before it: outside every window, masked
        context_slots[:released] = table[seq.num_released_blocks] * bs
        chunk_positions = context[start:]
        end = row_start + num_tokens
        window_mask = None
        if self.sliding_window is not None:  # [q_len, context_len]: causal, within the window
            keys = context[start:] if start == 0 else context
            causal = keys[None, :] <= chunk_positions[:, None]
            window_mask = self._to_device(causal & (keys[None, :] > chunk_positions[:, None] - self.sliding_window))
        if start == 0:  # no cached context: attend within the chunk, plain causal
            chunk = PrefillChunk(row_start, end, len(context), None, None, None, window_mask)
        else:
            mask = context[None, :] <= chunk_positions[:, None]  # [q_len, context_len], bottom-right causal
            blocks = table[: -(-len(context) // bs)]
            chunk = PrefillChunk(
                row_start, end, len(context), self._to_device(blocks), self._to_device(context_slots),
                self._to_device(mask), window_mask, gather_keys_by_slot=released > 0,
            )
        return chunk, context_slots[start:], chunk_positions

    @property
    def kv_window(self) -> int | None:
        """The window of a model whose every layer slides: its sequences keep only that much KV."""
        windows = {layer.sliding_window for layer in self.args.layers}
        return windows.pop() if len(windows) == 1 else None

    def _sampling_rows(self, batch, decodes, chunks, prefills) -> tuple[list[int], list[int], list[SamplingRow]]:
        rows, batch_indices, sampling_rows = [], [], []
        candidates = [(i, row) for row, i in enumerate(decodes)]
        candidates += [(i, chunk.end - 1) for i, chunk in zip(prefills, chunks)]
        for i, row in candidates:
            seq = batch.seqs[i]
            if seq.num_computed_tokens + batch.num_scheduled_tokens[i] < seq.num_tokens:
                continue  # mid-prompt chunk: no token yet
            rows.append(row)
            batch_indices.append(i)
            sink = seq.logprobs if seq.sampling.logprobs is not None else None
            if seq.sampling.repetition_penalty != 1.0 and seq.seen_tokens is None:
                seq.seen_tokens = SeenTokens(self.args.vocab_size, self.device)
            sampling_rows.append(SamplingRow(
                seq.sampling, seq.token_ids, seq.num_prompt_tokens, seq.stop_token_ids, seq.grammar, sink, seq.seen_tokens
            ))
        return rows, batch_indices, sampling_rows


def _live_table(seq: Sequence) -> list[int]:
    """The block table with released entries (stale ids) pointing at the first block still held."""
    released = seq.num_released_blocks
    if not released:
        return seq.block_table
    return [seq.block_table[released]] * released + seq.block_table[released:]
