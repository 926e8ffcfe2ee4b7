"""A test-only backend that repeats the last user message, token by token.

Selected with `backend = "echo"` in a model's config. It lets HTTP and browser tests
produce exact answers (e.g. hostile markdown) without a real model. It implements the full
`Backend` protocol; `CHAT_ECHO_TOKEN_DELAY_S` slows it down so a stream is observable.
Never use it to serve users.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from engine.types import EngineStats, FinishReason, GenerationRequest, RequestRejected, TokenEvent

# ChatML: the last user turn of the rendered prompt.
_LAST_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)


class EchoBackend:
    """Answers with the last user message (or `echo:` followed by nothing if none)."""

    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int = 4096):
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._running: dict[str, asyncio.Event] = {}
        self._num_generated = 0
        self.aborted_request_ids: list[str] = []
        self.token_delay_s = float(os.environ.get("CHAT_ECHO_TOKEN_DELAY_S", "0"))
        self.max_running = int(os.environ.get("CHAT_ECHO_MAX_RUNNING", "0"))  # 0: unlimited

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_running(self) -> int:
        return self.max_running

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        for event in self._running.values():
            event.set()

    def check_request(self, request: GenerationRequest) -> None:
        if len(request.prompt_token_ids) + 1 > self._max_model_len:
            raise RequestRejected("prompt does not fit", param="messages")

    def has_room(self) -> bool:
        return self.max_running == 0 or len(self._running) < self.max_running

    def abort(self, request_id: str) -> None:
        event = self._running.get(request_id)
        if event is not None:
            event.set()

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_generation_tokens=self._num_generated)

    def health(self) -> bool:
        return True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        prompt = self._tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        turns = _LAST_USER.findall(prompt)
        answer_ids = self._tokenizer.encode(turns[-1] if turns else "")
        limit = request.sampling.max_tokens
        aborted = asyncio.Event()
        self._running[request.request_id] = aborted
        num_prompt = len(request.prompt_token_ids)
        detok = IncrementalDetokenizer(self._tokenizer)
        try:
            for i, token_id in enumerate(answer_ids[:limit]):
                if aborted.is_set():
                    self.aborted_request_ids.append(request.request_id)
                    yield TokenEvent("", (), num_prompt, 0, i, FinishReason.ABORT)
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                self._num_generated += 1
                text, _ = detok.push([token_id])
                yield TokenEvent(text, (token_id,), num_prompt, 0, i + 1)
            done = len(answer_ids[:limit])
            reason = FinishReason.LENGTH if len(answer_ids) > limit else FinishReason.STOP
            yield TokenEvent(detok.flush(), (), num_prompt, 0, done, reason)
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted_request_ids.append(request.request_id)
            raise
        finally:
            self._running.pop(request.request_id, None)
