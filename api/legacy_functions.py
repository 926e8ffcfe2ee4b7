"""OpenAI's deprecated `functions` and `function_call` on chat completions (the API before
`tools`, still accepted by OpenAI and sent by older SDK code, LangChain's functions agents and
the like).

A request that uses them is rewritten into `tools` before it is parsed: `functions` become
function tools, `function_call` the `tool_choice`, an assistant message's `function_call` a tool
call, and a `function` message the tool result answering the latest call of that name. Such a
request asks for one call at most (`parallel_tool_calls: false`), and its answer names it in the
old shape (api/answer.py): `message.function_call` (`delta.function_call` streamed) and
`finish_reason: "function_call"`. Nothing here reaches the engine or the store.
"""

from __future__ import annotations

import re
from typing import Any

from api.errors import ApiError, bad_request
from api.fields import kind_of

_FIELDS = ("functions", "function_call")


def uses_functions(raw: object) -> bool:
    """The request speaks the deprecated API: its fields, or its messages' old shapes."""
    if not isinstance(raw, dict):
        return False
    if any(field in raw for field in _FIELDS):
        return True
    messages = raw.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or "function_call" in m) for m in messages
    )


def as_tools_request(raw: dict[str, Any]) -> dict[str, Any]:
    """The same request in today's shape (a copy; `raw` is left as it is)."""
    out = {k: v for k, v in raw.items() if k not in _FIELDS}
    for field, newer in (("functions", "tools"), ("function_call", "tool_choice")):
        if field in raw and newer in raw:
            raise bad_request(
                f"'{field}' is the deprecated form of '{newer}': send one of them, not both.", param=field
            )
    if raw.get("functions") is not None:
        out["tools"] = _tools(raw["functions"])
    if raw.get("function_call") is not None:
        out["tool_choice"] = _tool_choice(raw["function_call"])
    out["parallel_tool_calls"] = False  # the old API names one call
    if isinstance(raw.get("messages"), list):
        out["messages"] = _messages(raw["messages"])
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request(f"'functions' must be an array of functions, got {kind_of(value)}.", param="functions")
    return [{"type": "function", "function": f} for f in value]


def _tool_choice(value: Any) -> Any:
    if value in ("none", "auto"):
        return value
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request(
        f'\'function_call\' must be "none", "auto" or {{"name": ...}}, got {value!r}.'[:300], param="function_call"
    )


def _messages(messages: list[Any]) -> list[Any]:
    """Each assistant `function_call` becomes a tool call with an id of its own; each `function`
    message (its `name` required) the result of the latest call of that name before it."""
    calls: dict[str, str] = {}  # function name -> id of its latest call
    out: list[Any] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)  # refused by the parser, naming it
            continue
        where = f"messages[{index}]"
        if message.get("role") == "assistant" and message.get("function_call") is not None:
            out.append(_with_call(message, where, calls, f"call_fn{index}"))
        elif message.get("role") == "function":
            name = message.get("name")
            if not isinstance(name, str):
                raise bad_request(f"'{where}.name' is required for a function message.", param=f"{where}.name")
            if name not in calls:
                raise bad_request(
                    f"'{where}' answers the function '{name}'"[:300] + ", which no assistant message before it called.",
                    param=f"{where}.name",
                )
            out.append({"role": "tool", "tool_call_id": calls[name], "content": message.get("content")})
        else:
            out.append(message)
    return out


def _with_call(message: dict[str, Any], where: str, calls: dict[str, str], call_id: str) -> dict[str, Any]:
    call = message["function_call"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise bad_request(
            f"'{where}.function_call' must be an object with a 'name' and 'arguments'.", param=f"{where}.function_call"
        )
    if message.get("tool_calls"):
        raise bad_request(
            f"'{where}' has both 'function_call' and 'tool_calls': send one of them.", param=f"{where}.function_call"
        )
    calls[call["name"]] = call_id
    function = {"name": call["name"], "arguments": call.get("arguments", "{}")}
    converted = {k: v for k, v in message.items() if k != "function_call"}
    return {**converted, "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


# Today's names in an error about the rewritten request -> the names the client sent.
_OLD_NAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"functions[\1]"),
    (re.compile(r"\btool_choice\b"), "function_call"),
)


def in_old_names(error: ApiError) -> ApiError:
    """An error the rewritten request got, naming the fields the client sent: `tools[0].function.x`
    is its `functions[0].x`, `tool_choice` its `function_call`."""
    for pattern, old in _OLD_NAMES:
        error.message = pattern.sub(old, error.message)
        error.param = None if error.param is None else pattern.sub(old, error.param)
    return error
