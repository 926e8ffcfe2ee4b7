"""LLMEngine: requests in, per-step token outputs out; synchronous and single-threaded.

Wires the Scheduler (what to compute) to the ModelRunner (computing it) and keeps the
request-id map and counters. It never touches tensors itself; the async front (backend.py)
drives `step()` from one worker thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.native.block_manager import BlockManager
from engine.native.hybrid_blocks import HybridBlockManager
from engine.native.scheduler import Scheduler, SchedulerConfig
from engine.native.sequence import Sequence
from engine.native.state_slots import StateSlotManager
from engine.types import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    StructuredOutput,
    TokenLogprob,
    check_fits_context,
)
from settings import EngineConfig

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler, GrammarMatcher
    from engine.native.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request; counts are cumulative."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # for new_token_ids, when the request asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # with the first token, when the request asked


# On CPU a step's time grows with its tokens, so a step that decodes running streams takes
# prompt tokens in small chunks; on CUDA a 512-token step costs about what a decode step does.
_CPU_PREFILL_TOKENS_WHILE_DECODING = 32


def _prefill_cap(config: EngineConfig, device_type: str) -> int | None:
    if config.max_prefill_tokens_while_decoding > 0:
        return config.max_prefill_tokens_while_decoding
    return _CPU_PREFILL_TOKENS_WHILE_DECODING if device_type == "cpu" else None


def _block_manager(
    runner: ModelRunner, enable_prefix_caching: bool
) -> BlockManager | HybridBlockManager | StateSlotManager:
    """One manager per KV group of the runner's pools; two are paired (hybrid_blocks.py). A model
    with a recurrent state per sequence (Qwen3.5) also hands out its state rows (state_slots.py),
    without prefix caching: a state summarizes its whole prefix, and blocks alone cannot restore it."""
    if runner.recurrent is not None:
        blocks = BlockManager(runner.group_num_blocks[0], runner.block_size, enable_prefix_caching=False)
        return StateSlotManager(blocks, runner.num_state_slots)
    groups = [
        BlockManager(
            num_blocks, runner.block_size, enable_prefix_caching=enable_prefix_caching, sliding_window=window, group=g
        )
        for g, (num_blocks, window) in enumerate(zip(runner.group_num_blocks, runner.group_windows, strict=True))
    ]
    return groups[0] if len(groups) == 1 else HybridBlockManager(*groups)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...],
        grammar: GrammarCompiler | None = None,
    ):
        self.runner = runner
        self.grammar = grammar  # None: structured outputs are refused
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = runner.max_model_len
        self.block_manager = _block_manager(runner, config.enable_prefix_caching)
        self.scheduler: Scheduler[Any] = Scheduler(  # the prefix-hit entry type differs per block manager
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                _prefill_cap(config, runner.device.type),
                # Drafts are rolled back when rejected: neither image rows nor a recurrent state can be
                speculative_tokens=0 if runner.vision is not None or runner.recurrent else config.speculative_tokens,
            ),
            self.block_manager,
        )
        self._seqs: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self.num_prompt_tokens_processed = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path | str,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...],
        max_model_len: int | None = None,
    ) -> LLMEngine:
        from engine.grammar import GrammarCompiler
        from engine.native.runner import ModelRunner  # torch is imported here, not at module import

        runner = ModelRunner(model_dir, config, max_model_len=max_model_len)
        tokenizer_file = Path(model_dir) / "tokenizer.json"
        grammar = None
        if tokenizer_file.exists():  # without one (some test checkpoints) structured outputs are refused
            grammar = GrammarCompiler(tokenizer_file, vocab_size=runner.args.vocab_size, eos_token_ids=eos_token_ids)
        return cls(runner, config, eos_token_ids=eos_token_ids, grammar=grammar)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + answer) the whole KV pool can hold: the last sampled
        token's K/V is never computed, so one more than the pool's slots."""
        return self.block_manager.num_blocks * self.block_manager.block_size + 1

    def check_request(self, request: GenerationRequest) -> None:
        """Reject what could never run: too long for the context window or the whole KV pool."""
        check_fits_context(request, self.max_model_len)
        thinking, vocab_size = request.sampling.thinking, self.runner.args.vocab_size
        beyond = max(request.prompt_token_ids, default=0)
        if beyond >= vocab_size or min(request.prompt_token_ids, default=0) < 0:
            raise RequestRejected(
                f"the prompt holds the token id {beyond}, beyond this model's {vocab_size} embeddings (its tokenizer "
                "has tokens the model was not resized for; leave them out of the text)",
                param="messages",
            )
        biased = [t for t, _ in request.sampling.logit_bias if t >= vocab_size]
        if biased:
            raise RequestRejected(
                f"'logit_bias' names the token id {biased[0]}; this model's ids run from 0 to {vocab_size - 1}",
                param="logit_bias",
            )
        if thinking is not None and max(thinking.open_id, thinking.close_id, *thinking.forced_ids) >= vocab_size:
            raise RequestRejected(
                f"the thinking budget's tags or message hold a token id outside the model's {vocab_size} logits",
                param="thinking_token_budget",
            )
        num_prompt = len(request.prompt_token_ids)
        total = num_prompt + request.sampling.max_tokens
        if total > self.max_sequence_tokens:
            capacity = self.block_manager.num_blocks * self.block_manager.block_size
            raise RequestRejected(
                f"the request needs {total} tokens of KV cache ({num_prompt} prompt + "
                f"{request.sampling.max_tokens} max_tokens) but the whole cache holds {capacity}",
                param="max_tokens",
                code="kv_cache_too_small",
            )

    def add_request(self, request: GenerationRequest) -> None:
        self.check_request(request)
        if request.request_id in self._seqs:
            raise RequestRejected(f"request id {request.request_id!r} is already running", param="request_id")
        if self.config.prefix_cache_scope == "shared":  # one namespace for all tenants, by config
            request = replace(request, cache_salt=None)
        seq = Sequence(next(self._seq_ids), request, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        if request.sampling.structured is not None:
            seq.grammar = self._matcher(request.sampling.structured)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def _matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        from engine.grammar import GrammarError

        if self.grammar is None:
            raise RequestRejected("this engine was built without a grammar compiler", param="response_format")
        try:
            return self.grammar.matcher(structured)
        except GrammarError as exc:
            raise RequestRejected(str(exc), param="response_format") from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Retire a request wherever it is and free its blocks; None if it is not here."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        return self._output(seq, ())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            sampled = self.runner.execute(batch)
        except BaseException:
            self.scheduler.discard_drafts(batch)
            raise
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            # Everything but a decode token (and its drafts) is prefill work (recompute after preemption included).
            if not seq.num_draft_tokens and (seq.num_completion_tokens == 0 or seq.num_uncomputed_tokens > 1):
                self.num_prompt_tokens_processed += n
        updated = self.scheduler.postprocess(batch, sampled)
        outputs = []
        for seq in updated:
            self.num_generation_tokens += seq.num_new_tokens
            if seq.is_finished:
                del self._seqs[seq.request_id]
            outputs.append(self._output(seq, tuple(seq.token_ids[-seq.num_new_tokens :])))
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=bm.num_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_processed=self.num_prompt_tokens_processed,
            num_generation_tokens=self.num_generation_tokens,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_draft_tokens=self.scheduler.num_accepted_draft_tokens,
        )

    @staticmethod
    def _output(seq: Sequence, new_token_ids: tuple[int, ...]) -> RequestOutput:
        logprobs = tuple(seq.logprobs[-len(new_token_ids) :]) if new_token_ids and seq.logprobs else ()
        first = bool(new_token_ids) and seq.num_completion_tokens == len(new_token_ids)
        prompt = tuple(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else ()
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_completion_tokens=seq.num_completion_tokens,
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt,
        )
