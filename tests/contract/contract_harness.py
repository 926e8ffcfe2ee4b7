"""Helpers of the backend contract suite: backends under test, request builders, stream checks.

`BackendUnderTest` wraps one started backend with the one hook each backend needs a
backend-specific way to provide: `inject_failure()`, which makes the next request fail
inside the backend. The stand-in `tensorrt_llm` is loaded from this folder by file path.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from engine.tokenizer import Tokenizer
from engine.types import Backend, GenerationRequest, SamplingParams, TokenEvent

STANDIN_DIR = Path(__file__).resolve().parent / "standin_tensorrt_llm"
STANDIN_NAME = "standin_tensorrt_llm"
PROMPT_TEXT = "<|im_start|>user\nWhat does the word river mean?<|im_end|>\n<|im_start|>assistant\n"

_request_ids = itertools.count()


@dataclass
class BackendUnderTest:
    name: str
    backend: Backend
    tokenizer: Tokenizer
    inject_failure: Callable[[], None]


def load_standin() -> tuple[ModuleType, ModuleType]:
    """The stand-in package and its `llmapi` module, imported once under their own name."""
    if STANDIN_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            STANDIN_NAME, STANDIN_DIR / "__init__.py", submodule_search_locations=[str(STANDIN_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[STANDIN_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[STANDIN_NAME], importlib.import_module(f"{STANDIN_NAME}.llmapi")


def make_request(
    prompt: list[int] | tuple[int, ...],
    *,
    max_tokens: int = 8,
    stop: tuple[str, ...] = (),
    cache_salt: str | None = None,
    **sampling: object,
) -> GenerationRequest:
    """A greedy request that ignores EOS, so lengths are predictable on random weights."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop, ignore_eos=True, **sampling)
    return GenerationRequest(f"req-{next(_request_ids)}", tuple(prompt), params, cache_salt=cache_salt)


async def collect(backend: Backend, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in backend.generate(request)]


def joined_text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def check_stream_shape(events: list[TokenEvent], request: GenerationRequest) -> TokenEvent:
    """Exactly one final event, last; cumulative counts never go down; return the final."""
    assert events, "a stream must yield at least its final event"
    finals = [e for e in events if e.finish_reason is not None]
    assert len(finals) == 1 and events[-1] is finals[0], [e.finish_reason for e in events]
    num_prompt = len(request.prompt_token_ids)
    previous = None
    for event in events:
        assert event.num_prompt_tokens == num_prompt
        assert 0 <= event.num_cached_tokens <= num_prompt
        if previous is not None:
            assert event.num_completion_tokens >= previous.num_completion_tokens
            assert event.num_cached_tokens >= previous.num_cached_tokens
        previous = event
    return finals[0]


async def eventually(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> bool:
    """Poll until `condition()` holds (frees happen at a step boundary, not instantly)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
