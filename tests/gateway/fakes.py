"""Test doubles for the gateway tests: a settable clock and a scripted Backend.

The backend implements engine/types.py's Backend protocol with canned tokens, so gateway
code runs for real against it; it records every request and abort it sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.types import EngineError, EngineStats, FinishReason, GenerationRequest, TokenEvent


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start_s: float = 1000.0):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class ScriptedBackend:
    """Streams `words` one event each; `step` gates every event when `is_gated` is set.

    With `is_gated`, each event waits for the test to call `release(n)`, so a test decides
    exactly how far a generation has progressed. `fail_after` raises EngineError mid-stream.
    """

    def __init__(self, words: tuple[str, ...] = ("a", "b", "c"), *, is_gated: bool = False,
                 fail_after: int | None = None, max_model_len: int = 4096):
        self.words = words
        self.is_gated = is_gated
        self.fail_after = fail_after
        self._max_model_len = max_model_len
        self._permits = asyncio.Semaphore(0)
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.room = True

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_running(self) -> int:
        return 0

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def check_request(self, request: GenerationRequest) -> None:
        return None

    def has_room(self) -> bool:
        return self.room

    def release(self, num_events: int = 1) -> None:
        for _ in range(num_events):
            self._permits.release()

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        num_prompt = len(request.prompt_token_ids)
        words = self.words[: request.sampling.max_tokens]
        try:
            for i, word in enumerate(words):
                if self.is_gated:
                    await self._permits.acquire()
                else:
                    await asyncio.sleep(0)
                if self.fail_after is not None and i >= self.fail_after:
                    raise EngineError("scripted failure")
                is_last = i == len(words) - 1
                finish = None
                if is_last:
                    finish = FinishReason.LENGTH if len(words) == request.sampling.max_tokens else FinishReason.STOP
                yield TokenEvent(word, (100 + i,), num_prompt, 0, i + 1, finish)
            self.finished.append(request.request_id)
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests) - len(self.finished) - len(self.aborted))

    def health(self) -> bool:
        return True
