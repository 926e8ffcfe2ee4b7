"""TensorRT-LLM backend: hands each request to TensorRT-LLM's own in-flight batcher.

Owns one `tensorrt_llm.LLM` (built once in start(), off the event loop), the cap on requests
in flight inside it (TensorRT-LLM 1.x serves FCFS with no priority, so our priority queue
admits in front by `has_room()`), the translation of each streamed RequestOutput into
TokenEvents, and a task that drains iteration stats. `tensorrt_llm` is imported only in
start(): the rest of the server never needs the optional package.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import structlog

from engine.tokenizer import Tokenizer
from engine.trtllm.flight import Flight
from engine.trtllm.mapping import (
    GUIDED_DECODING_BACKENDS,
    SCHEDULER_POLICIES,
    IterationStats,
    TrtllmApi,
    accepts,
    guided_decoding_kwargs,
    llm_kwargs,
    parse_iteration_stats,
    sampling_kwargs,
    supported_kwargs,
    unsupported_reason,
)
from engine.trtllm.slots import SlotPool
from engine.types import (
    EngineError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    StructuredKind,
    TokenEvent,
    check_fits_context,
)
from settings import ConfigError, TrtllmConfig

log = structlog.get_logger(__name__)

INSTALL_HINT = "install it on a GPU host with requirements-trtllm.txt (see docs/trtllm.md)"


class BackendState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # the executor died; health() is False from here on
    STOPPED = "stopped"


def load_api() -> TrtllmApi:
    """Import TensorRT-LLM; ConfigError (a clean startup error) when it is not installed."""
    try:
        trt = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
    except ImportError as exc:
        raise ConfigError(f"backend 'trtllm' needs the tensorrt_llm package ({exc}); {INSTALL_HINT}") from None
    return TrtllmApi(
        LLM=trt.LLM,
        SamplingParams=trt.SamplingParams,
        KvCacheConfig=llmapi.KvCacheConfig,
        SchedulerConfig=llmapi.SchedulerConfig,
        CapacitySchedulerPolicy=llmapi.CapacitySchedulerPolicy,
        RequestError=llmapi.RequestError,
        version=str(getattr(trt, "__version__", "unknown")),
        GuidedDecodingParams=getattr(llmapi, "GuidedDecodingParams", None),
    )


class TrtllmBackend:
    """The `Backend` protocol over `tensorrt_llm.LLM.generate_async(..., streaming=True)`."""

    def __init__(self, model_dir: Path, config: TrtllmConfig, tokenizer: Tokenizer, *, max_model_len: int | None):
        if config.scheduler_policy not in SCHEDULER_POLICIES:
            expected = ", ".join(SCHEDULER_POLICIES)
            raise ConfigError(f"trtllm.scheduler_policy: expected one of {expected}, got {config.scheduler_policy!r}")
        if config.guided_decoding_backend not in GUIDED_DECODING_BACKENDS:
            expected = ", ".join(GUIDED_DECODING_BACKENDS)
            raise ConfigError(
                f"trtllm.guided_decoding_backend: expected one of {expected}, got {config.guided_decoding_backend!r}"
            )
        limits = [n for n in (max_model_len, config.max_seq_len) if n]
        if not limits:
            raise ConfigError("trtllm: the model's context length is unknown; set trtllm.max_seq_len or max_model_len")
        self._model_dir = Path(model_dir)
        self._config = config
        self._tokenizer = tokenizer
        self._max_model_len = min(limits)
        self.max_in_flight = config.max_in_flight or config.max_batch_size
        self.abort_grace_s = 5.0  # how long an aborted request may take to report 'cancelled'
        self.state = BackendState.NEW
        self._api: TrtllmApi | None = None
        self._llm: Any = None
        self._supports_cache_salt = False
        self._guided_backend = config.guided_decoding_backend  # "none" once start() finds no support
        self._supports_logprobs = True  # until start() finds SamplingParams without `logprobs`
        self._slots: SlotPool | None = None
        self._in_flight: dict[str, Flight] = {}
        self._stats_task: asyncio.Task | None = None
        self._iteration: IterationStats | None = None
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_generation_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_running(self) -> int:
        return self.max_in_flight

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.state is not BackendState.NEW:
            raise EngineError(f"TrtllmBackend.start() called twice (state {self.state.value})")
        self.state = BackendState.STARTING
        try:
            self._api = load_api()
        except ConfigError:
            self.state = BackendState.FAILED
            raise
        kwargs = llm_kwargs(self._api, self._model_dir, self._config, self._max_model_len)
        log.info(
            "trtllm_building",
            version=self._api.version,
            model_dir=str(self._model_dir),
            tensor_parallel_size=self._config.tensor_parallel_size,
            max_batch_size=self._config.max_batch_size,
        )
        try:  # blocks for minutes (weights, CUDA graphs, MPI workers): keep the loop free
            self._llm = await asyncio.to_thread(self._api.LLM, **kwargs)
        except Exception as exc:
            self.state = BackendState.FAILED
            raise EngineError(f"TensorRT-LLM could not load {self._model_dir}: {exc}") from exc
        self._supports_cache_salt = accepts(self._llm.generate_async, "cache_salt")
        if self._api.GuidedDecodingParams is None or not accepts(self._api.SamplingParams, "guided_decoding"):
            self._guided_backend = "none"
        self._supports_logprobs = accepts(self._api.SamplingParams, "logprobs")
        self._slots = SlotPool(self.max_in_flight)
        self.state = BackendState.READY
        log.info("trtllm_ready", max_in_flight=self.max_in_flight, cache_salt=self._supports_cache_salt)

    async def shutdown(self) -> None:
        if self.state in (BackendState.NEW, BackendState.STOPPED):
            self.state = BackendState.STOPPED
            return
        self.state = BackendState.STOPPED
        if self._slots is not None:
            self._slots.turn_away_all()
        for flight in list(self._in_flight.values()):
            flight.request_abort()
            flight.force_finish("shutdown")
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        if self._llm is not None:
            try:  # stops the executor and its MPI workers; blocking
                await asyncio.to_thread(self._llm.shutdown)
            except Exception:
                log.exception("trtllm_shutdown_failed")
        log.info("trtllm_stopped")

    def health(self) -> bool:
        return self.state is BackendState.READY

    # -- admission ------------------------------------------------------------------------
    def check_request(self, request: GenerationRequest) -> None:
        check_fits_context(request, self._max_model_len)
        if request.sampling.prompt_logprobs is not None:
            raise RequestRejected(
                "the prompt's log-probabilities (echo with logprobs) come from the native engine only",
                param="echo",
                code="unsupported_value",
            )
        if request.sampling.logit_bias:
            raise RequestRejected(
                "logit_bias is applied by the native engine only (and relayed to upstream servers)",
                param="logit_bias",
                code="unsupported_value",
            )
        if request.sampling.thinking is not None:
            raise RequestRejected(
                "a thinking budget (thinking_token_budget; the Messages API's thinking.budget_tokens) is applied by "
                "the native engine only",
                param="thinking_token_budget",
                code="unsupported_value",
            )
        num_prompt = len(request.prompt_token_ids)
        if not self._config.enable_chunked_prefill and num_prompt > self._config.max_num_tokens:
            raise RequestRejected(
                f"the prompt has {num_prompt} tokens; without chunked prefill this server takes at most "
                f"{self._config.max_num_tokens} (trtllm.max_num_tokens)",
                param="messages",
                code="context_length_exceeded",
            )
        structured = request.sampling.structured
        reason = unsupported_reason(structured, self._guided_backend) if structured is not None else None
        if (
            structured is not None and reason is not None
        ):  # refuse rather than ignore: an unconstrained answer would not parse
            param = "tool_choice" if structured.kind is StructuredKind.LARK else "response_format"
            raise RequestRejected(reason, param=param, code="unsupported_value")
        if request.sampling.logprobs is not None and not self._supports_logprobs:
            raise RequestRejected(
                f"this TensorRT-LLM version ({self._api.version if self._api else '?'}) returns no logprobs",
                param="logprobs",
                code="unsupported_value",
            )

    def has_room(self) -> bool:
        return self.state is BackendState.READY and self._slots is not None and self._slots.has_free

    # -- generation -----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        self._require_serving()
        assert self._slots is not None
        if not await self._slots.acquire(request.request_id):  # turned away: aborted or shutting down
            yield TokenEvent("", (), len(request.prompt_token_ids), 0, 0, FinishReason.ABORT)
            return
        flight: Flight | None = None
        try:
            self._require_serving()
            flight = self._submit(request)
            while True:
                item = await flight.events.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    self._retire(flight)  # free the slot before the consumer sees the end
                    yield item
                    return
                yield item
        finally:
            if flight is not None:
                self._retire(flight)
            else:
                self._slots.release()

    def abort(self, request_id: str) -> None:
        if self._slots is not None and self._slots.turn_away(request_id):
            return  # it was still waiting for a slot: never submitted
        flight = self._in_flight.get(request_id)
        if flight is None or flight.is_retired:
            return
        flight.request_abort()
        flight.arm_abort_deadline(self.abort_grace_s)

    def _require_serving(self) -> None:
        if self.state is not BackendState.READY or self._slots is None:
            raise EngineError(f"the TensorRT-LLM backend is not serving (state {self.state.value})")

    def _submit(self, request: GenerationRequest) -> Flight:
        if request.request_id in self._in_flight:
            raise EngineError(f"request id {request.request_id!r} is already running")
        assert self._api is not None
        fields = sampling_kwargs(request.sampling, self._tokenizer.eos_token_ids)
        if request.sampling.structured is not None:
            try:  # check_request has refused what the backend cannot take; this is the backstop
                guide = guided_decoding_kwargs(request.sampling.structured, self._guided_backend)
            except ValueError as exc:
                raise RequestRejected(str(exc), param="response_format", code="unsupported_value") from None
            fields["guided_decoding"] = self._api.GuidedDecodingParams(**guide)
        params = self._api.SamplingParams(**supported_kwargs(self._api.SamplingParams, fields))
        kwargs: dict[str, Any] = {"streaming": True}
        if request.cache_salt is not None and self._supports_cache_salt:
            kwargs["cache_salt"] = request.cache_salt
        try:  # must run on the loop thread: the result binds to this loop
            handle = self._llm.generate_async(list(request.prompt_token_ids), params, **kwargs)
        except ValueError as exc:  # e.g. the prompt is longer than TensorRT-LLM accepts
            raise RequestRejected(f"TensorRT-LLM cannot serve this request: {exc}", param="messages") from None
        except RuntimeError as exc:  # "LLM is shutting down", a dead executor
            self._mark_failed(exc)
            raise EngineError(f"TensorRT-LLM is not accepting requests: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"TensorRT-LLM refused the request: {exc}") from exc
        flight = Flight(request, handle, self._api.RequestError, on_progress=self._count, tokenizer=self._tokenizer)
        self._in_flight[request.request_id] = flight
        self._num_prompt_tokens += len(request.prompt_token_ids)
        flight.start()
        self._ensure_stats_task()
        return flight

    def _retire(self, flight: Flight) -> None:
        if flight.is_retired:
            return
        flight.retire()
        self._in_flight.pop(flight.request.request_id, None)
        assert self._slots is not None
        self._slots.release()

    def _count(self, num_new_tokens: int, num_new_cached_tokens: int) -> None:
        self._num_generation_tokens += num_new_tokens
        self._num_cached_tokens += num_new_cached_tokens

    def _mark_failed(self, exc: BaseException) -> None:
        if self.state is BackendState.READY:
            log.error("trtllm_executor_failed", error=str(exc))
            self.state = BackendState.FAILED

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        it = self._iteration
        num_in_flight = len(self._in_flight)
        # Our in-flight count is exact; TensorRT-LLM's queue length is one iteration old.
        num_waiting = min(it.num_queued, num_in_flight) if it else 0
        return EngineStats(
            num_running=num_in_flight - num_waiting,
            num_waiting=num_waiting,
            num_kv_blocks_total=it.num_kv_blocks_total if it else 0,
            num_kv_blocks_free=it.num_kv_blocks_free if it else 0,
            prefix_cache_queries=self._num_prompt_tokens,
            prefix_cache_hits=self._num_cached_tokens,
            num_prompt_tokens_processed=self._num_prompt_tokens - self._num_cached_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )

    def _ensure_stats_task(self) -> None:
        # get_stats_async is bound to the loop of the first generate_async, so start after it.
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._drain_stats(), name="trtllm-stats")

    async def _drain_stats(self) -> None:
        interval_s = max(0.05, self._config.stats_interval_s)
        while self.state is BackendState.READY:
            try:
                # One entry per executor iteration; the iterator ends after `interval_s`
                # without a new one. Keep only the latest, as trtllm-serve does.
                async for raw in self._llm.get_stats_async(interval_s):
                    parsed = parse_iteration_stats(raw)
                    if parsed is not None:
                        self._iteration = parsed
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # stats are best effort; never take serving down
                log.warning("trtllm_stats_failed", error=str(exc))
            await asyncio.sleep(interval_s)
