"""Pure translations between our seam types and TensorRT-LLM's LLM API objects.

Owns the LLM constructor arguments built from `TrtllmConfig`, one fresh TensorRT-LLM
`SamplingParams` per request (its `GuidedDecodingParams` and `logprobs` included), the reading of
the per-token logprobs TensorRT-LLM returns, the finish-reason table and iteration-stats parsing
(stop strings go through the native backend's `StopStringFilter`, engine/detokenizer.py). It never
imports `tensorrt_llm`: callers pass the classes in (see `TrtllmApi`), so everything here runs
without it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine.types import (
    FinishReason,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
    TokenLogprob,
)
from settings import TrtllmConfig

log = structlog.get_logger(__name__)

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
# `LLM(guided_decoding_backend=...)`: TensorRT-LLM's own grammar libraries (llm_args.py, 1.x:
# Literal["xgrammar", "llguidance"]); "none" leaves guided decoding off (structured requests: 400).
GUIDED_DECODING_BACKENDS = ("llguidance", "xgrammar", "none")
# What a token's logprob reads when TensorRT-LLM left it out of the top-k it returned (only
# possible while sampling): OpenAI's own floor for "less likely than every alternative shown".
UNKNOWN_LOGPROB = -9999.0
# Compact JSON (as engine/grammar.py): a model under a grammar that allows free whitespace can pad
# forever. llguidance reads this key from the schema itself; xgrammar is not given it.
_COMPACT_JSON = {"whitespace_flexible": False}

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
    GuidedDecodingParams: Any = None  # tensorrt_llm.llmapi.GuidedDecodingParams; None: not in this version


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
    kwargs: dict[str, Any] = {
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
    if config.guided_decoding_backend != "none":
        kwargs["guided_decoding_backend"] = config.guided_decoding_backend
    return kwargs


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
    if sampling.logprobs is not None:
        # An int: TensorRT-LLM's top-k per token. 0 is read as "off" by 1.0-1.2 (`logprobs and
        # int(logprobs)`), so the chosen token's logprob alone is asked for as 1.
        kwargs["logprobs"] = max(1, sampling.logprobs)
    return kwargs


def guided_decoding_kwargs(structured: StructuredOutput, backend: str) -> dict[str, Any]:
    """Fields of TensorRT-LLM's `GuidedDecodingParams` for one grammar, under `backend`.

    TensorRT-LLM (grammar_matcher.py, 1.x) maps `json_object` to the schema {"type": "object"},
    `json` to a JSON schema and `grammar` to llguidance's Lark dialect under llguidance (to EBNF
    under xgrammar). Raises ValueError for what `backend` cannot take (see `unsupported_reason`).
    """
    reason = unsupported_reason(structured, backend)
    if reason is not None:
        raise ValueError(reason)
    if structured.kind is StructuredKind.LARK:
        return {"grammar": structured.spec}
    if backend == "xgrammar":
        if structured.kind is StructuredKind.JSON_OBJECT:
            return {"json_object": True}
        return {"json": structured.spec}
    schema = {"type": "object"} if structured.kind is StructuredKind.JSON_OBJECT else json.loads(structured.spec)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _COMPACT_JSON}
    return {"json": json.dumps(schema, separators=(",", ":"))}


def unsupported_reason(structured: StructuredOutput, backend: str) -> str | None:
    """Why `backend` cannot decode under this grammar (a 400's message), or None if it can."""
    if backend == "none":
        return (
            "structured outputs and forced tool calls are off on this TensorRT-LLM model "
            '(trtllm.guided_decoding_backend = "none")'
        )
    if structured.kind is StructuredKind.LARK and backend != "llguidance":
        # Forced tool calls are Lark grammars with an embedded JSON schema (api/tools.py), which
        # only llguidance reads; xgrammar's EBNF has no such construct.
        return (
            f"forced tool calls (tool_choice 'required' or a named function) need "
            f'trtllm.guided_decoding_backend = "llguidance" on this model; it is {backend!r}'
        )
    return None


def token_logprobs(token_ids: tuple[int, ...], entries: list[Any], num_top: int) -> tuple[TokenLogprob, ...]:
    """Our logprobs for `token_ids` from TensorRT-LLM's, one entry per token, in order.

    An entry is a float (the chosen token's logprob: 1.0's TensorRT engines) or a dict
    {token_id: Logprob(logprob, rank)} of the top-k (PyTorch backend; from 1.2 it may also hold the
    chosen token beyond the top-k). The alternatives are the `num_top` most likely of the dict.
    """
    out = []
    for token_id, entry in zip(token_ids, entries, strict=False):  # a short list from TensorRT-LLM never fails a stream
        if not isinstance(entry, dict):
            out.append(TokenLogprob(token_id, _logprob(entry)))
            continue
        ranked = sorted(((int(t), _logprob(v)) for t, v in entry.items()), key=lambda tv: -tv[1])
        chosen = _logprob(entry[token_id]) if token_id in entry else UNKNOWN_LOGPROB
        out.append(TokenLogprob(token_id, chosen, tuple(ranked[:num_top])))
    return tuple(out)


def _logprob(value: Any) -> float:
    """A Logprob(logprob, rank) or a bare float, as a float."""
    return float(getattr(value, "logprob", value))


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
