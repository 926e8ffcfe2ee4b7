"""The Responses API's wire format: a POST body becomes a chat request; answers become responses.

Owns validation of `POST /v1/responses` (each error names the Responses field: `input`,
`max_output_tokens`, `text.format`, ...), its translation into the `ChatRequest` that the one
request path serves, and the response object and stream events in OpenAI's shapes. It never
generates, bills or stores anything.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from api import protocol
from api.answer import Answer
from api.errors import ApiError, bad_request
from api.fields import check_metadata, check_service_tier, parse_response_format, with_reasoning_effort
from api.parts import InlineFilePart, named
from api.tools import ToolCall

_KNOWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "text",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "parallel_tool_calls",
    "user",
    "seed",
    "background",
    "include",
    "top_logprobs",
    "repetition_penalty",  # vLLM's extension, as on chat completions
    "reasoning",
    "thinking_token_budget",  # the extension chat completions take
    "truncation",  # 'auto': attached files that do not fit the context are cut (as on chat completions)
    # Accepted, checked and without effect here (OpenAI's newer fields; Codex CLI sends the first):
    "prompt_cache_key",  # the prefix cache finds shared prefixes without one
    "safety_identifier",
    "service_tier",  # as on chat completions: one tier of service here
    "stream_options",  # only include_obfuscation, and there is no obfuscation to leave out
}
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Accepted for clients that always ask for it (Codex CLI with store: false); no encrypted reasoning
# is produced here, so nothing is added.
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
_INCLUDABLE = (INCLUDE_LOGPROBS, INCLUDE_ENCRYPTED_REASONING)  # anything else is a 400 naming it
_IGNORED_STRINGS = ("prompt_cache_key", "safety_identifier", "service_tier")
_ROLES = ("user", "assistant", "system", "developer")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    chat: protocol.ChatRequest  # what the request path serves: the input only (no instructions, no history yet)
    store: bool
    previous_response_id: str | None
    instructions: str | None  # this request's only: placed first, never stored with the turn
    input_items: tuple[dict, ...]  # as /input_items lists them
    echo: dict[str, Any]  # request fields the response object repeats
    background: bool = False  # answer at once (queued); the result is stored when done


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def parse_responses_request(raw: Any, *, max_messages: int, max_prompt_chars: int) -> ResponsesRequest:
    if not isinstance(raw, dict):
        raise bad_request("The request body must be a JSON object.", param=None)
    for key in raw:
        if key not in _KNOWN:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    check_metadata(raw.get("metadata"))
    _check_ignored(raw)
    items = _input_items(raw.get("input"))
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", param="instructions")
    if instructions and len(instructions) > max_prompt_chars:  # the prompt's length names the input otherwise
        raise bad_request(
            f"'instructions' hold {len(instructions)} characters; the limit is {max_prompt_chars}.",
            param="instructions",
        )
    store = raw.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("'store' must be a boolean.", param="store")
    background = _background(raw, store)
    previous = raw.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("'previous_response_id' must be a response id.", param="previous_response_id")
    max_output = raw.get("max_output_tokens")
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1):
        raise bad_request(
            f"'max_output_tokens' must be a positive integer, got {max_output!r}.", param="max_output_tokens"
        )
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
        _chat_message(i) for i in items
    ]
    chat_body = {
        "messages": messages,
        "max_tokens": max_output,
        "stream": raw.get("stream"),
        "model": raw.get("model"),
        "temperature": raw.get("temperature"),
        "top_p": raw.get("top_p"),
        "repetition_penalty": raw.get("repetition_penalty"),
        "thinking_token_budget": raw.get("thinking_token_budget"),
        "user": raw.get("user"),
        "seed": raw.get("seed"),
        "truncation": raw.get("truncation"),
        "parallel_tool_calls": raw.get("parallel_tool_calls"),
        "tools": _chat_tools(raw.get("tools")),
        "tool_choice": _chat_tool_choice(raw.get("tool_choice")),
        **_logprobs(raw),
    }
    try:
        chat = protocol.parse_chat_request(
            {k: v for k, v in chat_body.items() if v is not None},
            max_messages=max_messages,
            max_prompt_chars=max_prompt_chars,
        )
    except ApiError as exc:  # name the field as this request spelled it
        raise input_error(exc, num_instructions=1 if instructions else 0) from None
    chat = replace(
        chat,
        messages=_named_parts(chat.messages[1:] if instructions else chat.messages),  # checked with the input
        response_format=_text_format(raw.get("text")),
        chat_template_kwargs=with_reasoning_effort(None, _effort(raw.get("reasoning")), "reasoning.effort"),
    )
    echo = {
        k: raw.get(k)
        for k in ("instructions", "max_output_tokens", "metadata", "tools", "tool_choice", "text", "top_logprobs")
    }
    return ResponsesRequest(chat, store, previous, instructions, items, echo, background)


_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\](.*)$")
_TOOL_PARAM = re.compile(r"^(tools\[\d+\])\.function\.(.*)$")


def input_error(exc: ApiError, *, num_instructions: int = 0, num_history: int = 0) -> ApiError:
    """A chat-completions error about `messages` or `messages[i]...` renamed to this request's
    field: the prompt holds `instructions` first, then the history of `previous_response_id`, then
    one message per input item (`input[j]...`; file parts are flat here)."""
    if exc.param == "messages":  # the whole prompt, e.g. longer than the context
        return replace(exc, param="input", message=exc.message.replace("the messages", "the input"))
    tool = _TOOL_PARAM.match(exc.param or "")
    if tool is not None:  # Responses tools are flat: tools[i].parameters, not tools[i].function.parameters
        param = f"{tool.group(1)}.{tool.group(2)}"
        return replace(exc, param=param, message=exc.message.replace(exc.param or "", param))
    if exc.param == "tool_choice":
        return replace(exc, message=exc.message.replace('"function": {"name": ...}', '"name": ...'))
    match = _MESSAGE_PARAM.match(exc.param or "")
    if match is None:
        return exc
    index = int(match.group(1))
    if index < num_instructions:
        param = "instructions"
    elif index < num_instructions + num_history:
        param = "previous_response_id"
    else:
        param = f"input[{index - num_instructions - num_history}]{match.group(2).replace('.file.', '.')}"
    return replace(exc, param=param, message=exc.message.replace(exc.param or "", param))


def _named_parts(messages: tuple[protocol.ChatMessage, ...]) -> tuple[protocol.ChatMessage, ...]:
    """The input's file and image parts name their errors as the input spells them
    (`input[i].content[j]`, `...file_data`): the request path meets them after the instructions and
    the history of previous_response_id, where their chat index is no longer the input's."""
    out = []
    for i, message in enumerate(messages):
        parts = tuple(
            named(p, f"input[{i}].content[{j}]{'.file_data' if isinstance(p, InlineFilePart) else ''}")
            for j, p in enumerate(message.parts)
        )
        out.append(replace(message, parts=parts))
    return tuple(out)


def _check_ignored(raw: dict) -> None:
    """Fields taken for compatibility that change nothing here; their types are still checked."""
    for name in _IGNORED_STRINGS:
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise bad_request(f"'{name}' must be a string.", param=name)
    check_service_tier(raw.get("service_tier"))
    options = raw.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise bad_request(
            "'stream_options' must be an object, e.g. {\"include_obfuscation\": false}.", param="stream_options"
        )
    for key, value in options.items():
        if key != "include_obfuscation":
            raise bad_request(
                f"Unrecognized stream option: {key}", param=f"stream_options.{key}", code="unknown_parameter"
            )
        if not isinstance(value, bool):
            raise bad_request(
                "'stream_options.include_obfuscation' must be a boolean.", param="stream_options.include_obfuscation"
            )


def _effort(value: Any) -> Any:
    """`reasoning: {"effort": ..., "summary": ...}`: the effort (the summary is not produced here)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request('\'reasoning\' must be an object, e.g. {"effort": "low"}.', param="reasoning")
    return value.get("effort")


def _background(raw: dict, store: bool) -> bool:
    background = raw.get("background", False)
    if not isinstance(background, bool):
        raise bad_request("'background' must be a boolean.", param="background")
    if background and not store:  # as OpenAI: the result is only reachable through the store
        raise bad_request("'background' requires 'store' to be true.", param="background")
    if background and raw.get("stream"):
        raise bad_request(
            "'background' with 'stream' is not supported here; poll GET /v1/responses/{id}.",
            param="stream",
            code="unsupported_value",
        )
    return background


def _logprobs(raw: dict) -> dict:
    """`include: ["message.output_text.logprobs"]` and `top_logprobs` as chat completions' fields."""
    include = raw.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad_request("'include' must be an array of strings.", param="include")
    for value in include:
        if value not in _INCLUDABLE:
            raise bad_request(
                f"'include' value {value!r} is not supported here; supported: {', '.join(_INCLUDABLE)}.",
                param="include",
                code="unsupported_value",
            )
    top = raw.get("top_logprobs")
    is_int = isinstance(top, int) and not isinstance(top, bool)
    if top is not None and (not is_int or not 0 <= top <= protocol.MAX_TOP_LOGPROBS):
        raise bad_request(
            f"'top_logprobs' must be an integer between 0 and {protocol.MAX_TOP_LOGPROBS}, got {top!r}.",
            param="top_logprobs",
        )
    if INCLUDE_LOGPROBS not in include:
        if top:
            raise bad_request(f"'top_logprobs' needs 'include' to contain {INCLUDE_LOGPROBS!r}.", param="top_logprobs")
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


def _input_items(value: Any) -> tuple[dict, ...]:
    if isinstance(value, str):
        return ({"type": "message", "role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of message items.", param="input")
    return tuple(_item(v, i) for i, v in enumerate(value))


def _chat_message(item: dict) -> dict:
    if item["type"] == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if item["type"] == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    return {"role": item["role"], "content": _chat_content(item["content"])}


def _chat_content(content: str | list) -> str | list:
    """Responses content parts in chat completions' shapes (files and images: api/parts.py)."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part["type"] == "input_file":
            out.append({"type": "file", "file": {k: v for k, v in part.items() if k != "type"}})
        elif part["type"] == "input_image":
            ref = {"file_id": part["file_id"]} if part.get("file_id") else {"url": part.get("image_url")}
            out.append({"type": "image_url", "image_url": {**ref, "detail": part.get("detail", "auto")}})
        else:
            out.append({"type": "text", "text": part["text"]})
    return out


def _content_parts(content: list, where: str) -> str | list:
    """input_text parts join into one string; with input_file/input_image parts the list is kept."""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        is_text = kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str)
        if not is_text and kind not in ("input_file", "input_image"):
            raise bad_request(
                f"'{where}.content[{j}]' must be an input_text, input_file or input_image part.",
                param=f"{where}.content[{j}]",
            )
    if all(p["type"] in ("input_text", "output_text", "text") for p in content):
        return "".join(p["text"] for p in content)
    return list(content)


def _item(value: Any, index: int) -> dict:
    where = f"input[{index}]"
    kind = value.get("type", "message") if isinstance(value, dict) else None
    if kind in ("function_call", "function_call_output"):
        return _tool_item(value, kind, where)
    if kind != "message":
        raise bad_request(f"'{where}' must be a message, function_call or function_call_output item.", param=where)
    role = value.get("role")
    if role not in _ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}; got {role!r}.", param=f"{where}.role")
    content = value.get("content")
    if isinstance(content, list):
        content = _content_parts(content, where)
    if not isinstance(content, (str, list)):
        raise bad_request(
            f"'{where}.content' must be a string or an array of input_text parts.", param=f"{where}.content"
        )
    return {"type": "message", "role": role, "content": content}


def _tool_item(value: dict, kind: str, where: str) -> dict:
    """A tool call the model made (sent back) or its result, for the next turn."""
    fields = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    for name in fields:
        if not isinstance(value.get(name), str):
            raise bad_request(f"'{where}.{name}' must be a string.", param=f"{where}.{name}")
    return {"type": kind, **{name: value[name] for name in fields}}


def _chat_tools(value: Any) -> Any:
    """Responses tools are flat ({"type": "function", "name", "parameters"}); chat nests them."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of function tools.", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_request(
                f'\'tools[{i}]\' must be {{"type": "function", "name": ..., "parameters": ...}}.', param=f"tools[{i}]"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _text_format(value: Any):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'text' must be an object {\"format\": {...}}.", param="text")
    for key in value:
        if key not in ("format", "verbosity"):
            raise bad_request(f"Unrecognized field 'text.{key}'.", param=f"text.{key}", code="unknown_parameter")
    verbosity = value.get("verbosity")
    if verbosity is not None and verbosity not in protocol.VERBOSITIES:
        raise bad_request(
            f"'text.verbosity' must be one of low, medium, high; got {verbosity!r}.", param="text.verbosity"
        )
    fmt = value.get("format")
    return None if fmt is None else parse_response_format(fmt, param="text.format")


# ---- rendering -------------------------------------------------------------------------


def output_items(answer: Answer, message_id: str) -> list[dict]:
    items: list[dict] = []
    text = "".join(answer.content_parts)
    if text or not answer.tool_calls:
        items.append(message_item(message_id, text, "completed", answer.logprobs))
    items += [function_call_item(c, "completed") for c in answer.tool_calls]
    return items


def message_item(message_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    """`logprobs`: the text's tokens in chat completions' shape (`include` asked for them), else none."""
    content = [output_text_part(text, logprobs)] if status == "completed" else []
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def output_text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def event_logprobs(entries: list[dict]) -> list[dict]:
    """Logprobs as stream events carry them: token and logprob, alternatives likewise (no bytes)."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]],
        }
        for e in entries
    ]


def function_call_item(call: ToolCall, status: str) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def input_item_object(item: dict) -> dict:
    """A stored input item as `/input_items` lists it, in OpenAI's shape: a message's content as
    parts (`input_text`; the assistant's `output_text`) and every item `completed`. Idempotent:
    rows stored before held a message's content as a string and no status."""
    if item.get("type", "message") != "message":
        return {**item, "status": item.get("status") or "completed"}
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    content = item["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return {
        "id": item["id"],
        "type": "message",
        "role": item["role"],
        "content": [_text_part(kind, p["text"]) if p["type"] in _TEXT_PARTS else p for p in parts],
        "status": "completed",
    }


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_part(kind: str, text: str) -> dict:
    return output_text_part(text) if kind == "output_text" else {"type": "input_text", "text": text}


def response_object(response_id: str, created: int, model: str, req: ResponsesRequest, state: dict) -> dict:
    """`state`: status, output, usage, incomplete_details (absent while in progress); temperature
    and top_p as sampled (a model's generation_config fills what the request left unset)."""
    chat = req.chat
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": state.get("status", "in_progress"),
        "error": None,
        "incomplete_details": state.get("incomplete_details"),
        "instructions": req.instructions,
        "max_output_tokens": req.echo["max_output_tokens"],
        "output": state.get("output", []),
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "background": req.background,
        "temperature": state.get("temperature", chat.temperature),
        "top_p": state.get("top_p", chat.top_p),
        "top_logprobs": req.echo["top_logprobs"],
        "truncation": chat.truncation,
        "tool_choice": req.echo["tool_choice"] or "auto",  # as OpenAI echoes it, tools or not
        "tools": req.echo["tools"] or [],
        "text": req.echo["text"] or {"format": {"type": "text"}},
        "metadata": req.echo["metadata"] or {},
        "usage": state.get("usage"),
    }


def usage_object(prompt: int, cached: int, completion: int, reasoning: int = 0) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }
