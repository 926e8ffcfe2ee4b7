"""Pure translations between our seam types and TensorRT-LLM's LLM API objects.

Owns the LLM constructor arguments built from `TrtllmConfig`, one fresh TensorRT-LLM
`SamplingParams` per request, the finish-reason table and iteration-stats parsing (stop strings
go through the native backend's `StopStringFilter`, engine/detokenizer.py). It never imports
`tensorrt_llm`: callers pass the classes in (see `TrtllmApi`), so everything here runs without it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine.types import FinishReason, SamplingParams
from settings import TrtllmConfig

log = structlog.get_logger(__name__)

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")

# TensorRT-LLM's CompletionOutput.finish_reason -> ours. "timeout" only happens when a request
# carries an allotted time (we never set one); it is a server-side limit that cut the answer
# short, which OpenAI clients read as "length" (truncated), not as the caller's abort.
_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.ABORT,
    "timeout": FinishReason.LENGTH,
}


@dataclass(frozen=True, slots=True)
class TrtllmApi:
    """The few names the adapter uses from `tensorrt_llm`, resolved once in start()."""

    LLM: Any
    SamplingParams: Any
    KvCacheConfig: Any
    SchedulerConfig: Any
    CapacitySchedulerPolicy: Any
    RequestError: type[BaseException]
    version: str


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes a keyword `name`; unknowable (`**kwargs`, C code) counts as yes."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if name in params:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def supported_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop (and log) keywords the installed TensorRT-LLM version does not take."""
    dropped = [k for k in kwargs if not accepts(fn, k)]
    if dropped:
        log.warning("trtllm_kwargs_unsupported", target=getattr(fn, "__qualname__", str(fn)), dropped=dropped)
    return {k: v for k, v in kwargs.items() if k not in dropped}


def llm_kwargs(api: TrtllmApi, model_dir: Path, config: TrtllmConfig, max_seq_len: int) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.LLM(...)`; `max_seq_len` is our max_model_len."""
    kv_cache = {
        "free_gpu_memory_fraction": config.kv_cache_free_gpu_memory_fraction,
        "enable_block_reuse": config.enable_block_reuse,
    }
    if config.kv_cache_host_bytes > 0:
        kv_cache["host_cache_size"] = config.kv_cache_host_bytes
    policy = getattr(api.CapacitySchedulerPolicy, config.scheduler_policy.upper())
    return {
        "model": str(model_dir),
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "max_seq_len": max_seq_len,
        "kv_cache_config": api.KvCacheConfig(**supported_kwargs(api.KvCacheConfig, kv_cache)),
        "scheduler_config": api.SchedulerConfig(capacity_scheduler_policy=policy),
        "enable_chunked_prefill": config.enable_chunked_prefill,
        # The PyTorch backend only reports iteration stats (KV usage, queue) when asked.
        "enable_iter_perf_stats": True,
    }


def sampling_kwargs(sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """TensorRT-LLM SamplingParams fields for one request; None-valued fields are left out."""
    kwargs: dict[str, Any] = {
        # Always explicit: an omitted max_tokens is deduced as the whole context, and with
        # GUARANTEED_NO_EVICT that reserves a full KV allocation per request (issue #9412).
        "max_tokens": sampling.max_tokens,
        "n": 1,
        "ignore_eos": sampling.ignore_eos,
        "include_stop_str_in_output": False,
        "detokenize": True,
        "skip_special_tokens": True,
    }
    if sampling.is_greedy:
        # 1.0 decides "greedy" from top_k/top_p alone (temperature 0 is not read as greedy).
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        kwargs["top_p"] = sampling.top_p  # explicit: top_k and top_p both None means greedy there
        if sampling.top_k is not None:
            kwargs["top_k"] = sampling.top_k
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    if sampling.stop:
        kwargs["stop"] = list(sampling.stop)
    stop_ids = list(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        # TensorRT-LLM stops on the HF tokenizer's eos_token_id only; the other EOS ids from
        # generation_config.json must be passed as stop tokens.
        stop_ids += [i for i in eos_token_ids if i not in stop_ids]
    if stop_ids:
        kwargs["stop_token_ids"] = stop_ids
    if sampling.presence_penalty:
        kwargs["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        kwargs["frequency_penalty"] = sampling.frequency_penalty
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_tokens:
        kwargs["min_tokens"] = sampling.min_tokens
    return kwargs


def map_finish_reason(reason: str | None) -> FinishReason | None:
    """Ours for a TensorRT-LLM finish reason; None for unknown ones (e.g. 'not_finished')."""
    return _FINISH_REASONS.get(reason) if reason is not None else None


@dataclass(frozen=True, slots=True)
class IterationStats:
    """The parts of one `get_stats_async` entry the server reports."""

    num_queued: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int


def parse_iteration_stats(raw: Any) -> IterationStats | None:
    """One stats entry (a dict, or the JSON string some versions yield); None if unusable."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if not isinstance(raw, dict):
        return None
    kv = raw.get("kvCacheStats") or {}
    total = _int(kv.get("maxNumBlocks"))
    if "freeNumBlocks" in kv:
        free = _int(kv.get("freeNumBlocks"))
    else:  # newer versions name the used count allocTotalBlocks
        free = total - _int(kv.get("usedNumBlocks", kv.get("allocTotalBlocks")))
    return IterationStats(
        num_queued=_int(raw.get("numQueuedRequests")),
        num_kv_blocks_total=total,
        num_kv_blocks_free=max(0, min(free, total)),
    )


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
