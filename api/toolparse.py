"""Streaming parser from a model's generated text to plain content and OpenAI tool calls.

Fed the same text deltas the client would see (after stop strings and the safety filter), it
passes content through at once, holds back only what could still be the start of a tool call,
and yields each call as soon as it is complete. Text that looks like a call but does not parse
as one is given back as content. It knows the formats of api/tools.py and nothing else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from api.tools import ToolCall, ToolFormat, new_call_id

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_OPEN = "[TOOL_CALLS]"
_LLAMA_TAG = "<|python_tag|>"


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """feed(text) -> Parsed for this delta; close() -> Parsed for whatever was held back."""

    def __init__(
        self, fmt: ToolFormat, tool_names: frozenset[str], *, forced: bool = False, forced_name: str | None = None
    ):
        self._fmt = fmt
        self._names = tool_names
        self._forced = forced  # a grammar made the whole answer calls: nothing of it is content
        self._forced_name = forced_name  # the one tool a forced call can name (a named choice, or a single tool)
        self._buffer = ""  # held back: a possible marker start, or an unfinished call
        self._in_call = False
        self._started = False  # llama3: whether the first non-space character was seen
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        if self._fmt is ToolFormat.HERMES:
            return self._feed_hermes()
        if self._fmt is ToolFormat.MISTRAL:
            return self._feed_prefixed(_MISTRAL_OPEN)
        return self._feed_llama()

    def close(self) -> Parsed:
        closed = self._close()
        if self._forced and closed.content.strip():  # a call the length limit cut: never markup as content
            call = self._partial_call(closed.content)
            return Parsed(calls=[*closed.calls, *([call] if call is not None else [])])
        return closed

    def _close(self) -> Parsed:
        buffer, self._buffer = self._buffer, ""
        if self._fmt is ToolFormat.HERMES:
            return Parsed(content=buffer)  # an unterminated call stays text
        if self._in_call:
            body = buffer.removeprefix(_MISTRAL_OPEN).removeprefix(_LLAMA_TAG)
            calls = self._parse_many(body)
            return Parsed(calls=calls) if calls else Parsed(content=buffer)
        return Parsed(content=buffer)

    def _feed_hermes(self) -> Parsed:
        out = Parsed()
        while True:
            if not self._in_call:
                start = self._buffer.find(_HERMES_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, _HERMES_OPEN)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(_HERMES_OPEN) :]
                self._in_call = True
            end = self._buffer.find(_HERMES_CLOSE)
            if end < 0:
                return out
            body, self._buffer = self._buffer[:end], self._buffer[end + len(_HERMES_CLOSE) :]
            self._in_call = False
            call = self._parse_one(body)
            if call is None:
                out.content += _HERMES_OPEN + body + _HERMES_CLOSE
            else:
                out.calls.append(call)
            if out.calls and not out.content.strip():
                out.content = ""

    def _feed_prefixed(self, marker: str) -> Parsed:
        """Mistral: a call list starts with the marker and runs to the end of the answer."""
        if self._in_call:
            return Parsed()
        start = self._buffer.find(marker)
        if start >= 0:
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            self._in_call = True
            return Parsed(content=content)
        keep = _partial_suffix(self._buffer, marker)
        content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        return Parsed(content=content)

    def _feed_llama(self) -> Parsed:
        """Llama 3: an answer whose first character is `{` (or the python tag) is a call."""
        if self._in_call:
            return Parsed()
        if not self._started:
            head = self._buffer.lstrip()
            if not head or _LLAMA_TAG.startswith(head):
                return Parsed()
            self._started = True
            if head.startswith(("{", _LLAMA_TAG)):
                self._in_call = True
                return Parsed()
        content, self._buffer = self._buffer, ""
        return Parsed(content=content)

    def _partial_call(self, text: str) -> ToolCall | None:
        """A cut call as OpenAI returns one (finish_reason length): its name and the arguments'
        text as far as it got (a complete value without the call's closing markup after it).
        Before the name is complete: the one tool it can be, else None."""
        found = _NAME_FIELD.search(text)
        name = found.group(1) if found is not None else self._forced_name
        if name is None or name not in self._names:
            return None
        args = _ARGS_FIELD.search(text, found.end()) if found is not None else None
        self.num_calls += 1
        return ToolCall(new_call_id(), name, _arguments_so_far(text[args.end() :]) if args else "")

    def _parse_many(self, body: str) -> list[ToolCall]:
        body = body.strip()
        try:
            value = json.loads(body)
        except ValueError:
            parts = [self._parse_one(p) for p in body.split(";")]  # llama3: calls joined by ';'
            return _all_or_none(parts)
        items = value if isinstance(value, list) else [value]
        return _all_or_none([self._call_of(item) for item in items])

    def _parse_one(self, body: str) -> ToolCall | None:
        try:
            return self._call_of(json.loads(body))
        except ValueError:
            return None

    def _call_of(self, item: object) -> ToolCall | None:
        if not isinstance(item, dict) or item.get("name") not in self._names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        self.num_calls += 1
        return ToolCall(new_call_id(), item["name"], json.dumps(args, ensure_ascii=False))


def _arguments_so_far(text: str) -> str:
    """The arguments' JSON as far as it got: a complete value stops where it ends."""
    text = text.lstrip()
    try:
        _value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return text.rstrip()
    return text[:end]


_NAME_FIELD = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')
_ARGS_FIELD = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _all_or_none(calls: list[ToolCall | None]) -> list[ToolCall]:
    """Every call, or none when one of them did not parse."""
    parsed = [c for c in calls if c is not None]
    return parsed if len(parsed) == len(calls) else []
