"""One request inside TensorRT-LLM: its RequestOutput, the task that reads it, its abort path.

The reader task turns each in-place update of the RequestOutput (read `*_diff` before the next
step) into one TokenEvent on a queue, so an abort that TensorRT-LLM never confirms can still
end the stream. Stop strings are cut from TensorRT-LLM's cumulative text and each token's logprob
goes out with its text, as in the native backend (engine/detokenizer.py). It does not own
admission or the in-flight cap; the backend does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from engine.detokenizer import IncrementalDetokenizer, LogprobGate, StopStringFilter
from engine.tokenizer import Tokenizer
from engine.trtllm.mapping import map_finish_reason, token_logprobs
from engine.types import (
    EngineError,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
)

log = structlog.get_logger(__name__)

# (new completion tokens, new cached prompt tokens) -> None; feeds the backend's counters.
ProgressCallback = Callable[[int, int], None]


class Flight:
    """A submitted request; `events` yields TokenEvents, the last with a finish reason."""

    def __init__(
        self,
        request: GenerationRequest,
        handle: Any,
        request_error: type[BaseException],
        *,
        on_progress: ProgressCallback,
        tokenizer: Tokenizer,
    ):
        self.request = request
        self.handle = handle  # tensorrt_llm RequestOutput, updated in place by each step
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.is_retired = False
        self._request_error = request_error
        self._on_progress = on_progress
        self._stop = StopStringFilter(request.sampling.stop)
        # Where each token's text starts (decoded here too, only when logprobs are asked), so that
        # a token's logprob goes out with its text and none past a stop string's start.
        self._token_starts = (
            None
            if request.sampling.logprobs is None
            else IncrementalDetokenizer(tokenizer, prompt_token_ids=request.prompt_token_ids)
        )
        self._logprob_gate = LogprobGate()
        self._is_final_queued = False
        self._is_abort_requested = False
        self._reader: asyncio.Task | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._run(), name=f"trtllm-{self.request.request_id}")

    def event(
        self,
        text: str,
        token_ids: tuple[int, ...],
        reason: FinishReason | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> TokenEvent:
        return TokenEvent(
            text,
            token_ids,
            len(self.request.prompt_token_ids),
            self.num_cached_tokens,
            self.num_completion_tokens,
            reason,
            logprobs=logprobs,
            stop_str=self._stop.matched if reason is FinishReason.STOP else None,
        )

    # -- aborting -------------------------------------------------------------------------
    def request_abort(self) -> None:
        """Ask TensorRT-LLM to cancel; it answers with a final 'cancelled' response."""
        if self._is_abort_requested or self.handle.finished:
            return
        self._is_abort_requested = True
        try:
            self.handle.abort()
        except Exception as exc:  # an abort failure must not take the stream down with it
            log.warning("trtllm_abort_failed", request_id=self.request.request_id, error=str(exc))

    def arm_abort_deadline(self, grace_s: float) -> None:
        # TensorRT-LLM before ~1.2 never answers the abort of a still-queued request (#9280).
        if self._deadline is None and not self._is_final_queued:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(grace_s, self.force_finish, "abort_unconfirmed")

    def force_finish(self, why: str) -> None:
        """End the stream with ABORT now, whatever TensorRT-LLM still sends."""
        if self._is_final_queued or self.is_retired:
            return
        log.warning("trtllm_stream_forced_end", request_id=self.request.request_id, reason=why)
        self._put(self.event("", (), FinishReason.ABORT))
        if self._reader is not None:
            self._reader.cancel()

    def retire(self) -> None:
        """The consumer is done (final event, error, or it went away): release everything."""
        self.is_retired = True
        if self._deadline is not None:
            self._deadline.cancel()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        if not self.handle.finished:
            self.request_abort()  # leaving the loop alone does not stop the GPU work

    # -- the pump -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            async for _ in self.handle:
                event = self._step()
                if event is not None:
                    self._put(event)
                if self._is_final_queued:
                    return
            self._put(EngineError("TensorRT-LLM ended the stream without a finish reason"))
        except asyncio.CancelledError:
            raise
        except EngineError as exc:
            self._put(exc)
        except self._request_error as exc:
            self._put(EngineError(f"TensorRT-LLM failed the request: {exc}"))
        except Exception as exc:
            log.exception("trtllm_stream_failed", request_id=self.request.request_id)
            self._put(EngineError(f"TensorRT-LLM stream failed: {type(exc).__name__}: {exc}"))

    def _step(self) -> TokenEvent | None:
        handle = self.handle
        output = handle.outputs[0]
        new_ids = tuple(output.token_ids_diff)
        logprobs = self._logprobs(output, new_ids)
        self.num_completion_tokens += len(new_ids)
        self._on_progress(len(new_ids), self._update_cached(getattr(handle, "cached_tokens", None)))
        finished = bool(handle.finished)
        # The cumulative text, not text_diff: at a stop word TensorRT-LLM shortens `text`,
        # and a text_diff already sent cannot be taken back.
        text = self._stop.update(output.text or "", final=finished)
        logprobs = self._sent_logprobs(new_ids, logprobs)
        if self._stop.stopped:
            if not finished:
                self.request_abort()  # a stop string that did not fall on token boundaries
            return self.event(text, new_ids, FinishReason.STOP, logprobs)
        if finished:
            reason = map_finish_reason(output.finish_reason)
            if reason is None:
                raise EngineError(f"TensorRT-LLM finished with an unknown reason {output.finish_reason!r}")
            return self.event(text, new_ids, reason, logprobs)
        if not text and not new_ids:
            return None
        return self.event(text, new_ids, logprobs=logprobs)

    def _logprobs(self, output: Any, new_ids: tuple[int, ...]) -> tuple[TokenLogprob, ...]:
        """The logprobs of `new_ids`, read by position from the cumulative `output.logprobs`
        (not `logprobs_diff`: a final response may cut a stop word from `token_ids` only)."""
        num_top = self.request.sampling.logprobs
        if num_top is None or not new_ids:
            return ()
        start = self.num_completion_tokens
        entries = list(getattr(output, "logprobs", None) or ())[start : start + len(new_ids)]
        if len(entries) < len(new_ids):
            log.warning(
                "trtllm_logprobs_missing",
                request_id=self.request.request_id,
                num_tokens=len(new_ids),
                num_logprobs=len(entries),
            )
        return token_logprobs(new_ids, entries, num_top)

    def _sent_logprobs(self, new_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]) -> tuple[TokenLogprob, ...]:
        """Of the logprobs so far, those of the tokens whose text was now sent."""
        if self._token_starts is None:
            return ()
        self._token_starts.push(new_ids)
        num_sent = self._token_starts.num_tokens_before(self._stop.num_emitted_chars)
        return self._logprob_gate.release(logprobs, num_sent)

    def _update_cached(self, cached: Any) -> int:
        """Fold RequestOutput.cached_tokens (1.1+) into our count; return the increase."""
        if not isinstance(cached, int) or isinstance(cached, bool):
            return 0
        cached = min(cached, len(self.request.prompt_token_ids))
        increase = max(0, cached - self.num_cached_tokens)
        self.num_cached_tokens += increase
        return increase

    def _put(self, item: TokenEvent | BaseException) -> None:
        if self._is_final_queued:
            return
        self.events.put_nowait(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self._is_final_queued = True
