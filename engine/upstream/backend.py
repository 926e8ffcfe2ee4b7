"""The `Backend` protocol over one or more OpenAI-compatible upstream servers.

Owns the HTTP client session, the replica pool (breakers, least-outstanding picking,
conversation affinity), the probe task that lets a failed replica back in, and the relay of
each upstream stream into TokenEvents. Admission order stays with our priority queue:
`has_room()` is true only while a replica has fewer than `max_in_flight` requests. A
request is retried on another replica only before its first token; the API key is read
from the environment, never logged, and taken out of the upstream's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import aiohttp
import orjson
import structlog

from engine.types import (
    EngineError,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    TokenEvent,
    UsageSource,
    check_fits_context,
)
from engine.upstream.breaker import BreakerState, CircuitBreaker, FailureKind
from engine.upstream.counting import Counter
from engine.upstream.discovery import discover_max_model_len
from engine.upstream.progress import Progress
from engine.upstream.replicas import Replica, ReplicaPool, affinity_key
from engine.upstream.stream import DONE, MalformedStream, sse_payloads
from engine.upstream.usage import usage_problem
from engine.upstream.wire import (
    ErrorKind,
    UpstreamError,
    classify_http_error,
    parse_chunk,
    redact,
    redacted,
    request_body,
    request_path,
    unsupported_reason,
)
from settings import ConfigError, ModelConfig, UpstreamConfig

log = structlog.get_logger(__name__)

UNKNOWN_MAX_MODEL_LEN = 1 << 30  # the upstream decides; the tier's max_context_tokens still applies
_READ_BUFSIZE = 1 << 20  # one SSE line may be long (logprobs, tool arguments); 2 MiB at most
_MAX_ERROR_BYTES = 1 << 16  # of an upstream's error body: its message is what we keep
_DONE_GRACE_S = 1.0  # after the finish chunk and usage, [DONE] is waited for this long at most


class _AttemptFailed(Exception):
    """One replica failed this request; `kind` None: the failure is not the replica's."""

    def __init__(self, message: str, kind: FailureKind | None, error: UpstreamError | None = None):
        super().__init__(message)
        self.kind = kind
        self.error = error


@dataclass(slots=True)
class _Attempt:
    """One try of a request on one replica: its response once it arrives, and whether it was aborted."""

    replica: Replica
    response: aiohttp.ClientResponse | None = None
    is_aborted: bool = False


class UpstreamBackend:
    """A model whose requests go to other servers' `/chat/completions`."""

    def __init__(
        self, name: str, model: ModelConfig, config: UpstreamConfig, counter: Counter, *, max_model_len: int | None
    ):
        if not model.urls:
            raise ConfigError(f"models.{name}.urls: backend 'openai' needs at least one upstream URL")
        for url in model.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"models.{name}.urls: expected http:// or https:// URLs, got {url!r}")
        self.name = name
        self.upstream_model = model.upstream_model or name
        self._api_key_env = model.api_key_env
        self._api_key: str | None = None
        self._config = config
        self._counter = counter
        replicas = [
            Replica(i, url, CircuitBreaker(config.breaker_failures, config.breaker_open_s))
            for i, url in enumerate(model.urls)
        ]
        self.pool = ReplicaPool(replicas, model.max_in_flight, config.affinity_entries)
        self._max_model_len = max_model_len or 0
        self._session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._running: dict[str, _Attempt] = {}
        self._is_stopped = False
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_generation_tokens = 0
        self._warned: set[tuple[str, int]] = set()  # (event, replica index) already logged

    @property
    def max_model_len(self) -> int:
        return self._max_model_len or UNKNOWN_MAX_MODEL_LEN

    @property
    def max_num_running(self) -> int:
        """The gateway's reservations: max_in_flight per replica (has_room() says which are up)."""
        return self.pool.max_in_flight * len(self.pool.replicas)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._api_key_env:
            self._api_key = os.environ.get(self._api_key_env) or None
            if self._api_key is None:
                raise ConfigError(
                    f"models.{self.name}.api_key_env: the environment variable {self._api_key_env} is not set"
                )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # the pool bounds requests per replica
            timeout=aiohttp.ClientTimeout(total=None, connect=self._config.connect_timeout_s),
            read_bufsize=_READ_BUFSIZE,
            json_serialize=lambda obj: orjson.dumps(obj).decode(),
        )
        found = await discover_max_model_len(
            self._session, self.pool.replicas, self.upstream_model, self._headers(), self._config.connect_timeout_s
        )
        for replica, reachable in found.reachable.items():
            if not reachable:
                self._record_failure(replica, FailureKind.CONNECTION, "not reachable at startup")
        if not self._max_model_len and found.max_model_len:
            self._max_model_len = found.max_model_len
        self._probe_task = asyncio.get_running_loop().create_task(
            self._probe_loop(), name=f"upstream-probe-{self.name}"
        )
        log.info(
            "upstream_ready",
            model=self.name,
            upstream_model=self.upstream_model,
            replicas=[r.label for r in self.pool.replicas],
            max_in_flight=self.pool.max_in_flight,
            max_model_len=self._max_model_len or None,
            api_key=self._api_key is not None,
        )

    async def shutdown(self) -> None:
        self._is_stopped = True
        for request_id in list(self._running):
            self.abort(request_id)
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def health(self) -> bool:
        # A replica that is down is recoverable: availability is `is_available()`.
        return self._session is not None and not self._is_stopped

    def is_available(self) -> bool:
        """False while every replica is out: the router sends the tier to its fallback model."""
        return self.pool.is_available

    # -- admission ------------------------------------------------------------------------
    def check_request(self, request: GenerationRequest) -> None:
        if request.chat is None:
            raise EngineError("the openai backend needs the request's chat messages")
        unsupported = unsupported_reason(request)
        if unsupported is not None:
            raise RequestRejected(unsupported[0], param=unsupported[1], code="unsupported_value")
        if self._max_model_len:
            check_fits_context(request, self._max_model_len)

    def has_room(self) -> bool:
        return self.pool.has_room()

    def abort(self, request_id: str) -> None:
        attempt = self._running.get(request_id)
        if attempt is not None and not attempt.is_aborted:
            attempt.is_aborted = True
            if attempt.response is not None:
                attempt.response.close()  # the upstream sees the connection close and frees its KV

    # -- generation -----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if self._session is None or self._is_stopped:
            raise EngineError(f"the upstream backend of {self.name} is not serving")
        self.check_request(request)
        body = request_body(request, self.upstream_model)
        key = affinity_key(request)
        tried: frozenset[int] = frozenset()
        failure: _AttemptFailed | None = None
        for _ in range(max(1, self._config.max_attempts)):
            replica = self.pool.pick(key, tried)  # no await before this: has_room() counts it at once
            if replica is None:
                break
            tried |= {replica.index}
            progress = Progress(request, self._counter)  # retried only if nothing was sent
            try:
                async with contextlib.aclosing(self._attempt(replica, request, body, progress)) as events:
                    async for event in events:
                        yield event
                self.pool.remember(key, replica)
                return
            except _AttemptFailed as exc:
                failure = exc
                self._raise_if_final(exc, progress)
        raise self._unavailable(failure)

    def _raise_if_final(self, exc: _AttemptFailed, progress: Progress) -> None:
        """Any error after the first token (whatever the upstream said: the client has part of an
        answer), and errors that another replica would not fix."""
        if progress.num_yielded > 0:
            raise EngineUnavailable(
                f"the upstream failed while answering: {exc}", retry_after_s=self._config.breaker_open_s
            ) from None
        error = exc.error
        if error is not None and error.kind is ErrorKind.CLIENT:
            raise error.rejected() from None
        if error is not None and error.kind is ErrorKind.CONFIG:
            raise EngineUnavailable(
                f"the upstream refused the request ({error.status}): check models.{self.name} "
                "(upstream_model, api_key_env)",
                retry_after_s=self._config.breaker_open_s,
            ) from None

    def _unavailable(self, failure: _AttemptFailed | None) -> EngineUnavailable:
        now = time.monotonic()
        retry_s = min((r.breaker.seconds_until_probe(now) for r in self.pool.replicas), default=1.0)
        if failure is not None and failure.error is not None and failure.error.retry_after_s is not None:
            retry_s = failure.error.retry_after_s
        reason = f": {failure}" if failure is not None else ""
        return EngineUnavailable(
            f"no upstream replica of {self.name} could take the request{reason}", retry_after_s=max(1.0, retry_s)
        )

    async def _attempt(
        self, replica: Replica, request: GenerationRequest, body: dict, progress: Progress
    ) -> AsyncGenerator[TokenEvent, None]:
        """One try on one replica; raises _AttemptFailed, yields events as chunks arrive."""
        assert self._session is not None  # generate() refuses before start and after shutdown
        replica.num_in_flight += 1
        replica.num_requests += 1
        attempt = _Attempt(replica)
        self._running[request.request_id] = attempt
        started_s = time.monotonic()
        try:
            # The response headers count against the first token's deadline; the stream's own follow.
            async with asyncio.timeout(self._config.first_token_timeout_s):
                attempt.response = await self._session.post(
                    replica.base_url + request_path(request),
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=None, connect=self._config.connect_timeout_s),
                    headers=self._headers(request.request_id),
                )
            async with attempt.response as response:
                if response.status != 200:
                    raise await self._http_failure(replica, response)
                async for event in self._relay(response, attempt, progress, started_s):
                    yield event
        except _AttemptFailed:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, MalformedStream) as exc:
            if attempt.is_aborted:
                yield await self._final(progress, FinishReason.ABORT, replica)
                return
            if progress.finish is None:
                raise self._transport_failure(replica, exc) from None
            # The finish chunk came, then the upstream stalled or dropped before its usage or [DONE]: complete.
            self._record_success(replica)
            progress.num_yielded += 1
            yield await self._final(progress, progress.finish, replica)
        finally:
            replica.num_in_flight -= 1
            if self._running.get(request.request_id) is attempt:
                del self._running[request.request_id]
            if attempt.response is not None and not attempt.response.closed:
                attempt.response.close()  # left early (client gone): close now, never drain

    async def _relay(
        self, response: aiohttp.ClientResponse, attempt: _Attempt, progress: Progress, started_s: float
    ) -> AsyncGenerator[TokenEvent, None]:
        cfg, replica = self._config, attempt.replica
        deadline_s = started_s + cfg.first_token_timeout_s

        def timeout_s() -> float:
            if progress.finish is not None and progress.usage is not None:  # complete: [DONE] is a formality
                return min(cfg.idle_timeout_s, _DONE_GRACE_S)
            return cfg.idle_timeout_s if progress.has_output else max(0.0, deadline_s - time.monotonic())

        async for payload in sse_payloads(response, timeout_s):
            if attempt.is_aborted:  # aborted before the response arrived: it was not closed then
                yield await self._final(progress, FinishReason.ABORT, replica)
                return
            if payload is DONE or not isinstance(payload, dict):
                break
            chunk = parse_chunk(payload)
            if isinstance(chunk, UpstreamError):
                raise self._error_event(replica, chunk)
            had_output = progress.has_output
            event = await progress.feed(chunk)
            if progress.has_output and not had_output:  # the first text, reasoning or tool-call piece
                replica.observe_ttft(time.monotonic() - started_s)
            if progress.is_cut:
                self._warn_once("upstream_ignored_max_tokens", replica, max_tokens=progress.output.max_tokens)
                response.close()  # the upstream sees the connection close and stops generating
            if event is not None:
                progress.num_yielded += 1
                yield event
            if progress.is_cut:
                break
        if progress.finish is None:
            self._record_failure(replica, FailureKind.CONNECTION, "stream ended before finishing")
            raise _AttemptFailed(f"{replica.label}: the stream ended before finishing", FailureKind.CONNECTION)
        self._record_success(replica)
        progress.num_yielded += 1
        yield await self._final(progress, progress.finish, replica)

    async def _final(self, progress: Progress, finish: FinishReason, replica: Replica) -> TokenEvent:
        """The last event, with the upstream's usage when it is plausible, else our own count (and
        which it is); the output is counted only then."""
        prompt, cached, completion = progress.num_prompt_tokens, 0, None
        source = self._counter.usage_source
        usage = progress.usage
        if usage is not None and (usage.prompt_tokens or usage.completion_tokens or usage.problem):
            problem = usage_problem(usage, progress.usage_bounds(self._max_model_len))
            if problem is None:
                prompt, cached, completion = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
                source = UsageSource.UPSTREAM
            else:
                self._warn_once("upstream_usage_implausible", replica, problem=problem, counted_by=source.value)
        if completion is None:
            completion = await progress.output.count()
        self._num_prompt_tokens += prompt
        self._num_cached_tokens += cached
        self._num_generation_tokens += completion
        return TokenEvent("", (), prompt, cached, completion, finish, source, stop_str=progress.stop_str)

    # -- failures and health --------------------------------------------------------------
    async def _http_failure(self, replica: Replica, response: aiohttp.ClientResponse) -> _AttemptFailed:
        async with asyncio.timeout(self._config.idle_timeout_s):
            body = b""
            while len(body) < _MAX_ERROR_BYTES and (piece := await response.content.read(_MAX_ERROR_BYTES - len(body))):
                body += piece
        status = response.status
        error = redacted(classify_http_error(status, body, response.headers.get("Retry-After")), self._secrets())
        kind = FailureKind.SERVER_ERROR if error.kind is ErrorKind.SERVER else None
        if kind is not None:
            self._record_failure(replica, kind, f"HTTP {status}")
        elif error.kind is ErrorKind.CONFIG:
            log.error("upstream_refused", model=self.name, replica=replica.label, status=status, message=error.message)
        return _AttemptFailed(f"{replica.label}: HTTP {status}: {error.message}", kind, error)

    def _error_event(self, replica: Replica, error: UpstreamError) -> _AttemptFailed:
        """An error event in the stream: a server error counts against the replica's breaker."""
        error = redacted(error, self._secrets())
        kind = FailureKind.SERVER_ERROR if error.kind is ErrorKind.SERVER else None
        if kind is not None:
            self._record_failure(replica, kind, error.message)
        return _AttemptFailed(f"{replica.label}: error event ({error.status}): {error.message}", kind, error)

    def _transport_failure(self, replica: Replica, exc: BaseException) -> _AttemptFailed:
        if isinstance(exc, aiohttp.ConnectionTimeoutError) or not isinstance(exc, TimeoutError):
            kind = FailureKind.SERVER_ERROR if isinstance(exc, MalformedStream) else FailureKind.CONNECTION
        else:
            kind = FailureKind.TIMEOUT
        self._record_failure(replica, kind, redact(f"{type(exc).__name__}: {exc}", self._secrets()))
        return _AttemptFailed(f"{replica.label}: {kind.value} ({type(exc).__name__})", kind)

    def _record_failure(self, replica: Replica, kind: FailureKind, detail: str) -> None:
        replica.num_errors[kind] += 1
        was_open = replica.breaker.state is BreakerState.OPEN
        replica.breaker.record_failure(kind, time.monotonic())
        if not was_open and replica.breaker.state is BreakerState.OPEN:
            log.warning("upstream_replica_out", model=self.name, replica=replica.label, kind=kind.value, detail=detail)

    def _warn_once(self, event: str, replica: Replica, **details: object) -> None:
        """A replica's misbehaviour, logged the first time it is seen (then every request would repeat it)."""
        if (event, replica.index) not in self._warned:
            self._warned.add((event, replica.index))
            log.warning(event, model=self.name, replica=replica.label, **details)

    def _record_success(self, replica: Replica) -> None:
        if replica.breaker.state is not BreakerState.CLOSED:
            log.info("upstream_replica_back", model=self.name, replica=replica.label)
        replica.breaker.record_success()

    async def _probe_loop(self) -> None:
        interval_s = max(0.05, min(1.0, self._config.breaker_open_s / 4))
        while not self._is_stopped:
            await asyncio.sleep(interval_s)
            for replica in self.pool.replicas:
                if replica.breaker.probe_due(time.monotonic()):
                    await self._probe(replica)

    async def _probe(self, replica: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                replica.base_url + "/models",
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=self._config.connect_timeout_s),
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            ok = False
        if ok:
            replica.breaker.probe_succeeded()
            log.info("upstream_replica_probe_ok", model=self.name, replica=replica.label)
        else:
            replica.breaker.probe_failed(time.monotonic())

    def _secrets(self) -> tuple[str, ...]:
        return (self._api_key,) if self._api_key else ()

    def _headers(self, request_id: str | None = None) -> dict[str, str]:
        headers = {}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        if request_id is not None:
            headers["X-Request-Id"] = request_id  # vLLM and SGLang log and reuse it: one id end to end
        return headers

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        replicas = self.pool.replicas
        return EngineStats(
            num_running=sum(r.num_in_flight for r in replicas),
            prefix_cache_queries=self._num_prompt_tokens,
            prefix_cache_hits=self._num_cached_tokens,
            num_prompt_tokens_processed=self._num_prompt_tokens - self._num_cached_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )
