"""The tests' one stand-in for a model: a `Backend` (engine/types.py) with answers a test chooses.

With `words` it streams those words, one event each; without, it repeats the last user message
of the ChatML prompt token by token, so HTTP, browser and end-to-end tests choose the answer
(e.g. hostile markdown) through the prompt. It records every request and abort. Tests inject it
(`api.app.init(settings, backend_factory=...)`, or `python -m testing.fake_server` for a server
process); the server itself can never be configured to use it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from engine.types import (
    EngineError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestRejected,
    TokenEvent,
)

# ChatML: the last user turn of the rendered prompt.
_LAST_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_FIRST_WORD_ID = 100  # token ids of scripted words: 100, 101, ...


@dataclass(frozen=True, slots=True)
class FakeBehaviour:
    """How the fake paces and limits its streams."""

    token_delay_s: float = 0.0  # sleep before each token, so a stream lasts long enough to observe
    max_num_running: int = 0  # generations at once before has_room() says no; 0: unlimited
    is_gated: bool = False  # each event waits for the test's release(n)
    fail_after: int | None = None  # raise EngineError at this event index


class FakeBackend:
    """Streams `words`, or echoes the last user message (which needs `tokenizer`)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        words: tuple[str, ...] | None = None,
        behaviour: FakeBehaviour = FakeBehaviour(),
        max_model_len: int = 4096,
    ):
        if words is None and tokenizer is None:
            raise ValueError("FakeBackend echoes the prompt through a tokenizer: give one, or words")
        self.words = words
        self.behaviour = behaviour
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._permits = asyncio.Semaphore(0)
        self._running: dict[str, asyncio.Event] = {}  # request id -> set when aborted
        self._num_generated = 0
        self.room = True  # a test may set False: has_room() then says no
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []  # aborted or abandoned by the caller, each once
        self.finished: list[str] = []

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_running(self) -> int:
        return self.behaviour.max_num_running

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        for event in self._running.values():
            event.set()

    def check_request(self, request: GenerationRequest) -> None:
        if len(request.prompt_token_ids) + 1 > self._max_model_len:
            raise RequestRejected("prompt does not fit", param="messages")

    def has_room(self) -> bool:
        limit = self.behaviour.max_num_running
        return self.room and (limit == 0 or len(self._running) < limit)

    def release(self, num_events: int = 1) -> None:
        """Let `num_events` more events through (with `is_gated`)."""
        for _ in range(num_events):
            self._permits.release()

    def abort(self, request_id: str) -> None:
        event = self._running.get(request_id)
        if event is not None:
            event.set()
            self._note_abort(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_generation_tokens=self._num_generated)

    def health(self) -> bool:
        return True

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append(request)
        self._running[request.request_id] = asyncio.Event()
        return self._stream(request)

    def _answer(self, request: GenerationRequest) -> tuple[list[int], IncrementalDetokenizer | None]:
        if self.words is not None:
            return [_FIRST_WORD_ID + i for i in range(len(self.words))], None
        assert self._tokenizer is not None
        prompt = self._tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        turns = _LAST_USER.findall(prompt)
        return self._tokenizer.encode(turns[-1] if turns else ""), IncrementalDetokenizer(self._tokenizer)

    def _text(self, token_id: int, detok: IncrementalDetokenizer | None, is_last: bool) -> str:
        if detok is None:
            return self.words[token_id - _FIRST_WORD_ID]  # type: ignore[index]
        text, _ = detok.push([token_id])
        return text + detok.flush() if is_last else text

    async def _pace(self) -> None:
        if self.behaviour.is_gated:
            await self._permits.acquire()
        else:
            await asyncio.sleep(self.behaviour.token_delay_s)

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        answer_ids, detok = self._answer(request)
        limit = request.sampling.max_tokens
        token_ids = answer_ids[:limit]
        num_prompt = len(request.prompt_token_ids)
        finish = FinishReason.LENGTH if len(answer_ids) >= limit else FinishReason.STOP
        aborted = self._running[request.request_id]
        try:
            if not token_ids:
                yield TokenEvent("", (), num_prompt, 0, 0, finish)
            for i, token_id in enumerate(token_ids):
                await self._pace()
                if aborted.is_set():
                    self._note_abort(request.request_id)
                    yield TokenEvent("", (), num_prompt, 0, i, FinishReason.ABORT)
                    return
                fail_after = self.behaviour.fail_after
                if fail_after is not None and i >= fail_after:
                    raise EngineError("scripted failure")
                self._num_generated += 1
                is_last = i == len(token_ids) - 1
                text = self._text(token_id, detok, is_last)
                yield TokenEvent(text, (token_id,), num_prompt, 0, i + 1, finish if is_last else None)
            self.finished.append(request.request_id)
        except (GeneratorExit, asyncio.CancelledError):
            self._note_abort(request.request_id)
            raise
        finally:
            self._running.pop(request.request_id, None)

    def _note_abort(self, request_id: str) -> None:
        if request_id not in self.aborted:
            self.aborted.append(request_id)


def fake_backends(
    behaviour: FakeBehaviour = FakeBehaviour(), names: Collection[str] | None = None
) -> Callable[[str, Tokenizer, int | None], FakeBackend | None]:
    """A `backend_factory` for `api.app.init`: the native models named (all when None) become
    echoing fakes; the others keep the native engine."""

    def make(name: str, tokenizer: Tokenizer, max_model_len: int | None) -> FakeBackend | None:
        if names is not None and name not in names:
            return None
        return FakeBackend(tokenizer, behaviour=behaviour, max_model_len=max_model_len or 4096)

    return make
