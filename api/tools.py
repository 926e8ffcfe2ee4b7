"""Function tools: validate `tools`/`tool_choice`, build the grammar of a forced call, parse calls.

Owns the three tool-call text formats models are trained on (Hermes/Qwen `<tool_call>` JSON,
Llama 3 JSON, Mistral `[TOOL_CALLS]`), picked from the chat template or a per-model setting;
the llguidance grammar that makes a `required` or named choice produce valid arguments; and
the parser turning generated text into OpenAI `tool_calls`. Rendering prompts is api/prompt.py's work.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from engine.grammar import GrammarError, check_json_depth, grammar_text, schema_text
from engine.types import StructuredKind, StructuredOutput

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolFormat(enum.Enum):
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, Hermes)
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}} (Llama 3.1+)
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name": ..., "arguments": {...}}]


class ChoiceMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: str  # JSON schema text (canonical)

    def as_template_arg(self) -> dict:
        """The shape transformers passes to chat templates as `tools=`."""
        fn: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # for NAMED


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(value: Any, max_chars: int | None = None) -> tuple[Tool, ...]:
    """`max_chars`: most characters the tools may hold (num_chars), checked before any schema is compiled."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of function tools.", param="tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(value)}.", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(value))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("Tool names in 'tools' must be unique.", param="tools")
    if max_chars is not None and num_chars(tools) > max_chars:
        raise bad_request(
            f"The tools hold {num_chars(tools)} characters; the limit is {max_chars}.",
            param="tools",
            code="context_length_exceeded",
        )
    for i, tool in enumerate(tools):
        check_schema(tool.parameters, f"tools[{i}].function.parameters")
    return tools


def num_chars(tools: tuple[Tool, ...]) -> int:
    """The tools' text as the prompt carries it (names, descriptions, parameter schemas): what
    server.max_prompt_chars counts with the messages, and what decides tokenizing off the loop."""
    return sum(len(t.name) + len(t.description or "") + len(t.parameters) for t in tools)


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise bad_request(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}.', param=where)
    fn = value["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"'{where}.function.name' must be 1-64 letters, digits, _ or -; got {name!r}.",
            param=f"{where}.function.name",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{where}.function.description' must be a string.", param=f"{where}.function.description")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(
            f"'{where}.function.parameters' must be a JSON schema object.", param=f"{where}.function.parameters"
        )
    if not params:  # OpenAI's "no parameters"; as a grammar {} would allow any JSON value as the arguments
        params = {"type": "object", "properties": {}}
    elif "type" not in params and "properties" in params:  # arguments are always an object
        params = {"type": "object", **params}
    check_nesting(params, f"{where}.function.parameters")
    return Tool(name, description, schema_text(params))  # its schema is compiled once the tools' size is checked


def check_nesting(schema: dict, param: str) -> None:
    """400 for a schema nested too deeply to copy, close or write as text (a RecursionError, a 500)."""
    try:
        check_json_depth(schema)
    except GrammarError as exc:
        raise bad_request(f"'{param}': {exc}", param=param, code="unsupported_value") from None


def check_schema(text: str, param: str) -> None:
    """400 naming the unsupported feature if the grammar library cannot compile the schema."""
    try:
        grammar_text(StructuredOutput(StructuredKind.JSON_SCHEMA, text))
    except GrammarError as exc:
        raise bad_request(f"'{param}': {exc}", param=param, code="unsupported_value") from None


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice(ChoiceMode.AUTO if tools else ChoiceMode.NONE)
    if isinstance(value, str):
        modes = {"none": ChoiceMode.NONE, "auto": ChoiceMode.AUTO, "required": ChoiceMode.REQUIRED}
        if value not in modes:
            raise bad_request(
                f"'tool_choice' must be none, auto, required or a named function; got {value!r}.", param="tool_choice"
            )
        mode = modes[value]
        if mode is not ChoiceMode.NONE and not tools:
            raise bad_request(f"'tool_choice' is {value!r} but no 'tools' were given.", param="tool_choice")
        return ToolChoice(mode)
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            '\'tool_choice\' must be {"type": "function", "function": {"name": ...}}.', param="tool_choice"
        )
    if name not in {t.name for t in tools}:
        raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'.", param="tool_choice")
    return ToolChoice(ChoiceMode.NAMED, name)


def parse_message_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's earlier `tool_calls`, as the client sends them back."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array.", param=where)
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(
                f"'{where}[{i}]' must have function.name and function.arguments (a string).", param=f"{where}[{i}]"
            )
        call_id = call.get("id") if isinstance(call.get("id"), str) else new_call_id()
        calls.append(ToolCall(call_id, fn["name"], fn["arguments"]))
    return tuple(calls)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- formats ---------------------------------------------------------------------------


def detect_format(chat_template: str | None, setting: str) -> ToolFormat:
    """The per-model setting if given, else the format the chat template writes, else Hermes."""
    if setting and setting != "auto":
        return ToolFormat(setting)
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


def template_takes_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def tools_system_prompt(tools: tuple[Tool, ...], fmt: ToolFormat) -> str:
    """For templates that ignore `tools=`: describe them in a system message, in the model's format."""
    specs = "\n".join(
        json.dumps(t.as_template_arg()["function"], ensure_ascii=False, separators=(",", ":")) for t in tools
    )
    example = _call_text(fmt, "NAME", "ARGUMENTS")
    return f"Functions you may call:\n{specs}\nTo call one, answer with:\n{example}"


def _call_text(fmt: ToolFormat, name: str, arguments: str) -> str:
    if fmt is ToolFormat.HERMES:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    if fmt is ToolFormat.MISTRAL:
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": {arguments}}}]'
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def forced_call_grammar(
    tools: tuple[Tool, ...], choice: ToolChoice, fmt: ToolFormat, parallel: bool
) -> StructuredOutput:
    """The grammar of an answer that is only tool calls (of the named tool, or any tool).

    Each tool's parameters schema moves under the envelope's `$defs` (as `tool_<i>`), its local
    references rewritten to match, so that `#/$defs/...` (what pydantic writes for nested
    models) and `#` still point where they did. Raises a 400 naming `tools` if the envelope
    cannot be compiled, so a forced call never fails after the answer's stream opened."""
    chosen = [t for t in tools if choice.mode is not ChoiceMode.NAMED or t.name == choice.name]
    args_key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    defs = {
        f"tool_{i}": tightened(_rebase_refs(json.loads(t.parameters), f"#/$defs/tool_{i}"))
        for i, t in enumerate(chosen)
    }
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: {"$ref": f"#/$defs/tool_{i}"}},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for i, t in enumerate(chosen)
    ]
    call_schema = {"anyOf": variants, "$defs": defs, "x-guidance": {"whitespace_flexible": False}}
    call = f"%json {json.dumps(call_schema)}"
    many = parallel and choice.mode is not ChoiceMode.NAMED
    if fmt is ToolFormat.HERMES:
        start = "start: call+" if many else "start: call"
        rules = f'call: "<tool_call>\\n" {call} "\\n</tool_call>"'
    elif fmt is ToolFormat.MISTRAL:
        start = 'start: "[TOOL_CALLS][" call ("," call)* "]"' if many else 'start: "[TOOL_CALLS][" call "]"'
        rules = f"call: {call}"
    else:
        start = 'start: call (";" call)*' if many else "start: call"
        rules = f"call: {call}"
    structured = StructuredOutput(StructuredKind.LARK, f"{start}\n{rules}")
    try:
        grammar_text(structured)
    except GrammarError as exc:
        raise bad_request(
            f"'tools': a forced call cannot be compiled: {exc}", param="tools", code="unsupported_value"
        ) from None
    return structured


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (which may be any word, "const" too) to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


# I-JSON's (RFC 7493) safe integers: what a JSON parser in any language reads exactly.
MAX_SAFE_INTEGER = 2**53 - 1


def tightened(node: Any, *, is_part: bool = False, close_bare: bool = True) -> Any:
    """`node` made safe to decode under, in place: objects closed and integers bounded.

    Every object schema that does not say `additionalProperties` is closed to its listed
    properties. Plain JSON Schema allows any other key, and a model free to keep adding keys may
    never close the object (a forced call, a response format: vLLM's guided decoding closes them
    too); a schema that wants other keys says so with `additionalProperties`. Left open: an
    object combined with others (`allOf` beside or around it: each part lists only some of the
    keys), one that requires a key it does not list, and with `close_bare=False` (a response
    format, where `{"type": "object"}` means any object) one that lists no properties; a tool's
    bare object means no arguments.

    An integer without a `minimum` or `maximum` gets I-JSON's safe bound (+-(2^53-1), at most 16
    digits): unbounded, a small model that starts repeating digits writes one number until
    max_tokens and the JSON never closes."""
    if isinstance(node, list):
        for item in node:
            tightened(item, is_part=is_part, close_bare=close_bare)
    elif isinstance(node, dict):
        if not is_part and _is_closable(node, close_bare):
            node["additionalProperties"] = False
        _bound_integer(node)
        for key, value in node.items():
            if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names to schemas: each value is one
                tightened(list(value.values()), close_bare=close_bare)
            elif key not in _DATA_KEYWORDS:
                tightened(value, is_part=key == "allOf", close_bare=close_bare)
    return node


def _bound_integer(node: dict) -> None:
    """The safe bound on each open side, unless the values are listed (const, enum) or the other
    side's bound lies beyond it (a minimum of 10^20 asks for big numbers): either way the safe
    bound would refuse what the schema allows (a 400: no value satisfies it)."""
    kind = node.get("type")
    if kind != "integer" and not (isinstance(kind, list) and "integer" in kind):
        return
    if "const" in node or "enum" in node:
        return
    low, high = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high > -MAX_SAFE_INTEGER):
        node["minimum"] = -MAX_SAFE_INTEGER
    if high is None and (low is None or low < MAX_SAFE_INTEGER):
        node["maximum"] = MAX_SAFE_INTEGER


def _bound(node: dict, inclusive: str, exclusive: str) -> float | None:
    """The schema's bound on one side, None where it sets none; one that is no number (draft 4's
    boolean exclusiveMinimum, a string) reads as 0, within the safe range (the grammar judges it)."""
    if inclusive not in node and exclusive not in node:
        return None
    value = node.get(inclusive, node.get(exclusive))
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _is_closable(node: dict, close_bare: bool) -> bool:
    if "additionalProperties" in node or "patternProperties" in node or "allOf" in node:
        return False
    listed = node.get("properties")
    if listed is None:  # only a bare {"type": "object"}: no arguments
        return (
            close_bare
            and node.get("type") == "object"
            and not any(k in node for k in ("$ref", "anyOf", "oneOf", "required"))
        )
    required = node.get("required")
    names = required if isinstance(required, list) else ()  # not names (a number, a list): the grammar's 400
    return isinstance(listed, dict) and all(isinstance(k, str) and k in listed for k in names)


def _rebase_refs(node: Any, root: str) -> Any:
    """`node` with every local `$ref` ("#" or "#/...") moved under `root` (a JSON pointer)."""
    if isinstance(node, list):
        return [_rebase_refs(item, root) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # its keys are names, its values schemas
            out[key] = {name: _rebase_refs(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, root)
    return out
