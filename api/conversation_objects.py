"""The JSON shapes of a stored conversation and its messages, as the conversation endpoints and
the export (api/export.py) render them, and the one read that gives a conversation as GET shows it.

Rendering only: no routes, no request parsing; the store does every read.
"""

from __future__ import annotations

from typing import Any

import orjson

from api import feedback as feedback_api
from store.conversations import AnswerUsage
from store.store import Store
from store.types import Conversation, Message


async def read_conversation(store: Store, org_id: str, conversation_id: str) -> dict | None:
    """GET /v1/conversations/{id}'s body: the conversation with its messages, each answer's usage as
    billed and any feedback on it; None when the organisation has no such live conversation."""
    found = await store.get_billed_conversation(org_id, conversation_id)
    if found is None:
        return None
    conv, billed = found
    obj = conversation_obj(conv, with_messages=True, billed=billed)
    rated = await store.conversation_feedback(conversation_id)
    for message in obj["messages"]:
        if message["id"] in rated:  # what the user said about this answer (api/feedback.py)
            message["feedback"] = feedback_api.feedback_obj(rated[message["id"]])
    return obj


def message_obj(m: Message, billed: AnswerUsage | None = None) -> dict:
    obj: dict[str, Any] = {
        "id": m.id,
        "object": "conversation.message",
        "role": m.role,
        "content": m.content,
        "created_at": int(m.created_at),
        "tokens": m.tokens,
        "model": m.model,
    }
    if m.parts_json is not None:  # sent with files or images: the parts as sent (file ids, image refs)
        obj["parts"] = orjson.loads(m.parts_json)
    if m.finish_reason is not None:  # assistant messages: stop, length, content_filter, abort or error
        obj["finish_reason"] = m.finish_reason
    if billed is not None:  # extensions, from the ledger row of the request that wrote the answer
        obj["usage"] = usage_obj(billed)
        if billed.fallback_from is not None:
            obj["fallback_from"] = billed.fallback_from
            if billed.fallback_reason is not None:
                obj["fallback_reason"] = billed.fallback_reason
        if billed.history_messages_dropped:  # the prompt left out the conversation's oldest messages
            obj["history_messages_dropped"] = billed.history_messages_dropped
    return obj


def usage_obj(billed: AnswerUsage) -> dict:
    """The chat completion's usage as billed."""
    return {
        "prompt_tokens": billed.prompt_tokens,
        "completion_tokens": billed.completion_tokens,
        "total_tokens": billed.prompt_tokens + billed.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": billed.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": billed.reasoning_tokens},
        "cost_usd": round(billed.cost_usd, 9),
    }


def conversation_obj(c: Conversation, *, with_messages: bool, billed: dict[str, AnswerUsage] | None = None) -> dict:
    obj: dict[str, Any] = {
        "id": c.id,
        "object": "conversation",
        "title": c.title,
        "created_at": int(c.created_at),  # unix seconds, as OpenAI's
        "updated_at": int(c.updated_at),
        "metadata": c.metadata,
    }
    if with_messages:
        usage = billed or {}
        obj["messages"] = [message_obj(m, usage.get(m.id)) for m in c.messages]
    return obj
