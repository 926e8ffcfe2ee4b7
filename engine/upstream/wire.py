"""The OpenAI wire format as an upstream speaks it: the request body we send, the stream
chunks and error bodies we read. Pure functions; no I/O.

Only what the front door validated is sent. Sampling fields beyond OpenAI's (top_k,
min_tokens, ignore_eos: vLLM, SGLang and llama.cpp's server take them) are sent only when
the request asks for them, so servers that know only OpenAI's fields are not disturbed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from engine.types import FinishReason, GenerationRequest, RequestRejected, TokenLogprob, TokenText

# Upstream finish reasons we relay; tool calls end a turn like a stop (tool-call deltas are
# relayed once the seam carries them).
_FINISH = {
    "stop": FinishReason.STOP,
    "eos": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True)
class Usage:
    """As the upstream reported it: checked against what was sent and relayed before billing
    (engine/upstream/usage.py)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    problem: str | None = None  # a count that is not an integer: the counts are then 0 and unusable


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one streamed tool call: the name comes once, the arguments in fragments."""

    index: int
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One `data:` payload of an upstream stream."""

    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""  # a reasoning parser's `reasoning_content` (vLLM, SGLang, llama.cpp)
    logprobs: tuple[TokenLogprob, ...] = ()  # choice 0's `logprobs.content`, text tokens as sent
    stop_str: str | None = None  # vLLM's `stop_reason` when a stop string ended the answer


class ErrorKind(enum.Enum):
    CLIENT = "client"  # the request's own fault (400, 413, 422): passed on as a 400
    BUSY = "busy"  # 429: try another replica, else 503 with Retry-After
    CONFIG = "config"  # 401, 403, 404: our configuration is wrong (key, model name)
    SERVER = "server"  # 5xx or an error event: counts against the replica's breaker


@dataclass(frozen=True, slots=True)
class UpstreamError:
    kind: ErrorKind
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    retry_after_s: float | None = None

    def rejected(self) -> RequestRejected:
        return RequestRejected(self.message, param=self.param, code=self.code)


def request_path(request: GenerationRequest) -> str:
    """Where the request goes on the upstream: its chat completions, or its legacy completions
    for a raw prompt."""
    return "/completions" if request.chat is not None and request.chat.prompt is not None else "/chat/completions"


def request_body(request: GenerationRequest, upstream_model: str) -> dict[str, Any]:
    """The streaming chat (or legacy completion) request for the upstream; usage is always asked for."""
    if request.chat is None:
        raise ValueError("an upstream request needs the chat messages (GenerationRequest.chat)")
    s = request.sampling
    prompt = request.chat.prompt
    body: dict[str, Any] = {
        **request.chat.options,
        "model": upstream_model,
        **({"prompt": prompt} if prompt is not None else {"messages": [dict(m) for m in request.chat.messages]}),
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    optional = {
        "seed": s.seed,
        "stop": list(s.stop) or None,
        "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "top_k": s.top_k,
        "min_tokens": s.min_tokens or None,
        "ignore_eos": s.ignore_eos or None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,  # ids of the model's tokenizer: the upstream's
        "logprobs": True if s.logprobs is not None else None,
        "top_logprobs": s.logprobs,
    }
    if prompt is not None and s.logprobs is not None:  # the legacy shape: how many alternatives
        optional.update(logprobs=s.logprobs, top_logprobs=None)
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def unsupported_reason(request: GenerationRequest) -> tuple[str, str] | None:
    """(message, param) when the request asks for what this backend cannot relay yet.

    response_format, tools, tool_choice and logprobs arrive in `chat.options` in wire form and
    are answered upstream; the grammar the front built for them (`sampling.structured`) is not sent.
    """
    options = request.chat.options if request.chat is not None else {}
    if getattr(request.sampling, "prompt_logprobs", None) is not None:
        return "The prompt's log-probabilities (echo with logprobs) come from models served here only.", "echo"
    structured = getattr(request.sampling, "structured", None)
    if structured is not None and "response_format" not in options and "tool_choice" not in options:
        return "This kind of constrained output is not relayed to upstream servers.", "response_format"
    return None


def parse_chunk(payload: dict[str, Any]) -> Chunk | UpstreamError:
    """A decoded `data:` payload: text, logprobs and finish of choice 0, usage, or an error event."""
    if "error" in payload or payload.get("object") == "error":
        return _error_from(500, payload, None)
    text, finish, reasoning, stop_str = "", None, "", None
    calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    choices = payload.get("choices") or []
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue  # n > 1 is fanned out by the API: one upstream request per choice
        delta = choice.get("delta") or {}
        if isinstance(choice.get("text"), str):  # a legacy completion's chunk
            text = choice["text"]
        elif isinstance(delta, dict):
            content = delta.get("content")
            text = content if isinstance(content, str) else ""
            calls = _tool_call_deltas(delta.get("tool_calls"))
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            reasoning = thought if isinstance(thought, str) else ""
        logprobs = parse_logprobs(choice.get("logprobs"))
        reason = choice.get("finish_reason")
        finish = _FINISH.get(reason, FinishReason.STOP) if reason else None
        stop_reason = choice.get("stop_reason")
        stop_str = stop_reason if isinstance(stop_reason, str) and finish is FinishReason.STOP else None
    return Chunk(text, finish, parse_usage(payload.get("usage")), calls, reasoning, logprobs, stop_str)


def parse_logprobs(raw: Any) -> tuple[TokenLogprob, ...]:
    """A choice's `{"content": [{token, logprob, bytes, top_logprobs}, ...]}`, or a legacy
    completion's `{"tokens", "token_logprobs", "top_logprobs"}`; malformed entries are skipped."""
    if isinstance(raw, dict) and isinstance(raw.get("tokens"), list):
        return _legacy_logprobs(raw)
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list):
        return ()
    out = []
    for entry in content:
        chosen = _text_token(entry)
        if chosen is None:
            continue
        top = entry.get("top_logprobs")
        alternatives = (_text_token(t) for t in (top if isinstance(top, list) else ()))
        out.append(TokenLogprob(None, chosen[1], tuple(a for a in alternatives if a is not None), chosen[0]))
    return tuple(out)


def _legacy_logprobs(raw: dict[str, Any]) -> tuple[TokenLogprob, ...]:
    tokens, values, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(values, list) or not isinstance(tokens, list) or len(values) != len(tokens):
        return ()
    tops = tops if isinstance(tops, list) and len(tops) == len(tokens) else [None] * len(tokens)
    out = []
    for token, value, top in zip(tokens, values, tops, strict=True):
        if not isinstance(token, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        alternatives = (
            tuple(
                (TokenText(t), float(v))
                for t, v in top.items()
                if isinstance(t, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            )
            if isinstance(top, dict)
            else ()
        )
        out.append(TokenLogprob(None, float(value), alternatives, TokenText(token)))
    return tuple(out)


def _text_token(entry: Any) -> tuple[TokenText, float] | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return None
    logprob = entry.get("logprob")
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
        return None
    raw = entry.get("bytes")
    utf8 = tuple(raw) if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw) else None
    return TokenText(entry["token"], utf8), float(logprob)


def _tool_call_deltas(raw: Any) -> tuple[ToolCallDelta, ...]:
    if not isinstance(raw, list):
        return ()
    out = []
    for i, item in enumerate(raw):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            continue
        index = item.get("index", i)
        out.append(
            ToolCallDelta(
                index if isinstance(index, int) else i,
                str(function.get("name") or ""),
                str(function.get("arguments") or ""),
            )
        )
    return tuple(out)


def tool_calls_text(calls: dict[int, list[str]], *, is_cut: bool = False) -> str:
    """Streamed tool calls (index -> [name, arguments]) as Hermes/Qwen `<tool_call>` text: the
    form the front door's tool-call parser reads for upstream models (api/toolparse.py), so the
    client gets `tool_calls` exactly as from a model served here.

    `is_cut`: the answer ended at max_tokens. The last call, unless its arguments are complete,
    is then written as a model served here would have left it: open, its arguments as far as they
    got, so the parser makes of it what it makes of a native cut call (a forced call's partial
    arguments, else text)."""
    parts = []
    items = sorted(calls.items())
    for i, (_, (name, arguments)) in enumerate(items):
        try:
            args = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            args = None
        if is_cut and i == len(items) - 1 and (args is None or not arguments):
            head = orjson.dumps({"name": name}).decode()[:-1]
            parts.append(f'<tool_call>\n{head},"arguments": {arguments}')
            break
        if args is None:
            args = arguments  # passed on as the upstream wrote it
        parts.append("<tool_call>\n" + orjson.dumps({"name": name, "arguments": args}).decode() + "\n</tool_call>")
    return "\n".join(parts)


def parse_usage(raw: Any) -> Usage | None:
    """`usage` as reported; a count that is not an integer makes it unusable (`problem`)."""
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    values = {
        "prompt_tokens": raw.get("prompt_tokens"),
        "completion_tokens": raw.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
    }
    for key, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return Usage(0, 0, 0, problem=f"{key} is not an integer: {str(value)[:40]!r}")
    prompt, completion, cached = (value or 0 for value in values.values())
    return Usage(prompt, completion, cached)


def classify_http_error(status: int, body: bytes, retry_after: str | None) -> UpstreamError:
    """An upstream's non-200 answer, with the message of its error envelope."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = {"message": body[:300].decode(errors="replace")}
    return _error_from(status, payload if isinstance(payload, dict) else {}, retry_after)


def _error_from(status: int, payload: dict[str, Any], retry_after: str | None) -> UpstreamError:
    error = payload.get("error", payload)
    if not isinstance(error, dict):  # e.g. {"error": "some text"}
        error = {"message": str(error)}
    if isinstance(error.get("code"), int) and status == 500:  # vLLM's {"object": "error", "code": 400}
        status = error["code"]
    message = str(error.get("message") or f"upstream answered HTTP {status}")
    code = error.get("code") if isinstance(error.get("code"), str) else None
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if status in (400, 413, 422):
        kind = ErrorKind.CLIENT
    elif status == 429:
        kind = ErrorKind.BUSY
    elif status in (401, 403, 404):
        kind = ErrorKind.CONFIG
    else:
        kind = ErrorKind.SERVER
    return UpstreamError(kind, status, message, code, param, _seconds(retry_after))


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


_BEARER = re.compile(r"(?i)\bbearer\s+[^\s'\",;]+")
_SECRET_KEY = re.compile(r"\bsk-[A-Za-z0-9_\-]{4,}")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """An upstream's message with our API key (and anything that looks like a key) removed: some
    servers echo the key they were sent in their 401 message."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    text = _BEARER.sub("Bearer [redacted]", text)
    return _SECRET_KEY.sub("sk-[redacted]", text)


def redacted(error: UpstreamError, secrets: Iterable[str] = ()) -> UpstreamError:
    return replace(error, message=redact(error.message, secrets))
