"""STAND-IN executor (tests only): FCFS in-flight batching of a toy model on a worker thread.

Each iteration admits waiting requests up to max_batch_size, emits one token per active
request and hands each response to the request's event loop with call_soon_threadsafe, as
the real proxy thread does. `Controls` are test knobs that TensorRT-LLM does not have.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """As tensorrt_llm.executor.result.Logprob (1.x)."""

    logprob: float
    rank: int | None = None


@dataclass
class Response:
    new_token_ids: list[int]
    is_final: bool = False
    finish_reason: str | None = None  # stop | length | cancelled
    error: str | None = None
    cached_tokens: int = 0
    stop_word_len: int = 0  # tokens of the matched stop word, cut from the output at the end
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # one per new token, when asked


@dataclass
class Controls:
    """Test knobs of the stand-in (not part of TensorRT-LLM's API)."""

    step_s: float = 0.002
    drop_queued_aborts: bool = False  # emulate #9280: aborting a queued request never answers
    fail_next: str | None = None  # the next admitted request fails with this message
    killed: str | None = None  # the executor is dead with this message
    max_batch_size: int | None = None  # override the LLM's, to force queueing

    def fail_next_request(self, message: str = "injected failure") -> None:
        self.fail_next = message

    def kill(self, message: str = "executor died") -> None:
        self.killed = message


@dataclass
class Job:
    id: int
    prompt: list[int]
    params: Any
    deliver: Callable[[Response], None]
    streaming: bool
    cache_salt: str | None
    stop_words: list[list[int]]
    generated: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    guide: Any = None  # a guided.Guide when the request has guided_decoding
    cached_tokens: int = 0
    rng: random.Random | None = None


class Executor:
    def __init__(self, args: Any, ordinary_ids: list[int], controls: Controls, guides: Any = None):
        self.args = args
        self._guides = guides  # a guided.GuideFactory with guided_decoding_backend="llguidance"
        self.controls = controls
        self._ordinary_ids = ordinary_ids
        kv = args.kv_cache_config
        self._tokens_per_block = getattr(kv, "tokens_per_block", 32) if kv is not None else 32
        self._enable_block_reuse = getattr(kv, "enable_block_reuse", True) if kv is not None else True
        self.max_num_blocks = 4096
        self._cached_block_hashes: set[int] = set()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._aborts: set[int] = set()
        self._cond = threading.Condition()
        self._stopped = False
        self._iter = 0
        self._num_completed = 0
        self.on_stats: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._run, name="standin-trtllm-executor", daemon=True)
        self._thread.start()

    # -- called from the event-loop thread --------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()

    def abort_request(self, request_id: int) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    @property
    def is_dead(self) -> bool:
        return self.controls.killed is not None

    # -- the worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not (self._waiting or self._active or self._aborts):
                    self._cond.wait(timeout=0.05)
                if self._stopped:
                    return
                started = time.perf_counter()
                self._iteration()
                stats = self._stats_json((time.perf_counter() - started) * 1000)
            if self.on_stats is not None:
                self.on_stats(stats)
            time.sleep(self.controls.step_s)

    def _iteration(self) -> None:
        self._iter += 1
        if self.controls.killed is not None:
            for job in [*self._waiting, *self._active]:
                job.deliver(Response([], is_final=True, error=self.controls.killed))
            self._waiting.clear()
            self._active.clear()
            return
        self._apply_aborts()
        limit = self.controls.max_batch_size or self.args.max_batch_size
        while self._waiting and len(self._active) < limit:
            self._admit(self._waiting.popleft())
        for job in list(self._active):
            self._decode(job)

    def _apply_aborts(self) -> None:
        for job in list(self._waiting):
            if job.id in self._aborts:
                self._waiting.remove(job)
                if not self.controls.drop_queued_aborts:
                    job.deliver(Response(job.pending, is_final=True, finish_reason="cancelled"))
        for job in list(self._active):
            if job.id in self._aborts:
                self._finish(job, Response(job.pending, is_final=True, finish_reason="cancelled"))
        self._aborts.clear()

    def _admit(self, job: Job) -> None:
        if self.controls.fail_next is not None:
            message, self.controls.fail_next = self.controls.fail_next, None
            job.deliver(Response([], is_final=True, error=message))
            return
        if job.params.guided_decoding is not None:
            try:  # as TensorRT-LLM: a guide that does not compile fails the request
                if self._guides is None:
                    raise ValueError("guided decoding needs LLM(guided_decoding_backend=...)")
                job.guide = self._guides.create(job.params.guided_decoding)
            except ValueError as exc:
                job.deliver(Response([], is_final=True, error=str(exc)))
                return
        hashes = self._block_hashes(job)
        if self._enable_block_reuse:
            num_hit = next((i for i, h in enumerate(hashes) if h not in self._cached_block_hashes), len(hashes))
            job.cached_tokens = min(num_hit * self._tokens_per_block, len(job.prompt) - 1)
            self._cached_block_hashes.update(hashes)
        self._active.append(job)

    def _block_hashes(self, job: Job) -> list[int]:
        size = self._tokens_per_block
        hashes, prev = [], hash(job.cache_salt)
        for start in range(0, len(job.prompt) - size + 1, size):
            prev = hash((prev, tuple(job.prompt[start : start + size])))
            hashes.append(prev)
        return hashes

    def _decode(self, job: Job) -> None:
        token = self._next_token(job)
        job.generated.append(token)
        job.pending.append(token)
        if job.params.logprobs:
            job.pending_logprobs.append(self._toy_logprobs(token, job.params.logprobs))
        reason, stop_len = self._finish_reason(job, token)
        if reason is None:
            if job.streaming:
                job.deliver(Response(job.pending, cached_tokens=job.cached_tokens, logprobs=job.pending_logprobs))
                job.pending, job.pending_logprobs = [], []
            return
        if reason == "stop" and stop_len == 0:  # the end token itself is not output
            job.pending.pop()
            job.pending_logprobs = job.pending_logprobs[: len(job.pending)]
        self._finish(
            job,
            Response(
                job.pending,
                True,
                reason,
                cached_tokens=job.cached_tokens,
                stop_word_len=stop_len,
                logprobs=job.pending_logprobs,
            ),
        )

    def _toy_logprobs(self, token: int, k: int) -> dict[int, Logprob]:
        """The PyTorch backend's shape: {token_id: Logprob} of the top k, the chosen one first."""
        others = [i for i in self._ordinary_ids if i != token][: k - 1]
        entry = {token: Logprob(-0.25, 1)}
        entry.update({t: Logprob(-1.0 - r, r + 2) for r, t in enumerate(others)})
        return entry

    def _finish_reason(self, job: Job, token: int) -> tuple[str | None, int]:
        params = job.params
        may_stop = len(job.generated) >= (params.min_tokens or 0)
        if may_stop and not params.ignore_eos and token == params.end_id:
            return "stop", 0
        if may_stop and token in (params.stop_token_ids or ()):
            return "stop", 1
        for words in job.stop_words:
            if words and job.generated[-len(words) :] == words:
                return "stop", len(words)
        if len(job.generated) >= params.max_tokens:
            return "length", 0
        if len(job.prompt) + len(job.generated) >= self.args.max_seq_len:
            return "length", 0
        return None, 0

    def _finish(self, job: Job, response: Response) -> None:
        self._active.remove(job)
        self._num_completed += 1
        job.deliver(response)

    def _next_token(self, job: Job) -> int:
        ids = job.prompt + job.generated
        if job.params.greedy:
            h = sum(ids[-3:]) * 31 + len(ids) * 7
        else:
            if job.rng is None:
                job.rng = random.Random(job.params.seed)
            h = job.rng.randrange(1 << 30)
        if job.guide is None:
            return self._ordinary_ids[h % len(self._ordinary_ids)]
        if job.guide.is_stopped:  # the grammar is complete: only the end token is left
            return job.params.end_id
        allowed = job.guide.allowed()
        token = allowed[h % len(allowed)]
        job.guide.accept(token)
        return token

    def _stats_json(self, latency_ms: float) -> str:
        size = self._tokens_per_block
        used = sum(-(-(len(j.prompt) + len(j.generated)) // size) for j in self._active)
        return json.dumps(
            {
                "iter": self._iter,
                "iterLatencyMS": latency_ms,
                "numActiveRequests": len(self._active),
                "numQueuedRequests": len(self._waiting),
                "numCompletedRequests": self._num_completed,
                "gpuMemUsage": 0,
                "inflightBatchingStats": {"numScheduledRequests": len(self._active), "numPausedRequests": 0},
                "kvCacheStats": {
                    "maxNumBlocks": self.max_num_blocks,
                    "freeNumBlocks": self.max_num_blocks - used,
                    "usedNumBlocks": used,
                    "tokensPerBlock": size,
                },
            }
        )
