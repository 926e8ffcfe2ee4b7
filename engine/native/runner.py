"""Loads the model, owns the KV pools (one per KV group), runs steps, samples.

A step: batch_inputs.py turns the ScheduledBatch into flat model inputs and attention metadata,
one forward pass runs, logits are computed only for rows that produce a token, and sampled.
Per-step Python work is proportional to sequences, not tokens, wherever it can be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from engine.native import kernels
from engine.native.attention import AttentionMetadata, allocate_kv_cache
from engine.native.batch_inputs import BatchInputBuilder, BatchInputs, DecodeShape, KVLayout
from engine.native.cuda_graphs import DecodeGraphs
from engine.native.families import ModelArgs
from engine.native.kernels import KernelMode
from engine.native.linear_attention import RecurrentPools
from engine.native.loader import checkpoint_dtype, language_model_names, load_model_args, load_model_weights
from engine.native.model import LinearPreparer, Model
from engine.native.quant import Quantization
from engine.native.sampler import Sampler, SamplingRow, SeenTokens, prompt_logprobs
from engine.native.scheduler import ScheduledBatch
from engine.native.sequence import Sequence
from engine.native.vision import VisionTower, is_llava
from engine.types import EngineError
from settings import EngineConfig

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROMPT_LOGPROB_ROWS = 64  # prompt positions scored at once: 39 MB of logits with Qwen's 152k vocabulary


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


def use_cuda_attention_backends() -> None:
    """Keep SDPA off its cuDNN backend (process-wide), leaving flash, memory-efficient and math.

    cuDNN builds an execution graph for every new shape, and the engine's shapes change every
    step (the context grows by one; batches and prefill chunks vary). On an H200 (torch 2.11)
    a decode-shaped call on a context growing by one took 86 ms on cuDNN and 4 ms on the others,
    and turning it off took 32-stream decode of the 30M reference from 904 to 3,928 tok/s
    (bench/RESULTS.md, "On a GPU")."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuda_sdpa_backends", cudnn=False, flash=True, mem_efficient=True, math=True)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise EngineError("cannot read MemAvailable from /proc/meminfo; set engine.kv_cache_bytes")


# "auto" keeps AMX's bf16 weight copies only when the float32 weights and the copies together take
# at most this share of the memory available before loading: the rest is the KV cache's.
AMX_COPIES_MAX_MEMORY_SHARE = 0.6


def _bf16_copies_fit(args: ModelArgs) -> bool:
    """Whether engine.amx_prefill "auto" can afford a bf16 copy of every decoder matmul weight
    (+50% weight memory) on this machine; logs why not. A 3.1B model on 24 GB took 18.6 GB with
    them, 13 GB without."""
    decoder = args.num_parameters - args.vocab_size * args.hidden_size  # the lm_head gets no copy
    num_bytes = 6 * decoder  # float32 and bfloat16
    available = free_memory_bytes(torch.device("cpu"))
    if num_bytes <= AMX_COPIES_MAX_MEMORY_SHARE * available:
        return True
    log.warning(
        "amx_prefill_off_for_memory",
        weights_and_copies_gib=round(num_bytes / 2**30, 1),
        available_gib=round(available / 2**30, 1),
        hint='engine.amx_prefill = "on" keeps the copies anyway',
    )
    return False


def _cuda_graphs_mode(name: str, device: torch.device, compiled_kernels: bool) -> str:
    """engine.cuda_graphs -> "capture", "eager" (padded, not captured) or "off"."""
    if name not in ("auto", "off", "eager"):
        raise EngineError(f"engine.cuda_graphs {name!r} is not one of auto, off, eager")
    if name == "eager" and compiled_kernels:
        raise EngineError('engine.cuda_graphs = "eager" runs PyTorch ops: on the CPU set engine.kernel_isa = "torch"')
    if name == "auto":
        return "capture" if device.type == "cuda" else "off"
    return name


def _quantization(name: str) -> Quantization:
    try:
        return Quantization(name)
    except ValueError:
        raise EngineError(
            f"engine.quantization {name!r} is not one of {', '.join(q.value for q in Quantization)}"
        ) from None


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [num_sampled] rows of the flat batch whose logits are needed
    sampled_batch_indices: tuple[int, ...]  # for each logit row, its index in the batch
    sampling_rows: list[SamplingRow]
    # (batch index, first row, number of rows): prompt positions this step whose next prompt
    # token's logprob was asked for (sampling.prompt_logprobs); empty for nearly every step.
    prompt_rows: tuple[tuple[int, int, int], ...] = ()
    # (batch index, first row, number of rows): a sequence feeding draft tokens (speculation.py),
    # whose every row's argmax is returned.
    draft_rows: tuple[tuple[int, int, int], ...] = ()


class ModelRunner:
    def __init__(self, model_dir: Path | str, config: EngineConfig, *, max_model_len: int | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            use_cuda_attention_backends()
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
        # A LLaVA checkpoint: the language model under 'language_model.', plus the vision tower; a
        # Gemma 3 one (4B and up) its language model alone (loader.WRAPPED_LANGUAGE_MODELS).
        self.vision = VisionTower(Path(model_dir), self.dtype, self.device) if is_llava(Path(model_dir)) else None
        renames = language_model_names(Path(model_dir))
        self.amx_prefill = kernels.resolve_amx_prefill(
            config.amx_prefill,
            mode=self.kernel_mode,
            is_quantized=self.quantization is not Quantization.NONE,
            checkpoint_dtype=saved_dtype,
        )
        if self.amx_prefill and config.amx_prefill == "auto" and not _bf16_copies_fit(self.args):
            self.amx_prefill = False
        preparer = LinearPreparer(self.cpu, self.quantization, self.args, amx=self.amx_prefill)
        weights = preparer.head(
            load_model_weights(
                Path(model_dir), self.args, self.dtype, self.device, renames=renames, prepare=preparer.layer
            )
        )
        self.model = Model(self.args, weights, self.max_model_len, cpu=self.cpu)
        self.sliding_window = self.args.sliding_window
        # KV groups (block_manager.py): one for every layer, or, when sliding layers mix with
        # global ones, group 0 for the global layers and group 1 (window-sized) for the sliding.
        self.layer_groups = self.args.kv_groups
        self.is_hybrid = any(self.layer_groups)
        self.group_windows = (None, self.sliding_window) if self.is_hybrid else (self.sliding_window,)
        # Qwen3.5's Gated DeltaNet layers: a recurrent state per running sequence instead of KV
        # (linear_attention.py), one row per sequence the scheduler may run at once.
        shape = self.args.linear_attention
        self.num_state_slots = config.max_num_seqs if shape is not None else 0
        self.state_bytes = RecurrentPools.bytes_per_slot(shape, self.args.num_linear_layers) if shape else 0
        self.group_num_blocks = self._num_kv_blocks()
        self.num_kv_blocks = self.group_num_blocks[0]
        graphs = _cuda_graphs_mode(config.cuda_graphs, self.device, self.use_kernel)
        if shape is not None and graphs != "off":
            log.info("cuda_graphs_off", reason="a recurrent state per sequence (Gated DeltaNet layers)")
            graphs = "off"
        # Padded decode steps (cuda_graphs.py) need a scratch block per KV group: the pool's last,
        # which the block managers (sized by group_num_blocks) never hand out.
        scratch = 1 if graphs != "off" else 0
        a = self.args
        self.kv_pool, self.kv_group_pools, kv_caches = allocate_kv_cache(
            tuple(group for group, spec in zip(self.layer_groups, a.layers, strict=True) if not spec.linear),
            tuple(n + scratch for n in self.group_num_blocks),
            self.block_size,
            a.num_kv_heads,
            a.head_dim,
            self.dtype,
            self.device,
        )
        # Per layer: its (k_cache, v_cache), or a Gated DeltaNet layer's (conv, delta-rule) state pools
        self.recurrent = (
            RecurrentPools(shape, a.num_linear_layers, self.num_state_slots, self.device) if shape is not None else None
        )
        attention_caches, state_pools = iter(kv_caches), iter(self.recurrent.layers if self.recurrent else ())
        self.kv_caches = [next(state_pools) if spec.linear else next(attention_caches) for spec in a.layers]
        self.sampler = Sampler(a.vocab_size, device=self.device)
        self.batch_inputs = BatchInputBuilder(
            KVLayout(
                self.block_size,
                self.group_windows,
                self.device,
                self.cpu.paged_decode_attention if self.cpu is not None else None,
                scratch_blocks=self.group_num_blocks if scratch else None,
                recurrent=shape is not None,
            )
        )
        model, kv_caches = self.model, self.kv_caches  # not self: no cycle through the runner
        self.decode_graphs = (
            None
            if graphs == "off"
            else DecodeGraphs(
                lambda ids, positions, meta: model.forward(ids, positions, kv_caches, meta),
                self.batch_inputs,
                max_rows=config.max_num_seqs,
                max_len=self.max_model_len,
                capture=graphs == "capture",
            )
        )
        log.info(
            "model_loaded",
            model_dir=str(model_dir),
            model_type=self.args.model_type,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            checkpoint_dtype=str(saved_dtype).removeprefix("torch.") if saved_dtype else "unknown",
            num_kv_blocks=self.num_kv_blocks,
            num_sliding_kv_blocks=self.group_num_blocks[1] if self.is_hybrid else None,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            kernel_mode=self.kernel_mode.value,
            quantization=self.quantization.value,
            amx_prefill=self.amx_prefill,
            fused_layer_kernels=self.model.fused_cpu_ops,
            one_call_decode_step=self.model.uses_decode_stack,
            recurrent_state_mib=round(self.num_state_slots * self.state_bytes / 2**20, 1) if self.recurrent else None,
            cuda_graphs=graphs,
        )

    @property
    def kv_bytes_per_block(self) -> int:
        """One block of every layer with a KV cache (in a hybrid model, of group 0's and group 1's
        layers together; Qwen3.5's Gated DeltaNet layers have none)."""
        return self.args.num_attention_layers * self._layer_block_bytes

    @property
    def _layer_block_bytes(self) -> int:
        a = self.args
        return 2 * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _kv_budget_bytes(self) -> int:
        """engine.kv_cache_bytes, or the configured share of free memory less the recurrent states
        (Qwen3.5: a row for each sequence that may run at once), which come out of that share."""
        if self.config.kv_cache_bytes > 0:
            return self.config.kv_cache_bytes
        share = int(free_memory_bytes(self.device) * self.config.kv_cache_memory_fraction)
        states = self.num_state_slots * self.state_bytes
        if states and states >= share:
            raise EngineError(
                f"the recurrent states of engine.max_num_seqs = {self.num_state_slots} sequences take "
                f"{states / 2**20:.1f} MiB, more than the KV cache's share of free memory "
                f"({share / 2**20:.1f} MiB): lower engine.max_num_seqs or raise engine.kv_cache_memory_fraction"
            )
        return share - states

    def _num_kv_blocks(self) -> tuple[int, ...]:
        """Blocks per KV group. A hybrid model's sliding group gets what its running sequences'
        windows can use (twice, the rest as prefix cache), at most as many blocks as a single
        pool would have; the global group the rest of the budget. Either way a sequence the
        global group can hold fits the sliding one: that is as large, or holds every window."""
        budget = self._kv_budget_bytes()
        # More than every slot's longest sequence twice over (the rest as prefix cache) is waste.
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        cap = 2 * self.config.max_num_seqs * blocks_per_seq
        uniform = budget // self.kv_bytes_per_block
        if uniform < 1:
            raise EngineError(f"KV cache budget of {budget} bytes holds no block of {self.kv_bytes_per_block} bytes")
        if not self.is_hybrid:
            return (int(min(uniform, cap)),)
        assert self.sliding_window is not None  # a hybrid model has sliding layers
        num_window_layers = sum(self.layer_groups)
        window_blocks_per_seq = -(-(self.sliding_window - 1) // self.block_size) + 2
        window_need = self.config.max_num_seqs * window_blocks_per_seq + -(
            -self.config.max_num_batched_tokens // self.block_size
        )
        num_window = min(uniform, 2 * window_need, cap)
        left = budget - num_window * num_window_layers * self._layer_block_bytes
        num_full = min(left // ((self.args.num_layers - num_window_layers) * self._layer_block_bytes), cap)
        return (int(num_full), int(num_window))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | list[int] | None]:
        """Run one step; returns the sampled token per sequence (None: prefill not yet done; a
        sequence with draft tokens: the argmax after each of its rows)."""
        # Vision models: this step's image tokens take their images' embeddings (encoded now, batched).
        image_rows = (
            None if self.vision is None else self.vision.step_embeddings(batch.seqs, batch.num_scheduled_tokens)
        )
        graphs = self.decode_graphs if image_rows is None else None
        shape = graphs.shape_for(batch) if graphs is not None else None
        inputs = self.prepare(batch, shape)
        for row in inputs.sampling_rows:
            if row.grammar is not None:
                row.grammar.prefetch_mask()  # computed while the forward runs
        if graphs is not None and shape is not None:
            hidden = graphs.forward(shape, len(batch.seqs), inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, image_rows)
        sampled: list[int | list[int] | None] = [None] * len(batch.seqs)
        if inputs.sampled_batch_indices:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))
            tokens = self.sampler(logits, inputs.sampling_rows)
            for batch_index, token in zip(inputs.sampled_batch_indices, tokens, strict=True):
                sampled[batch_index] = token
        for batch_index, first_row, num_rows in inputs.draft_rows:  # greedy and nothing else (speculation.eligible)
            logits = self.model.compute_logits(hidden[first_row : first_row + num_rows])
            sampled[batch_index] = logits.argmax(-1).tolist()
        for batch_index, first_row, num_rows in inputs.prompt_rows:
            self._record_prompt_logprobs(batch.seqs[batch_index], hidden, first_row, num_rows)
        return sampled

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, first_row: int, num_rows: int) -> None:
        """Fill the prompt logprobs of this step's positions, in slices of rows so that the
        logits ([rows, vocab], float32) stay small with a 150k vocabulary."""
        assert seq.prompt_logprobs is not None and seq.sampling.prompt_logprobs is not None
        start = seq.num_computed_tokens  # this step's first position (counts advance after the step)
        for offset in range(0, num_rows, _PROMPT_LOGPROB_ROWS):
            n = min(_PROMPT_LOGPROB_ROWS, num_rows - offset)
            logits = self.model.compute_logits(hidden[first_row + offset : first_row + offset + n])
            first = start + offset + 1  # the prompt position whose token row `first_row + offset` predicts
            seq.prompt_logprobs[first : first + n] = prompt_logprobs(
                logits, seq.token_ids[first : first + n], seq.sampling.prompt_logprobs
            )

    def prepare(self, batch: ScheduledBatch, padded: DecodeShape | None = None) -> StepInputs:
        inputs = self.batch_inputs.build(batch, padded)
        rows, batch_indices, sampling_rows = self._sampling_rows(batch, inputs)
        asks_prompt_logprobs = any(seq.prompt_logprobs is not None for seq in batch.seqs)
        draft_rows = tuple(
            (i, end - batch.num_scheduled_tokens[i], batch.num_scheduled_tokens[i])
            for i, end in zip(inputs.prefills, inputs.chunk_ends, strict=True)
            if batch.seqs[i].num_draft_tokens
        )
        return StepInputs(
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            meta=inputs.meta,
            logit_rows=torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.device, non_blocking=True),
            sampled_batch_indices=tuple(batch_indices),
            sampling_rows=sampling_rows,
            prompt_rows=self._prompt_rows(batch, inputs) if asks_prompt_logprobs else (),
            draft_rows=draft_rows,
        )

    @staticmethod
    def _prompt_rows(batch: ScheduledBatch, inputs: BatchInputs) -> tuple[tuple[int, int, int], ...]:
        """For sequences asking for prompt logprobs: this step's rows whose next token is still
        in the prompt (a one-token chunk sits among the decode rows)."""
        spans = [(i, row, 1) for row, i in enumerate(inputs.decodes)]
        spans += [
            (i, end - batch.num_scheduled_tokens[i], batch.num_scheduled_tokens[i])
            for i, end in zip(inputs.prefills, inputs.chunk_ends, strict=True)
        ]
        out = []
        for i, first_row, num_rows in spans:
            seq = batch.seqs[i]
            if seq.prompt_logprobs is None:
                continue
            start = seq.num_computed_tokens
            num = min(start + num_rows, seq.num_prompt_tokens - 1) - start
            if num > 0:
                out.append((i, first_row, num))
        return tuple(out)

    def _sampling_rows(
        self, batch: ScheduledBatch, inputs: BatchInputs
    ) -> tuple[list[int], list[int], list[SamplingRow]]:
        rows, batch_indices, sampling_rows = [], [], []
        candidates = [(i, row) for row, i in enumerate(inputs.decodes)]
        candidates += [(i, end - 1) for i, end in zip(inputs.prefills, inputs.chunk_ends, strict=True)]
        for i, row in candidates:
            seq = batch.seqs[i]
            if seq.num_computed_tokens + batch.num_scheduled_tokens[i] < seq.num_tokens or seq.num_draft_tokens:
                continue  # mid-prompt chunk: no token yet; drafts: every row's argmax instead (draft_rows)
            rows.append(row)
            batch_indices.append(i)
            sink = seq.logprobs if seq.sampling.logprobs is not None else None
            if seq.sampling.repetition_penalty != 1.0 and seq.seen_tokens is None:
                seq.seen_tokens = SeenTokens(self.args.vocab_size, self.device)
            sampling_rows.append(_sampling_row(seq, sink))
        return rows, batch_indices, sampling_rows


def _sampling_row(seq: Sequence, sink: list | None) -> SamplingRow:
    """What the sampler needs of a sequence. A reasoning model under a grammar thinks freely:
    the grammar constrains the answer after the thinking (its first token may still open it),
    and the thinking may not end the sequence before the answer came."""
    thinking, grammar = seq.thinking, seq.grammar
    if thinking is None:
        return SamplingRow(
            seq.sampling, seq.token_ids, seq.num_prompt_tokens, seq.stop_token_ids, grammar, sink, seq.seen_tokens
        )
    in_thought = grammar is not None and thinking.inside
    return SamplingRow(
        seq.sampling,
        seq.token_ids,
        seq.num_prompt_tokens,
        seq.stop_token_ids,
        None if in_thought else grammar,
        sink,
        seq.seen_tokens,
        forced=thinking.forced_token(),
        also_allowed=thinking.budget.open_id if grammar is not None and thinking.samples_thinking else None,
        mask_stop=in_thought,
    )
