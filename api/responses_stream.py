"""The Responses API's stream: OpenAI's event types, numbered, for one message item and its
function calls (`response.output_item.added`, `response.output_text.delta`, ...), and the same
events replayed from a stored response (`GET /v1/responses/{id}?stream=true`). Rendering only:
api/responses.py decides when a response starts, streams and ends.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from api.responses_wire import event_logprobs, function_call_item, message_item, new_id, output_text_part
from api.tools import ToolCall

# The event that ends a stream, by the response's final status (OpenAI has no event of its own
# for a cancelled response: it ends as a failed one does, its status saying `cancelled`).
FINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}


class Writer(Protocol):
    async def data(self, payload: dict) -> None: ...


class EventStream:
    """OpenAI's Responses stream events, numbered, for one message item (`message_id`) and its function calls."""

    def __init__(self, message_id: str, writer: Writer):
        self._message_id, self._writer = message_id, writer
        self._seq = itertools.count()
        self._num_items = 0
        self._text_index: int | None = None  # output_index of the message item once opened
        self._text = ""
        self._logprobs: list[dict] = []  # of the text sent so far (when `include` asked for them)
        self._pending: list[dict] = []  # logprobs that came with no text (held for the next text delta)

    async def event(self, kind: str, **fields) -> None:
        await self._writer.data({"type": kind, "sequence_number": next(self._seq), **fields})

    async def delta(self, d: dict) -> None:
        delta = d["delta"]
        if d.get("logprobs"):
            self._pending += d["logprobs"]["content"]
        if delta.get("content"):
            await self._text_delta(delta["content"])
        for call in delta.get("tool_calls", []):
            await self._call(call)

    async def _text_delta(self, text: str) -> None:
        await self._open_text()
        self._text += text
        entries, self._pending = self._pending, []
        self._logprobs += entries
        await self.event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=self._text_index,
            content_index=0,
            delta=text,
            logprobs=event_logprobs(entries),
        )

    async def _open_text(self) -> None:
        if self._text_index is not None:
            return
        self._text_index = self._next_index()
        item = message_item(self._message_id, "", "in_progress")
        await self.event("response.output_item.added", output_index=self._text_index, item=item)
        await self.event(
            "response.content_part.added",
            item_id=self._message_id,
            output_index=self._text_index,
            content_index=0,
            part=output_text_part(""),
        )

    async def _call(self, raw: dict) -> None:
        call = ToolCall(raw["id"], raw["function"]["name"], raw["function"]["arguments"])
        index, item = self._next_index(), function_call_item(call, "in_progress")
        await self.event("response.output_item.added", output_index=index, item=item)
        await self.event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=call.arguments
        )
        await self.event(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=call.arguments
        )
        await self.event("response.output_item.done", output_index=index, item=function_call_item(call, "completed"))

    async def close_text(self, has_calls: bool) -> None:
        if self._text_index is None and has_calls:
            return
        await self._open_text()
        if self._pending:  # logprobs of tokens whose text never came (held back, or none)
            await self._text_delta("")
        mid, index = self._message_id, self._text_index
        part = output_text_part(self._text, self._logprobs)
        await self.event(
            "response.output_text.done",
            item_id=mid,
            output_index=index,
            content_index=0,
            text=self._text,
            logprobs=event_logprobs(self._logprobs),
        )
        await self.event("response.content_part.done", item_id=mid, output_index=index, content_index=0, part=part)
        await self.event(
            "response.output_item.done",
            output_index=index,
            item=message_item(mid, self._text, "completed", self._logprobs),
        )

    def _next_index(self) -> int:
        self._num_items += 1
        return self._num_items - 1


class _Collected:
    def __init__(self) -> None:
        self.events: list[dict] = []

    async def data(self, payload: dict) -> None:
        self.events.append(payload)


async def replay(body: dict) -> list[dict]:
    """A finished stored response as the events its stream sent, numbered from 0: created,
    in_progress, its output items (a message's text as one delta), then the final event."""
    output = body.get("output") or []
    message = next((item for item in output if item["type"] == "message"), None)
    collected = _Collected()
    events = EventStream(message["id"] if message else new_id("msg"), collected)
    started = {**body, "status": "in_progress", "output": [], "incomplete_details": None, "error": None, "usage": None}
    await events.event("response.created", response=started)
    await events.event("response.in_progress", response=started)
    if message is not None and message["content"]:
        part = message["content"][0]
        await events.delta({"delta": {"content": part["text"]}, "logprobs": {"content": part.get("logprobs") or []}})
    calls = [item for item in output if item["type"] == "function_call"]
    for call in calls:
        raw = {"id": call["call_id"], "function": {"name": call["name"], "arguments": call["arguments"]}}
        await events.delta({"delta": {"tool_calls": [raw]}})
    if output:
        await events.close_text(bool(calls))
    await events.event(FINAL_EVENT[body["status"]], response=body)
    return collected.events
