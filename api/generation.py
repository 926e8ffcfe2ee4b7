"""One job's generation: its n choices from the backend, through the output filter, to an emit callback.

Choices after the first start once the first has its first token (so they find the prompt's KV
blocks in the prefix cache); until the first token a heartbeat callback keeps proxies waiting.
Counts land on the `Job`; closing a choice's generator aborts it in the engine. Nothing here
writes to the client or the store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from api.answer import Answer
from api.job import Job
from api.prompt import chat_template_of, prompt_tools
from api.reasoning import ReasoningSplitter, ThinkingCounter
from api.state import AppState
from api.toolparse import ToolCallParser
from api.tools import ChoiceMode, detect_format
from engine.types import FinishReason, TokenEvent, TokenLogprob, UsageSource

Emit = Callable[[str, tuple[TokenLogprob, ...]], Awaitable[None]]


def make_answer(job: Job) -> Answer:
    """The client's view of the generation: tool calls parsed when tools may be called."""
    chat, tokenizer = job.chat, job.model.tokenizer
    parser = None
    if chat.tools and chat.tool_choice.mode is not ChoiceMode.NONE:
        fmt = detect_format(chat_template_of(job.model, prompt_tools(chat)), job.model.config.tool_parser)
        forced = chat.tool_choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)
        only = chat.tool_choice.name if chat.tool_choice.mode is ChoiceMode.NAMED else None
        if forced and only is None and len(chat.tools) == 1:
            only = chat.tools[0].name
        parser = ToolCallParser(fmt, frozenset(t.name for t in chat.tools), forced=forced, forced_name=only)
    reasoning = None if job.reasoning_opened is None else ReasoningSplitter(in_thinking=job.reasoning_opened)
    return Answer(tokenizer, parser, chat.logprobs, reasoning, legacy_functions=chat.legacy_functions)


async def generate_choices(
    state: AppState, job: Job, emits: list[Emit], on_idle: Callable[[str], Awaitable[None]] | None
) -> list[FinishReason]:
    """Generate the n choices; each finish reason. Choices after the first start once the first
    has its first token, so that they find the prompt's KV blocks in the prefix cache."""
    job.completion_tokens_by_choice = [0] * len(emits)
    job.reasoning_tokens_by_choice = [0] * len(emits)
    first = asyncio.ensure_future(_generate_choice(state, job, emits[0], on_idle))
    tasks = [first]
    try:
        while len(emits) > 1 and job.first_token_s is None and not first.done():
            await asyncio.wait({first}, timeout=0.005)
        later = [_generate_choice(state, job, emit, None, i) for i, emit in enumerate(emits) if i]
        tasks += [asyncio.ensure_future(choice) for choice in later]
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # no-op once done; closing each generator aborts it in the engine
        await asyncio.gather(*tasks, return_exceptions=True)


async def _generate_choice(
    state: AppState,
    job: Job,
    emit: Emit,
    on_idle: Callable[[str], Awaitable[None]] | None,
    choice: int = 0,
) -> FinishReason:
    """Run one choice's generation, filtering output; returns the finish reason. Closing aborts."""
    out_filter = state.output_filter(job)
    events = state.generate(job, choice)
    finish = FinishReason.STOP
    thinking = None if job.reasoning_opened is None else ThinkingCounter(in_thinking=job.reasoning_opened)
    try:
        while (event := await _next_event(events, job, state, on_idle)) is not None:
            if thinking is not None:  # the tokens before the output filter holds any text back
                thinking.feed(event.text, event.num_completion_tokens - job.completion_tokens_by_choice[choice])
                job.reasoning_tokens_by_choice[choice] = thinking.num_tokens
            _count(job, event, choice)
            text = event.text
            if out_filter is not None:
                text, blocked = await out_filter.feed(text)
                if blocked is not None and not blocked.allowed:
                    state.count_filtered(job, blocked)
                    return FinishReason.CONTENT_FILTER
            if text and choice == 0:
                job.text_parts.append(text)
            if text or event.logprobs:
                await emit(text, event.logprobs)
            if event.finish_reason is not None:
                finish = event.finish_reason
        if out_filter is not None:
            tail, blocked = await out_filter.finish()
            if blocked is not None and not blocked.allowed:
                state.count_filtered(job, blocked)
                return FinishReason.CONTENT_FILTER
            if tail:
                if choice == 0:
                    job.text_parts.append(tail)
                await emit(tail, ())
        return finish
    finally:
        await events.aclose()  # aborts the request in the backend if it is still running


async def _next_event(
    events: AsyncIterator[TokenEvent], job: Job, state: AppState, on_idle: Callable[[str], Awaitable[None]] | None
) -> TokenEvent | None:
    """The next event; until the first token, send a heartbeat comment every heartbeat_s."""
    if job.first_token_s is not None or on_idle is None:
        return await anext(events, None)
    task = asyncio.ensure_future(anext(events, None))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=state.settings.server.heartbeat_s)
            if done:
                return task.result()
            await on_idle("processing")
    finally:
        if not task.done():
            # Let the cancelled step finish before anyone closes the generator.
            task.cancel()
            await asyncio.wait({task})


def _count(job: Job, event: TokenEvent, choice: int = 0) -> None:
    """Cumulative counts; the prompt (and its cache hit) is counted once, by choice 0."""
    if choice == 0 and event.usage_source is not UsageSource.ENGINE:  # counted upstream, or recounted for it
        job.reported_prompt_tokens = event.num_prompt_tokens
        job.usage_source = event.usage_source
    if choice == 0:
        job.num_cached_tokens = event.num_cached_tokens
        if event.stop_str is not None:
            job.stop_str = event.stop_str
        if event.prompt_logprobs:
            job.prompt_logprobs = event.prompt_logprobs
    job.completion_tokens_by_choice[choice] = event.num_completion_tokens
    job.num_completion_tokens = sum(job.completion_tokens_by_choice)
    if job.first_token_s is None and event.num_completion_tokens > 0:
        job.first_token_s = time.monotonic()
