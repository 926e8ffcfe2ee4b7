"""One choice of a chat answer as the client sees it: content, logprobs and tool calls.

Fed the filtered text deltas of one generation (with the logprobs of the tokens behind them),
it produces OpenAI `delta` objects to stream and, at the end, the `message`, `logprobs` and
`finish_reason` of a unary answer. Tool-call text is parsed here (api/toolparse.py), so the
client gets `tool_calls`, never the raw markup. It never talks to the engine or the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api.reasoning import ReasoningSplitter
from api.toolparse import Parsed, ToolCallParser
from api.tools import ToolCall
from engine.tokenizer import Tokenizer
from engine.types import FinishReason, TokenLogprob, TokenText

if TYPE_CHECKING:
    from engine.upstream.counting import Counter


class Answer:
    def __init__(
        self,
        tokenizer: Tokenizer | Counter,
        parser: ToolCallParser | None,
        logprobs: int | None,
        reasoning: ReasoningSplitter | None = None,
        *,
        legacy_functions: bool = False,
    ):
        self._tokenizer = tokenizer
        self._parser = parser
        self._reasoning = reasoning  # a reasoning model: <think> text becomes reasoning_content
        self.reasoning_parts: list[str] = []
        self._wants_logprobs = logprobs is not None
        self.content_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[dict] = []
        self._pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
        # The deprecated `functions` API (api/legacy_functions.py): one call, as `function_call`.
        self._legacy_functions = legacy_functions

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        """Deltas (possibly none) for this piece of text; the first carries the pending logprobs."""
        self._pending.extend(logprobs)
        thinking, text = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        parsed = self._parser.feed(text) if self._parser is not None else Parsed(content=text)
        return self._deltas(parsed, thinking)

    def close(self) -> list[dict[str, Any]]:
        """The deltas still held back at the end of the generation."""
        thinking, text = self._reasoning.finish() if self._reasoning is not None else ("", "")
        parsed = Parsed(content=text)
        if self._parser is not None:
            fed, closed = self._parser.feed(text), self._parser.close()
            parsed = Parsed(content=fed.content + closed.content, calls=[*fed.calls, *closed.calls])
        deltas = self._deltas(parsed, thinking)
        if not deltas and self._pending and self._wants_logprobs:
            deltas = [{"delta": {"content": ""}, "logprobs": self._render()}]
        return deltas

    def _deltas(self, parsed: Parsed, thinking: str = "") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if thinking:
            self.reasoning_parts.append(thinking)
            out.append({"delta": {"reasoning_content": thinking}})
        if parsed.content:
            self.content_parts.append(parsed.content)
            out.append({"delta": {"content": parsed.content}})
        for call in parsed.calls:
            index = len(self.tool_calls)
            if self._legacy_functions:
                if index == 0:  # the old API names one call: any further one is dropped
                    self.tool_calls.append(call)
                    out.append({"delta": {"function_call": {"name": call.name, "arguments": call.arguments}}})
                continue
            self.tool_calls.append(call)
            out.append({"delta": {"tool_calls": [{"index": index, **call.as_dict()}]}})
        if out and self._pending and self._wants_logprobs:
            out[0]["logprobs"] = self._render()
        return out

    def _render(self) -> dict[str, Any]:
        logprobs, self._pending = self._pending, []
        entries = [self._entry(lp) for lp in logprobs]
        self.logprobs.extend(entries)
        return {"content": entries, "refusal": None}

    def _entry(self, lp: TokenLogprob) -> dict[str, Any]:
        return {
            **self._named(lp.token, lp.logprob),
            "top_logprobs": [self._named(token, value) for token, value in lp.top_logprobs],
        }

    def _named(self, token: int | TokenText, logprob: float) -> dict[str, Any]:
        """OpenAI's `token`, `logprob`, `bytes` for a token id (decoded here) or a text token (as sent)."""
        if isinstance(token, TokenText):
            text, utf8 = token.text, token.utf8
        else:
            text, utf8 = self._tokenizer.decode([token], skip_special_tokens=False), None
        return {
            "token": text,
            "logprob": max(logprob, -9999.0),  # OpenAI's floor; JSON has no -inf
            "bytes": list(text.encode("utf-8") if utf8 is None else utf8),
        }

    def message(self) -> dict[str, Any]:
        content = "".join(self.content_parts)
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if self._reasoning is not None:  # vLLM's and llama.cpp's field for the thinking
            msg["reasoning_content"] = "".join(self.reasoning_parts)
        if self.tool_calls:
            msg["content"] = content or None
            if self._legacy_functions:
                call = self.tool_calls[0]
                msg["function_call"] = {"name": call.name, "arguments": call.arguments}
            else:
                msg["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        return msg

    def logprobs_obj(self) -> dict[str, Any] | None:
        return {"content": self.logprobs, "refusal": None} if self._wants_logprobs else None

    def finish_reason(self, finish: FinishReason) -> str:
        if self.tool_calls and finish is FinishReason.STOP:
            return "function_call" if self._legacy_functions else "tool_calls"
        return finish.value
