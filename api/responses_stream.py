"""The Responses API's stream: OpenAI's event types, numbered, for one message item and its
function calls (`response.output_item.added`, `response.output_text.delta`, ...). Rendering
only: api/responses.py decides when a response starts, streams and ends.
"""

from __future__ import annotations

import itertools

from api.responses_record import ResponseContext
from api.responses_wire import event_logprobs, function_call_item, message_item, output_text_part
from api.sse import SSEWriter
from api.tools import ToolCall


class EventStream:
    """OpenAI's Responses stream events, numbered, for one message item and its function calls."""

    def __init__(self, ctx: ResponseContext, writer: SSEWriter):
        self._ctx, self._writer = ctx, writer
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
            item_id=self._ctx.message_id,
            output_index=self._text_index,
            content_index=0,
            delta=text,
            logprobs=event_logprobs(entries),
        )

    async def _open_text(self) -> None:
        if self._text_index is not None:
            return
        self._text_index = self._next_index()
        item = message_item(self._ctx.message_id, "", "in_progress")
        await self.event("response.output_item.added", output_index=self._text_index, item=item)
        await self.event(
            "response.content_part.added",
            item_id=self._ctx.message_id,
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
        mid, index = self._ctx.message_id, self._text_index
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
