"""Anthropic's Messages API request: a POST /v1/messages body validated into the `ChatRequest`
that chat completions serve, each error naming Anthropic's field.

`system`, `messages` of text, image, `document`, `tool_use` and `tool_result` blocks (assistant
`tool_use` blocks become earlier tool calls, `tool_result` blocks tool messages, a `document`'s
base64, text or content source a file part sent inline, its `file` source an uploaded file's
`file_id`; their errors name the block's `source`), `tools` with
`input_schema` and `tool_choice` become their chat-completion fields. A reasoning model (one
whose template knows <think>) thinks only when the request's `thinking` is enabled, as
Anthropic's models do: its template gets `enable_thinking`, and `budget_tokens` caps the thinking
where the model allows it (api/job.thinking_budget). A final assistant message is a prefill.
`max_tokens` is a cap, not a reservation: the answer gets at most what the tier's `max_tokens`
and the context leave (Anthropic clients such as Claude Code ask for far more than a local
model's context). Fields this server does not use (`metadata`, `service_tier`, `cache_control` on
blocks, ...) are accepted and ignored, as Anthropic's newer fields appear often. Nothing here
serves or renders an answer (api/messages.py).
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import orjson

from api import protocol
from api.errors import bad_request
from api.fields import MAX_STOP_STRINGS, kind_of
from api.parts import is_data_url, named

MAX_STOP_SEQUENCES = MAX_STOP_STRINGS


# Fields that would change what the answer does, refused rather than silently dropped.
_UNSUPPORTED = {
    "mcp_servers": "it does not connect to MCP servers; pass their tools in 'tools' and run them yourself.",
    "container": "it runs no code execution containers.",
}


def parse_messages_request(raw: Any, *, max_messages: int, max_prompt_chars: int, count_only: bool = False):
    """Validate an Anthropic Messages body into a ChatRequest; ApiError(400) naming the field."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise bad_request("'model' is required: the name of a model this server serves.", param="model")
    max_tokens = raw.get("max_tokens")
    if not count_only and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise bad_request(f"'max_tokens' is required and must be at least 1, got {max_tokens!r}.", param="max_tokens")
    messages, sources = _messages(raw)
    chat: dict[str, Any] = {"model": raw["model"], "messages": messages, "stream": raw.get("stream", False)}
    if not count_only:
        chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k"):  # the same names and meaning as chat completions'
        if raw.get(key) is not None:
            chat[key] = raw[key]
    temperature = raw.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 1:
        raise bad_request(
            f"'temperature' must be between 0 and 1 (Anthropic's range), got {temperature}.", param="temperature"
        )
    for key in _UNSUPPORTED:
        if raw.get(key):
            raise bad_request(f"'{key}' is not supported by this server: {_UNSUPPORTED[key]}", param=key)
    stops = raw.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("'stop_sequences' must be an array of strings.", param="stop_sequences")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(
                f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings on this server, got {len(stops)}.",
                param="stop_sequences",
            )
        chat["stop"] = stops
    if raw.get("tools"):
        chat["tools"] = _tools(raw["tools"])
    choice = raw.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    # Anthropic's models think only when asked: a reasoning model's template is told the same
    # (Qwen3's enable_thinking; templates without the variable ignore it).
    chat["chat_template_kwargs"] = {"enable_thinking": _thinking_enabled(raw.get("thinking"))}
    if chat["stream"] is True:
        chat["stream_options"] = {"include_usage": True}
    parsed = protocol.parse_chat_request(chat, max_messages=max_messages + 1, max_prompt_chars=max_prompt_chars)
    parsed = replace(parsed, messages=_named_sources(parsed.messages, sources))
    last = parsed.messages[-1] if parsed.messages else None
    return replace(
        parsed,
        # A final assistant message is a prefill: Anthropic's models continue it, and the answer
        # holds only the continuation (apps prefill "{" to get JSON).
        continue_final_message=last is not None and last.role == "assistant" and not last.tool_calls,
        max_tokens_is_cap=True,
        thinking_token_budget=_thinking_budget(raw.get("thinking")),
        thinking_budget_strict=False,
    )


def _thinking_enabled(value: Any) -> bool:
    if value is None:
        return False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("'thinking' must be {'type': 'enabled' | 'disabled' | 'adaptive', ...}.", param="thinking")
    return kind != "disabled"


def _thinking_budget(value: Any) -> int | None:
    """`thinking.budget_tokens` of enabled thinking: the most tokens the model may think (the
    server closes its thinking there, as chat completions' thinking_token_budget)."""
    if not isinstance(value, dict) or value.get("type") != "enabled" or value.get("budget_tokens") is None:
        return None
    budget = value["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request(
            f"'thinking.budget_tokens' must be a non-negative integer, got {budget!r}.", param="thinking.budget_tokens"
        )
    return budget


# (chat message index, part index) -> the document block's source there, as the request spelled it
Sources = dict[tuple[int, int], str]
_SOURCE = "_source"  # marks a document's chat part until _messages records where it is


def _messages(raw: dict[str, Any]) -> tuple[list[dict[str, Any]], Sources]:
    out: list[dict[str, Any]] = []
    sources: Sources = {}
    system = raw.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of messages.", param="messages")
    made: set[str] = set()  # tool_use ids of the assistant's messages so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"'{where}.role' must be user or assistant.", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            converted = _blocks(message["role"], content, f"{where}.content")
            _check_results(converted, content, made, f"{where}.content")
            for m, chat_message in enumerate(converted, start=len(out)):
                parts = chat_message["content"] if isinstance(chat_message["content"], list) else []
                sources.update({(m, j): p.pop(_SOURCE) for j, p in enumerate(parts) if _SOURCE in p})
            out.extend(converted)
        else:
            raise bad_request(f"'{where}.content' must be a string or an array of content blocks.", param=where)
    return out, sources


def _named_sources(messages: tuple[protocol.ChatMessage, ...], sources: Sources) -> tuple[protocol.ChatMessage, ...]:
    """Each document's file part names its errors (an unreadable or too large file, an unknown
    file_id) as `messages[i].content[j].source`, not the chat message it became."""
    out = list(messages)
    for (m, j), where in sources.items():
        parts = list(out[m].parts)
        parts[j] = named(parts[j], where)
        out[m] = replace(out[m], parts=tuple(parts))
    return tuple(out)


def _check_results(converted: list[dict[str, Any]], blocks: list, made: set[str], where: str) -> None:
    """Each tool_result answers a tool_use an earlier assistant message made (Anthropic's 400),
    named as the request spelled it (chat completions would name its own converted messages)."""
    for message in converted:
        made.update(call["id"] for call in message.get("tool_calls", ()))
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("tool_use_id") not in made:
            raise bad_request(
                f"'{where}[{j}].tool_use_id' is {block.get('tool_use_id')!r}: no earlier 'tool_use' block has that id.",
                param=f"{where}[{j}].tool_use_id",
            )


def _blocks(role: str, blocks: list, where: str) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat messages: tool results first (as tool messages),
    then the message with its text and image parts (and, from the assistant, its tool calls)."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "document" and role == "user":
            parts.extend(_document(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"'{at}' needs an 'id' and a 'name'.", param=at)
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"'{at}.tool_use_id' is required.", param=f"{at}.tool_use_id")
            text = _text_of(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not sent back to the model
        else:
            raise bad_request(f"'{at}': a {kind!r} block is not supported in a {role} message here.", param=at)
    out = list(results)
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    elif parts or not results:
        only_text = all(p["type"] == "text" for p in parts)
        content: Any = "\n\n".join(p["text"] for p in parts) if only_text else _separated(parts)
        out.append({"role": "user", "content": content})
    return out


def _separated(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text blocks of a user message with files or images joined with a blank line, as a
    message of text blocks only is (chat's text parts run together)."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if out and part["type"] == "text" and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": f"{out[-1]['text']}\n\n{part['text']}"}
        else:
            out.append(part)
    return out


def _document(block: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A document block as a chat file part (inline, or an uploaded file's id), then its
    `context` as text. Citations are not made here: asking for them is refused."""
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled"):
        raise bad_request(
            f"'{where}.citations' cannot be enabled: this server does not cite documents; send the block without"
            " it, or with {'enabled': false}.",
            param=f"{where}.citations",
            code="unsupported_value",
        )
    title, context = block.get("title"), block.get("context")
    for name, value in (("title", title), ("context", context)):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"'{where}.{name}' must be a string.", param=f"{where}.{name}")
    part = {
        "type": "file",
        "file": _document_file(block.get("source"), f"{where}.source", title),
        _SOURCE: f"{where}.source",
    }
    return [part, {"type": "text", "text": f"Document context: {context}"}] if context else [part]


def _document_file(source: Any, where: str, title: str | None) -> dict[str, Any]:
    """A document's source as chat's `file` object: base64 data as a data: URL (its type sniffed
    as an upload's), text as text/plain, an uploaded file's id. URLs are not fetched."""
    kind = source.get("type") if isinstance(source, dict) else None
    name = {"filename": title} if title else {}
    if kind == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else ""
        if is_data_url(f"data:{media};base64,"):  # the data is checked when it is decoded
            return {**name, "file_data": f"data:{media};base64,{source['data']}"}
    if kind in ("text", "content"):
        text = source.get("data") if kind == "text" else _text_of(source.get("content"), f"{where}.content")
        if isinstance(text, str):
            encoded = base64.b64encode(text.encode()).decode()
            return {**name, "file_data": f"data:text/plain;base64,{encoded}"}
    if kind == "file" and isinstance(source.get("file_id"), str) and source["file_id"]:
        return {"file_id": source["file_id"]}
    if kind == "url":
        raise bad_request(
            f"'{where}': this server does not fetch documents from URLs; send the document as a base64 or text"
            " source, or upload it with POST /v1/files and send a file source with its file_id.",
            param=where,
            code="file_url_not_allowed",
        )
    raise bad_request(
        f"'{where}' must be a base64 source (media_type, data), a text source (data), a content source or a"
        " file source (file_id); a base64 source's media_type is a media type such as application/pdf.",
        param=where,
    )


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return f"data:{media};base64,{data}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"'{where}.source' must be a base64 image (type, media_type, data) or a url.", param=where)


def _text_of(value: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts and tool results)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for block in value:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise bad_request(f"'{where}' may hold only text blocks here.", param=where)
            texts.append(block["text"])
        return "\n\n".join(texts)
    raise bad_request(f"'{where}' must be a string or an array of text blocks.", param=where)


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of tools.", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"'tools[{i}]' must be a client tool (name, input_schema); {kind!r} tools are not supported here.",
                param=f"tools[{i}]",
            )
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    out: dict[str, Any] = {}
    if kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool" and isinstance(value.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}.")
    if value.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out
