"""STAND-IN for `tensorrt_llm.LLM` and its RequestOutput (tests only).

Mirrors the documented 1.x behaviour the adapter depends on: unknown constructor keywords
raise ValueError; `generate_async` must run on the event-loop thread, mutates the
SamplingParams it is given, and raises ValueError for prompts it cannot take; the
RequestOutput is updated in place per step (`text_diff`, `token_ids_diff`), a stop word is
cut from `token_ids`/`text` only in the final response, and `abort()` ends it 'cancelled'.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokenizers import Tokenizer

from .errors import RequestError
from .executor import Controls, Executor, Job, Response
from .guided import GuideFactory
from .sampling_params import SamplingParams

_LLM_DEFAULTS: dict[str, Any] = {
    "pipeline_parallel_size": 1,
    "moe_expert_parallel_size": None,
    "enable_attention_dp": False,
    "max_batch_size": 2048,
    "max_num_tokens": 8192,
    "max_seq_len": None,
    "max_beam_width": 1,
    "kv_cache_config": None,
    "scheduler_config": None,
    "enable_chunked_prefill": False,
    "speculative_config": None,
    "cuda_graph_config": None,
    "disable_overlap_scheduler": False,
    "stream_interval": 1,
    "enable_iter_perf_stats": False,
    "enable_iter_req_stats": False,
    "return_perf_metrics": False,
    "num_postprocess_workers": 0,
    "guided_decoding_backend": None,
}
_MAX_STATS_QUEUED = 1000


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)  # one {token_id: Logprob} per token, when asked
    _last_text_len: int = 0
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len :]


class RequestOutput:
    """Async-iterable; each step yields this same object, updated in place."""

    def __init__(
        self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, llm: LLM
    ):
        self.request_id = request_id
        self.prompt = None
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(0)]
        self.cached_tokens = 0
        self._params = params
        self._tokenizer = tokenizer
        self._llm = llm
        self._done = False
        self._aborted = False
        try:  # as the real one: bound to the loop of the thread that submitted it
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._queue: asyncio.Queue | None = asyncio.Queue()
        except RuntimeError:
            self._loop = self._queue = None

    @property
    def finished(self) -> bool:
        return self._done

    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        self._llm._executor.abort_request(self.request_id)
        self._aborted = True

    def _deliver(self, response: Response) -> None:  # called on the executor thread
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, response)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        assert self._queue is not None, "generate_async was not called from an event loop"
        self._handle(await self._queue.get())
        return self

    async def aresult(self) -> RequestOutput:
        while not self._done:
            await self.__anext__()
        return self

    def _handle(self, response: Response) -> None:
        if response.error is not None:
            self._done = True
            raise RequestError(response.error)
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(response.new_token_ids)
        out._last_logprobs_len = len(out.logprobs)
        out.logprobs.extend(response.logprobs)
        self.cached_tokens = response.cached_tokens
        self._done = response.is_final
        if self._done:
            out.finish_reason = response.finish_reason
            if response.stop_word_len and not self._params.include_stop_str_in_output:
                out.token_ids = out.token_ids[: -response.stop_word_len]
        if self._params.detokenize:
            out._last_text_len = len(out.text)
            text = self._tokenizer.decode(out.token_ids, skip_special_tokens=self._params.skip_special_tokens)
            out.text = text if self._done else text.rstrip("\ufffd")  # hold partial UTF-8


@dataclass
class Submission:
    """What the stand-in received (for tests to inspect; not a TensorRT-LLM API)."""

    inputs: Any
    sampling_params: SamplingParams
    streaming: bool
    cache_salt: str | None
    thread_name: str


class LLM:
    def __init__(
        self,
        model: str,
        tokenizer: Any = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ):
        unknown = sorted(set(kwargs) - set(_LLM_DEFAULTS))
        if unknown:
            raise ValueError(f"Unknown LLM arguments: {unknown}")
        model_dir = Path(model)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        args = {**_LLM_DEFAULTS, **kwargs, "model": model, "tensor_parallel_size": tensor_parallel_size}
        args["max_seq_len"] = args["max_seq_len"] or config.get("max_position_embeddings", 2048)
        self.args = SimpleNamespace(**args)
        self.built_on_thread = threading.current_thread().name
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.eos_token_id = self.tokenizer.token_to_id(tok_cfg.get("eos_token") or "")
        self.pad_token_id = self.tokenizer.token_to_id(tok_cfg.get("pad_token") or "")
        special = set(self.tokenizer.get_added_tokens_decoder())
        ordinary = [i for i in range(self.tokenizer.get_vocab_size()) if i not in special]
        self.standin = Controls()
        self.submissions: list[Submission] = []
        self.is_shut_down = False
        self._next_id = 0
        self._stats: IterationResult | None = None
        guides = None
        if self.args.guided_decoding_backend == "llguidance":
            tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
            guides = GuideFactory(tokenizer_json, self.tokenizer.get_vocab_size(), self.eos_token_id)
        self._executor = Executor(self.args, ordinary, self.standin, guides)

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        return self._generate(inputs, sampling_params, streaming, cache_salt)

    def _generate(self, inputs: Any, params: SamplingParams | None, streaming: bool, cache_salt: str | None):
        if self.is_shut_down or self._executor.is_dead:
            raise RuntimeError("LLM is shutting down")
        prompt = self._prompt_ids(inputs)
        params = params if params is not None else SamplingParams()
        self._check_prompt(prompt)
        if params.end_id is None:  # the documented mutation: use a fresh object per request
            params.end_id, params.pad_id = self.eos_token_id, self.pad_token_id
        room = self.args.max_seq_len - len(prompt)
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._bind_stats()
        self._next_id += 1
        output = RequestOutput(self._next_id, prompt, params, self.tokenizer, self)
        stop = [params.stop] if isinstance(params.stop, str) else (params.stop or [])
        stop_words = [self.tokenizer.encode(s, add_special_tokens=False).ids for s in stop]
        self.submissions.append(Submission(inputs, params, streaming, cache_salt, threading.current_thread().name))
        self._executor.submit(Job(self._next_id, prompt, params, output._deliver, streaming, cache_salt, stop_words))
        return output

    def _prompt_ids(self, inputs: Any) -> list[int]:
        if isinstance(inputs, str):
            return self.tokenizer.encode(inputs, add_special_tokens=False).ids
        if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
            return list(inputs["prompt_token_ids"])
        if isinstance(inputs, list) and all(isinstance(i, int) for i in inputs):
            return list(inputs)
        raise TypeError(f"unsupported inputs: {type(inputs).__name__}")

    def _check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) >= self.args.max_seq_len:
            raise ValueError(f"The prompt ({len(prompt)} tokens) is longer than max_seq_len ({self.args.max_seq_len})")
        if not self.args.enable_chunked_prefill and len(prompt) > self.args.max_num_tokens:
            raise ValueError(f"The prompt ({len(prompt)} tokens) exceeds max_num_tokens ({self.args.max_num_tokens})")

    def _bind_stats(self) -> None:
        if self._stats is not None:
            self._stats.mark_undone()  # as the real executor does on each submission
            return
        if not self.args.enable_iter_perf_stats:
            return
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self._stats = IterationResult(queue)

        def push(entry: str) -> None:
            if queue.qsize() >= _MAX_STATS_QUEUED:
                queue.get_nowait()
            queue.put_nowait(entry)

        def on_stats(entry: str) -> None:
            try:
                loop.call_soon_threadsafe(push, entry)
            except RuntimeError:
                pass

        self._executor.on_stats = on_stats

    def get_stats_async(self, timeout: float | None = 2) -> IterationResult:
        """The same iterator every call; it ends after `timeout` idle and stays ended until
        the next generate_async (the real one's `mark_undone`)."""
        if self._stats is None:
            raise RuntimeError("iteration stats need enable_iter_perf_stats and a generate_async call first")
        self._stats.set_timeout(timeout)
        return self._stats

    def shutdown(self) -> None:
        self.is_shut_down = True
        self._executor.stop()


class IterationResult:
    """Async iterator over queued stats entries (JSON strings, parsed); ends after `timeout` idle."""

    def __init__(self, queue: asyncio.Queue):
        self._queue = queue
        self._timeout: float | None = 2
        self._done = False

    def set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def mark_undone(self) -> None:
        self._done = False

    def __aiter__(self) -> IterationResult:
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        try:
            return json.loads(await asyncio.wait_for(self._queue.get(), self._timeout))
        except TimeoutError:
            self._done = True
            raise StopAsyncIteration from None


class LLMWithoutCacheSalt(LLM):
    """The 1.0 signature of generate_async, which has no cache_salt (stand-in variant)."""

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
    ) -> RequestOutput:
        return self._generate(inputs, sampling_params, streaming, None)
