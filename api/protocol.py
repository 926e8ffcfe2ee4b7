"""OpenAI chat-completions wire format: parse and validate raw JSON, render responses.

The raw body (a `dict` from JSON) and the validated `ChatRequest` are different types;
every validation error names the field, the limit and the value received. Nothing here
tokenizes or touches the engine (a JSON schema is only checked by the grammar library, so an
unsupported feature is a 400 naming it); context-window checks happen after tokenization.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from api import tools as tooling
from api.errors import bad_request
from api.parts import Part, has_attachments, parse_parts, parse_truncation, text_of
from engine.types import StructuredKind, StructuredOutput

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20

# Fields we accept but ignore when they carry their default (harmless for a text chat).
_IGNORED_DEFAULTS: dict[str, tuple[Any, ...] | None] = {
    "logit_bias": (None, {}),
    "store": (None, False),
    "metadata": None,  # OpenAI's shape is checked (check_metadata); its values are not used
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
_KNOWN = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "stream",
    "stream_options",
    "user",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "conversation_id",
    "truncation",
    "chat_template_kwargs",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "repetition_penalty",
    "reasoning_effort",
    "thinking_token_budget",
    "continue_final_message",
    "add_generation_prompt",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
    "service_tier",
}
# Accepted and checked, without effect here: the prefix cache needs no key (it finds shared
# prefixes itself), a safety identifier only labels the caller, and `verbosity` steers OpenAI's
# GPT-5 models, which a local checkpoint is not.
_NO_EFFECT_STRINGS = ("prompt_cache_key", "safety_identifier")
VERBOSITIES = ("low", "medium", "high")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str  # the message's own text (its text parts joined)
    parts: tuple[Part, ...] = ()  # set only when the message has file or image parts (api/parts.py)
    tool_calls: tuple[tooling.ToolCall, ...] = ()  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def as_wire_dict(self) -> dict[str, Any]:
        """The message as OpenAI's API takes it (tool-call arguments as JSON text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat request. `max_tokens` None: as many as the context allows."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM's extension): usage on every chunk
    user: str | None
    conversation_id: str | None
    truncation: str = "disabled"  # 'auto': cut attached files that do not fit the context
    response_format: StructuredOutput | None = None  # None: free text
    logprobs: int | None = None  # None: not asked; k: chosen token + top k alternatives
    n: int = 1
    tools: tuple[tooling.Tool, ...] = ()
    tool_choice: tooling.ToolChoice = tooling.ToolChoice(tooling.ChoiceMode.NONE)
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    repetition_penalty: float = 1.0  # vLLM's extension (transformers' semantics); 1: off
    # The last message is an assistant's prefill the answer continues (vLLM's extension; Anthropic's
    # Messages API whenever the last message is the assistant's): the answer holds only the continuation.
    continue_final_message: bool = False
    # Sampling fields the client sent; the others may take the model's generation_config defaults.
    sampling_fields_set: frozenset[str] = frozenset()
    # POST /v1/completions: the prompt as text or token ids, given to the model as it is (no chat
    # template); `messages` then holds its text as one user message, which the safety gate reads.
    raw_prompt: str | tuple[int, ...] | None = None
    # Anthropic's Messages API: max_tokens is a cap (its clients ask for far more than a local context), so the answer
    # gets at most what the tier and the context leave instead of a 400.
    max_tokens_is_cap: bool = False
    prompt_logprobs: int | None = None  # a legacy completion's echo with logprobs: the prompt's own, top k
    # vLLM's extension: most tokens a reasoning model may think before its thinking is closed for
    # it (None: the model's configured thinking_budget, if any).
    thinking_token_budget: int | None = None
    # False (the Messages API, whose budget_tokens comes with every enabled thinking): a model
    # whose thinking cannot be capped here ignores the budget instead of a 400.
    thinking_budget_strict: bool = True
    # The Responses API's `instructions`: placed first, before any stored history; screened with
    # the prompt, never dropped to fit the context and never stored with the turn.
    instructions: tuple[ChatMessage, ...] = ()


def parse_chat_request(raw: Any, *, max_messages: int, max_prompt_chars: int, max_n: int = 1) -> ChatRequest:
    """Validate a decoded JSON body; raise ApiError(400) naming the field on any problem."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    _reject_unsupported(raw)
    check_metadata(raw.get("metadata"))
    stream = _opt_bool(raw, "stream", False)
    stream_options = raw.get("stream_options")
    include_usage, continuous_usage = _stream_options(stream_options, stream)
    max_tokens = _opt_int(raw, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(raw, "max_tokens", 1)
    min_tokens = _opt_int(raw, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).", param="min_tokens")
    n = _opt_int(raw, "n", 1) or 1
    if n > max_n:
        raise bad_request(f"'n' must be at most {max_n} on this server, got {n}.", param="n", code="unsupported_value")
    tools = tooling.parse_tools(raw.get("tools"), max_prompt_chars)
    tool_choice = tooling.parse_tool_choice(raw.get("tool_choice"), tools)
    response_format = parse_response_format(raw.get("response_format"))
    if response_format is not None and tool_choice.mode in (tooling.ChoiceMode.REQUIRED, tooling.ChoiceMode.NAMED):
        raise bad_request(
            "A forced 'tool_choice' cannot be combined with a JSON 'response_format'.", param="response_format"
        )
    messages = _messages(raw.get("messages"), max_messages)
    _check_prompt_chars(messages, tools, max_prompt_chars)
    _check_no_effect_fields(raw)
    return ChatRequest(
        model=_opt_str(raw, "model"),
        messages=messages,
        max_tokens=max_tokens,
        temperature=_opt_float(raw, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(raw),
        top_k=_top_k(raw),
        seed=_opt_int(raw, "seed", -(2**63)),
        stop=_stop(raw.get("stop")),
        presence_penalty=_opt_float(raw, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_opt_float(raw, "frequency_penalty", 0.0, -2.0, 2.0),
        min_tokens=min_tokens,
        ignore_eos=_opt_bool(raw, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=_opt_str(raw, "user"),
        conversation_id=_opt_str(raw, "conversation_id"),
        truncation=parse_truncation(raw),
        response_format=response_format,
        logprobs=_logprobs(raw),
        n=n,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_opt_bool(raw, "parallel_tool_calls", True),
        chat_template_kwargs=with_reasoning_effort(
            _chat_template_kwargs(raw.get("chat_template_kwargs")), raw.get("reasoning_effort"), "reasoning_effort"
        ),
        repetition_penalty=_repetition_penalty(raw),
        continue_final_message=_continue_final_message(raw, messages),
        thinking_token_budget=_opt_int(raw, "thinking_token_budget", 0),
        sampling_fields_set=frozenset(k for k in _DEFAULTABLE_SAMPLING_FIELDS if raw.get(k) is not None),
    )


def _continue_final_message(raw: dict[str, Any], messages: tuple[ChatMessage, ...]) -> bool:
    wanted = _opt_bool(raw, "continue_final_message", False)
    if wanted and (not messages or messages[-1].role != "assistant" or messages[-1].tool_calls):
        raise bad_request(
            "'continue_final_message' needs the last message to be the assistant's text, which the answer continues.",
            param="continue_final_message",
        )
    # vLLM's pair: continuing the last message means no new assistant turn is opened.
    opens_turn = _opt_bool(raw, "add_generation_prompt", not wanted)
    if opens_turn == wanted:
        raise bad_request(
            "'add_generation_prompt' must be false exactly when 'continue_final_message' is true (the answer "
            "either continues the last assistant message or opens a new turn).",
            param="add_generation_prompt",
        )
    return wanted


SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's; one tier of service here


def check_service_tier(value: Any) -> None:
    if value is not None and value not in SERVICE_TIERS:
        raise bad_request(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}; got {value!r}.", param="service_tier"
        )


def _check_no_effect_fields(raw: dict[str, Any]) -> None:
    check_service_tier(raw.get("service_tier"))
    for key in _NO_EFFECT_STRINGS:
        _opt_str(raw, key)
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise bad_request(f"'verbosity' must be one of low, medium, high; got {verbosity!r}.", param="verbosity")


# Fields a checkpoint's generation_config.json may default when the request leaves them unset.
_DEFAULTABLE_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")

# Set by the server (max_num_tokens: the tokenizer's bound on the prompt, api/job.py).
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "max_num_tokens")


def _chat_template_kwargs(value: Any) -> dict[str, Any] | None:
    """vLLM's extension: variables for the chat template (the template itself decides what they do)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f"'chat_template_kwargs' must be an object, got {kind_of(value)}.", param="chat_template_kwargs"
        )
    for key in value:
        if key in _TEMPLATE_RESERVED:
            raise bad_request(
                f"'chat_template_kwargs' must not set '{key}' (the server sets it).",
                param=f"chat_template_kwargs.{key}",
            )
    return dict(value)


def with_reasoning_effort(kwargs: dict[str, Any] | None, effort: Any, param: str) -> dict[str, Any] | None:
    """OpenAI's reasoning effort as template variables: `reasoning_effort` itself (gpt-oss's
    template reads it), and for "none" or "minimal" `enable_thinking=false` (Qwen3's and the like:
    no thinking). Variables the request sets in chat_template_kwargs win."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}.", param=param)
    derived: dict[str, Any] = {"reasoning_effort": effort}
    if effort in ("none", "minimal"):
        derived["enable_thinking"] = False
    return {**derived, **(kwargs or {})}


def wire_options(chat: ChatRequest) -> dict[str, Any]:
    """The validated fields beyond messages and sampling, in OpenAI's wire shape, for backends
    that forward the chat to another server (engine/upstream)."""
    out: dict[str, Any] = {}
    if chat.tools:
        out["tools"] = [t.as_template_arg() for t in chat.tools]
        choice = chat.tool_choice
        out["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.mode is tooling.ChoiceMode.NAMED
            else choice.mode.value
        )
        out["parallel_tool_calls"] = chat.parallel_tool_calls
    fmt = chat.response_format
    if fmt is not None and fmt.kind is StructuredKind.JSON_OBJECT:
        out["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.kind is StructuredKind.JSON_SCHEMA:
        schema = {"name": "response", "schema": json.loads(fmt.spec), "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    if chat.logprobs is not None:
        out["logprobs"] = True
        out["top_logprobs"] = chat.logprobs
    if chat.chat_template_kwargs:  # vLLM and SGLang take it (e.g. enable_thinking)
        out["chat_template_kwargs"] = chat.chat_template_kwargs
    if chat.thinking_token_budget is not None:  # vLLM's name for it
        out["thinking_token_budget"] = chat.thinking_token_budget
    return out  # n > 1 is fanned out here (api/generation.py), one upstream request per choice


def parse_response_format(value: Any, param: str = "response_format") -> StructuredOutput | None:
    """`{"type": "text" | "json_object" | "json_schema", ...}` -> the grammar, or None for text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if kind != "json_schema":
        raise bad_request(
            f"'{param}.type' must be text, json_object or json_schema; got {kind!r}.", param=f"{param}.type"
        )
    spec = value.get("json_schema") if param == "response_format" else value  # Responses: flattened
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}.json_schema' must be an object.", param=f"{param}.json_schema")
    where = f"{param}.json_schema" if param == "response_format" else param
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{where}.name' must be a non-empty string.", param=f"{where}.name")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON schema object.", param=f"{where}.schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request(f"'{where}.strict' must be a boolean.", param=f"{where}.strict")
    text = tooling.schema_text(schema)
    tooling.check_schema(text, f"{where}.schema")
    return StructuredOutput(StructuredKind.JSON_SCHEMA, text)


def _logprobs(raw: dict[str, Any]) -> int | None:
    wanted = _opt_bool(raw, "logprobs", False)
    top = _opt_int(raw, "top_logprobs", 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.", param="top_logprobs")
    if top and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    return (top or 0) if wanted else None


def kind_of(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(value: Any) -> None:
    """OpenAI's `metadata`: null, or at most 16 string keys (64 characters) to strings (512)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request(f"'metadata' must be an object of strings, got {kind_of(value)}.", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"'metadata' may have at most {MAX_METADATA_PAIRS} keys, got {len(value)}.", param="metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters; {key[:20]!r}... is longer.",
                param="metadata",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"'metadata.{key}' must be a string of at most {MAX_METADATA_VALUE_CHARS} characters.",
                param=f"metadata.{key}",
            )


def _reject_unsupported(raw: dict[str, Any]) -> None:
    for key, value in raw.items():
        if key in _KNOWN:
            continue
        if key not in _IGNORED_DEFAULTS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
        allowed = _IGNORED_DEFAULTS[key]
        if allowed is not None and value not in allowed:
            raise bad_request(f"{key}={value!r} is not supported by this server.", param=key, code="unsupported_value")


def _messages(value: Any, max_messages: int) -> tuple[ChatMessage, ...]:
    if value is None:
        raise bad_request(
            "Missing required parameter: 'messages'.", param="messages", code="missing_required_parameter"
        )
    if not isinstance(value, list):
        raise bad_request(f"'messages' must be an array, got {kind_of(value)}.", param="messages")
    if not value:
        raise bad_request("'messages' must contain at least one message.", param="messages")
    if len(value) > max_messages:
        raise bad_request(f"'messages' has {len(value)} entries; the limit is {max_messages}.", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(value))


def _check_prompt_chars(messages: tuple[ChatMessage, ...], tools: tuple[tooling.Tool, ...], max_chars: int) -> None:
    """server.max_prompt_chars: the messages' text and the tools' (names, descriptions, schemas),
    which the prompt carries too, before anything is rendered or tokenized."""
    num_message_chars = sum(len(m.content) for m in messages)
    num_tool_chars = tooling.num_chars(tools)
    if num_message_chars + num_tool_chars <= max_chars:
        return
    if not tools:
        message = f"The messages hold {num_message_chars} characters; the limit is {max_chars}."
    else:
        message = (
            f"The prompt holds {num_message_chars + num_tool_chars} characters ({num_message_chars} in the "
            f"messages, {num_tool_chars} in the tools); the limit is {max_chars}."
        )
    param = "tools" if num_tool_chars > num_message_chars else "messages"
    raise bad_request(message, param=param, code="context_length_exceeded")


def _message(value: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object, got {kind_of(value)}.", param=where)
    role = value.get("role")
    if role not in ROLES:
        raise bad_request(
            f"'{where}.role' must be one of system, developer, user, assistant, tool; got {role!r}.",
            param=f"{where}.role",
        )
    content = value.get("content")
    if content is None and role == "assistant":
        content = ""
    text, parts = _content(content, f"{where}.content")
    if parts and role != "user":
        raise bad_request(f"Only user messages may carry files or images ('{where}').", param=f"{where}.content")
    calls = (
        tooling.parse_message_tool_calls(value.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    )
    call_id = value.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise bad_request(f"'{where}.tool_call_id' is required for a tool message.", param=f"{where}.tool_call_id")
    return ChatMessage(
        "system" if role == "developer" else role,
        text,
        parts,
        tool_calls=calls,
        tool_call_id=call_id if role == "tool" else None,
    )


def _content(value: Any, where: str) -> tuple[str, tuple[Part, ...]]:
    """(the text, the parts when there are file or image parts, else ())."""
    if isinstance(value, str):
        return value, ()
    if not isinstance(value, list):
        raise bad_request(
            f"'{where}' must be a string or an array of content parts, got {kind_of(value)}.", param=where
        )
    parts = parse_parts(value, where)
    return text_of(parts), parts if has_attachments(parts) else ()


def _opt_str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {kind_of(value)}.", param=key)
    return value


def _opt_bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {kind_of(value)}.", param=key)
    return value


def _opt_int(raw: dict[str, Any], key: str, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {value!r}.", param=key)
    if value < minimum:
        raise bad_request(f"'{key}' must be at least {minimum}, got {value}.", param=key)
    if value >= 2**63:
        raise bad_request(f"'{key}' is too large: {value}.", param=key)
    return value


def _opt_float(raw: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number, got {value!r}.", param=key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo:g} and {hi:g}, got {value:g}.", param=key)
    return float(value)


def _repetition_penalty(raw: dict[str, Any]) -> float:
    value = _opt_float(raw, "repetition_penalty", 1.0, -math.inf, math.inf)
    if value <= 0.0:
        raise bad_request(f"'repetition_penalty' must be greater than 0, got {value:g}.", param="repetition_penalty")
    return value


def _top_p(raw: dict[str, Any]) -> float:
    value = _opt_float(raw, "top_p", 1.0, 0.0, 1.0)
    if value == 0.0:
        raise bad_request("'top_p' must be greater than 0 and at most 1, got 0.", param="top_p")
    return value


def _top_k(raw: dict[str, Any]) -> int | None:
    value = _opt_int(raw, "top_k", -1)
    return None if value in (None, -1, 0) else value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings.", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.", param="stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"Each stop string must have 1 to {MAX_STOP_CHARS} characters.", param="stop")
    return tuple(stops)


def _stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); the second is vLLM's extension and needs the first."""
    if value is None:
        return False, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    if not isinstance(value, dict):
        raise bad_request(f"'stream_options' must be an object, got {kind_of(value)}.", param="stream_options")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean.", param="stream_options.include_usage")
    continuous = value.get("continuous_usage_stats", False)
    if not isinstance(continuous, bool):
        raise bad_request(
            "'stream_options.continuous_usage_stats' must be a boolean.", param="stream_options.continuous_usage_stats"
        )
    return include, include and continuous


# ---- rendering -------------------------------------------------------------------------


def usage_dict(
    prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost_usd: float | None, reasoning_tokens: int = 0
) -> dict:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},  # of completion_tokens, thinking
    }
    if cost_usd is not None:
        usage["cost_usd"] = round(cost_usd, 9)  # extension: cost from the server's price table (nano-dollars)
    return usage


def completion_body(
    completion_id: str, model: str, created: int, content: str, finish_reason: str, usage: dict, extra: dict
) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "system_fingerprint": None,
        **extra,
    }


def chunk_body(
    completion_id: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason: str | None,
    include_usage: bool,
    usage: dict | None = None,
) -> dict:
    body = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = usage  # as OpenAI does: null on every chunk but the last (unless continuous)
    return body


def usage_chunk_body(completion_id: str, model: str, created: int, usage: dict) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage,
    }


def now_s() -> int:
    return int(time.time())
