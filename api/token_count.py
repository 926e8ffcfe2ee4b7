"""Counting a prompt's tokens without generating: POST /v1/messages/count_tokens (Anthropic's)
and POST /v1/responses/input_tokens (OpenAI's). Each counts as a request against the caller's
per-minute limit (no tokens), so it cannot be called without bound; nothing is billed or stored.
Files count with their text, read as for a generating request (and refused as there).
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
from api.prompt import encode_chat
from api.protocol import ChatMessage
from api.state import PRINCIPAL, STATE
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


async def read_files(
    request: web.Request, history: tuple[ChatMessage, ...], messages: tuple[ChatMessage, ...]
) -> list[ChatMessage]:
    """The messages with their files read, as a generating request reads them (api/attachments.py):
    a file's text counts, and a file the answer would refuse is refused here too."""
    state = request.app[STATE]
    files, images = state.settings.files, state.settings.images
    ctx = AttachContext(state.store, request.app[BLOBS], request[PRINCIPAL].org.id, files, images, request.app[TEXTS])
    return await attachments.read_files(ctx, history, messages)


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
