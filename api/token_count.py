"""Counting a prompt's tokens without generating: POST /v1/messages/count_tokens (Anthropic's)
and POST /v1/responses/input_tokens (OpenAI's). Each counts as a request against the caller's
per-minute limit (no tokens), so it cannot be called without bound; nothing is billed or stored.
Files count with their text, read as for a generating request (and refused as there), and a vision
model's images as its image tokens (checked as there, neither decoded nor fetched); a Responses
count fits the prompt to the context with the request path's own code (count_as_served).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from api import attachments
from api import tools as tooling
from api.attachment_parts import AttachContext
from api.attachments import OFF_LOOP_CHARS
from api.errors import not_found
from api.files import BLOBS, TEXTS
from api.job import JobInputs
from api.prompt import encode_chat
from api.protocol import ChatMessage, ChatRequest
from api.state import PRINCIPAL, REQUEST_ID, STATE
from engine.registry import ModelHandle
from engine.torch_threads import side_executor


def charge_one_request(request: web.Request) -> dict[str, str]:
    """One request against the caller's per-minute limit (429 past it); the limit headers."""
    state = request.app[STATE]
    caller = state.caller(request[PRINCIPAL])
    limiter = state.admission.limiter
    limiter.settle(limiter.acquire(caller.key, caller.tier_name, caller.tier, 0, caller.overrides), 0)
    return state.limit_headers(caller)


def model_to_count_for(request: web.Request, name: str | None) -> ModelHandle:
    """The model named, if the caller's tier may use it; else 404 as for a generating request."""
    state = request.app[STATE]
    tier_name, _ = state.tier_of(request[PRINCIPAL])
    if name not in state.admission.router.models_for_tier(tier_name):
        raise not_found(f"The model '{name}' does not exist or you do not have access to it.", code="model_not_found")
    return state.models[name]


def _attach_context(request: web.Request) -> AttachContext:
    state = request.app[STATE]
    files, images = state.settings.files, state.settings.images
    return AttachContext(state.store, request.app[BLOBS], request[PRINCIPAL].org.id, files, images, request.app[TEXTS])


async def read_files(request: web.Request, model: ModelHandle, messages: tuple[ChatMessage, ...]) -> list[ChatMessage]:
    """The messages with their files read, as a generating request on `model` reads them
    (api/attachments.py): a file's text counts, a vision model's image its image tokens, and a file
    or image the answer would refuse is refused here too."""
    return await attachments.read_files(_attach_context(request), model, messages)


async def count_as_served(
    request: web.Request, model: ModelHandle, chat: ChatRequest, history: tuple[ChatMessage, ...] | None
) -> int:
    """The prompt tokens serving `chat` on `model` would take: its files read and the prompt fitted
    to the context by the request path's own code (attachments.prepare_count, then make_job): a
    stored `history` (None: none is stored) loses its oldest turns as it would, files are cut or
    refused per `truncation`, and what the request would refuse (a prompt past the context) is the
    same 400. A long prompt is tokenized off the loop, as there."""
    state, principal = request.app[STATE], request[PRINCIPAL]
    tier_name, tier = state.tier_of(principal)
    inputs = JobInputs(
        request_id=request[REQUEST_ID],
        principal=principal,
        tier_name=tier_name,
        tier=tier,
        chat=chat,
        model=model,
        fallback_from=None,
        history=history,
        cache_salt=state.cache_salt(principal),
    )
    return (await attachments.prepare_count(_attach_context(request), inputs)).num_prompt_tokens


async def count_prompt(
    model: ModelHandle,
    messages: list[ChatMessage],
    tools: tuple[tooling.Tool, ...],
    template_kwargs: dict[str, Any] | None,
    continue_final: bool = False,
) -> int:
    """The prompt's tokens as the model's template renders it; a long one tokenized off the loop,
    as for a generating request."""
    args = (model, messages, tools, template_kwargs, continue_final)
    if sum(len(m.content) for m in messages) + tooling.num_chars(tools) < OFF_LOOP_CHARS:
        return len(encode_chat(*args))
    return len(await asyncio.get_running_loop().run_in_executor(side_executor(), encode_chat, *args))
