"""STAND-IN for the `tensorrt_llm` package, for tests only. It is not NVIDIA's code.

It implements only the documented surface the adapter uses (TensorRT-LLM 1.0-1.2 LLM API):
`LLM(...)`, `generate_async(inputs, sampling_params, streaming=True, cache_salt=...)`
returning an async-iterable RequestOutput updated in place, `abort()`, `get_stats_async`,
`shutdown()`, `SamplingParams` and, in `llmapi`, `KvCacheConfig`, `SchedulerConfig`,
`CapacitySchedulerPolicy`, `RequestError`. A toy deterministic "model" produces tokens on an
executor thread, delivered to the event loop thread-safely as the real proxy does.
"""

from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams

__version__ = "1.1.0+standin"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
