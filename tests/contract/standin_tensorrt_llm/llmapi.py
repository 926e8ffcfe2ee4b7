"""STAND-IN for `tensorrt_llm.llmapi` (tests only): the config classes and RequestError."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import RequestError
from .llm import LLM, RequestOutput
from .sampling_params import GuidedDecodingParams, SamplingParams


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    max_gpu_total_bytes: int | None = None
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    tokens_per_block: int = 32
    dtype: str = "auto"
    event_buffer_max_size: int = 0


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: Any = None
    dynamic_batch_config: Any = field(default=None)


__all__ = [
    "LLM",
    "CapacitySchedulerPolicy",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
