"""A response's record: what one Responses API call knows about itself (`ResponseContext`), its
final response object, and its row in the store (inserted once, updated while a background
response runs). Shared by the foreground path (api/responses.py) and the background one
(api/responses_background.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from api.answer import Answer
from api.errors import ApiError
from api.job import Job
from api.responses_wire import (
    ResponsesRequest,
    input_item_object,
    new_id,
    output_items,
    response_object,
    usage_object,
)
from api.state import AppState
from engine.types import FinishReason
from store.responses import StoredResponse
from store.types import StoreUnavailable

log = structlog.get_logger(__name__)
_INCOMPLETE = {FinishReason.LENGTH: "max_output_tokens", FinishReason.CONTENT_FILTER: "content_filter"}
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass(slots=True)
class ResponseContext:
    """`req.chat` carries `instructions` apart (placed first, never stored) and, when stored,
    the conversation whose history the request path loads; not stored, the
    `num_inline_messages` of the history come first in its messages, then the input."""

    req: ResponsesRequest
    response_id: str
    created: int
    message_id: str
    num_history_messages: int = 0  # the conversation's messages before this response's turn
    num_inline_messages: int = 0  # of those, sent in the messages (store: false)
    new_conversation: str | None = None  # made for this response: deleted if it is refused before an answer
    stored: bool = False  # its row exists in the store


def body_of(ctx: ResponseContext, job: Job, state: dict) -> dict:
    """The response object in `state` (status, output, ...), with the sampling the job really uses."""
    sampling = job.gen.sampling
    fields = {"temperature": sampling.temperature, "top_p": sampling.top_p, **state}
    return response_object(ctx.response_id, ctx.created, job.model.name, ctx.req, fields)


async def finished(ctx: ResponseContext, state: AppState, job: Job, answer: Answer, finish: FinishReason) -> dict:
    """The final response object, stored (when asked) before the client sees it."""
    reason = _INCOMPLETE.get(finish)
    body = body_of(
        ctx,
        job,
        {
            "status": "incomplete" if reason else "completed",
            "incomplete_details": {"reason": reason} if reason else None,
            "output": output_items(answer, ctx.message_id),
            "usage": usage(job),
        },
    )
    conversation_id = job.chat.conversation_id
    if ctx.req.store and conversation_id is not None:
        org_id = job.principal.org.id
        conv = await state.store.get_conversation(org_id, conversation_id)
        num_messages = len(conv.messages) if conv is not None else 0
        if ctx.stored:  # a background response: its row exists since it was queued
            await state.store.update_response(
                org_id, ctx.response_id, status=body["status"], body_json=dumps(body), num_messages=num_messages
            )
        else:
            await insert(ctx, state, job, body, num_messages)
    return body


async def record_cut(ctx: ResponseContext, state: AppState, job: Job, answer: Answer, error: ApiError | None) -> dict:
    """The response object of an answer cut short: `cancelled` when its client left (`error`
    None), `failed` when the server stopped it (shutdown, an engine failure). Its turn is in the
    conversation already (the finish path stored what was generated), so with `store` its row
    is written too, as a finished one's is: the id the client saw resolves, and
    previous_response_id can continue from it. An answer complete before the cut (billed and
    stored as finished) stands: its row is the finished one."""
    if job.finished_as is not None and job.finished_as is not FinishReason.ABORT:
        return await asyncio.shield(finished(ctx, state, job, answer, job.finished_as))
    fields: dict[str, Any] = {"status": "cancelled", "error": None}
    if error is not None:
        fields = {"status": "failed", "error": {"code": error.code or "server_error", "message": error.message}}
    fields |= {"output": output_items(answer, ctx.message_id), "usage": usage(job)}
    body = {**body_of(ctx, job, fields), **fields}  # the response object's own fields leave `error` out
    conversation_id = job.chat.conversation_id
    if ctx.req.store and not ctx.stored and job.turn_stored and conversation_id is not None:
        try:
            await asyncio.shield(_insert_cut(ctx, state, job, body))
        except StoreUnavailable:  # the store logged it; the turn stays, as a crash would leave it
            log.error("response_unsaved", response_id=ctx.response_id, status=body["status"])
    return body


async def _insert_cut(ctx: ResponseContext, state: AppState, job: Job, body: dict) -> None:
    assert job.chat.conversation_id is not None
    conv = await state.store.get_conversation(job.principal.org.id, job.chat.conversation_id)
    await insert(ctx, state, job, body, len(conv.messages) if conv is not None else 0)


async def insert(ctx: ResponseContext, state: AppState, job: Job, body: dict, num_messages: int) -> None:
    items = [input_item_object({"id": new_id(_ITEM_ID_PREFIX[item["type"]]), **item}) for item in ctx.req.input_items]
    assert job.chat.conversation_id is not None
    await state.store.insert_response(
        job.principal.org.id,
        StoredResponse(
            ctx.response_id,
            job.chat.conversation_id,
            num_messages,
            dumps(body),
            dumps(items),
            time.time(),
            body["status"],
        ),
    )
    ctx.stored = True


async def set_state(ctx: ResponseContext, state: AppState, job: Job, fields: dict) -> None:
    """Update the stored row of a running background response (no-op once it is final or deleted)."""
    body = {**body_of(ctx, job, fields), **fields}
    try:
        await asyncio.shield(
            state.store.update_response(
                job.principal.org.id, ctx.response_id, status=body["status"], body_json=dumps(body)
            )
        )
    except StoreUnavailable:  # the store says so in its log; a restart marks it failed
        log.error("background_response_unsaved", response_id=ctx.response_id, status=body["status"])


def usage(job: Job) -> dict:
    return usage_object(
        job.num_prompt_tokens, job.num_cached_tokens, job.num_completion_tokens, job.num_reasoning_tokens
    )


def dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()
