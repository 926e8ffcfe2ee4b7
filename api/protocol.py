"""OpenAI chat-completions requests: parse and validate raw JSON into a `ChatRequest`.

The raw body (a `dict` from JSON) and the validated `ChatRequest` are different types;
every validation error names the field, the limit and the value received (single-field checks:
api/fields.py; response bodies: api/chat_bodies.py). Nothing here tokenizes or touches the engine
(a JSON schema is only checked by the grammar library, so an unsupported feature is a 400 naming
it); context-window checks happen after tokenization.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from api import tools as tooling
from api.errors import bad_request
from api.fields import (
    check_metadata,
    check_service_tier,
    kind_of,
    opt_bool,
    opt_float,
    opt_int,
    opt_str,
    parse_logit_bias,
    parse_response_format,
    parse_stop,
    parse_stream_options,
    with_reasoning_effort,
)
from api.parts import Part, has_attachments, parse_parts, parse_truncation, text_of
from engine.types import StructuredKind, StructuredOutput

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_TOP_LOGPROBS = 20

# Fields we accept but ignore when they carry their default (harmless for a text chat).
_IGNORED_DEFAULTS: dict[str, tuple[Any, ...] | None] = {
    "store": (None, False),
    "metadata": None,  # OpenAI's shape is checked (check_metadata); its values are not used
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
_KNOWN = {
    "model",
    "logit_bias",
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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id
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
    # Ollama's `think` true or a level: a model that cannot think is a 400, as Ollama answers it
    # (its clients retry without `think` on that 400); `think: false` suits any model.
    thinking_required: bool = False
    # The Responses API's `instructions`: placed first, before any stored history; screened with
    # the prompt, never dropped to fit the context and never stored with the turn.
    instructions: tuple[ChatMessage, ...] = ()
    # The Responses API with store: false: the first messages are the stored history of
    # previous_response_id, sent in the messages; their files, like a stored conversation's, are not
    # counted toward files.max_files_per_request (api/attachments.py).
    num_history_messages: int = 0
    # OpenAI's deprecated `functions` (api/legacy_functions.py): the call comes back as
    # `message.function_call`, finish_reason "function_call".
    legacy_functions: bool = False


def parse_chat_request(raw: Any, *, max_messages: int, max_prompt_chars: int, max_n: int = 1) -> ChatRequest:
    """Validate a decoded JSON body; raise ApiError(400) naming the field on any problem."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    _reject_unsupported(raw)
    check_metadata(raw.get("metadata"))
    stream = opt_bool(raw, "stream", False)
    stream_options = raw.get("stream_options")
    include_usage, continuous_usage = parse_stream_options(stream_options, stream)
    max_tokens = opt_int(raw, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = opt_int(raw, "max_tokens", 1)
    min_tokens = opt_int(raw, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).", param="min_tokens")
    n = opt_int(raw, "n", 1) or 1
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
        model=opt_str(raw, "model"),
        messages=messages,
        max_tokens=max_tokens,
        temperature=opt_float(raw, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(raw),
        top_k=_top_k(raw),
        seed=opt_int(raw, "seed", -(2**63)),
        stop=parse_stop(raw.get("stop")),
        presence_penalty=opt_float(raw, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=opt_float(raw, "frequency_penalty", 0.0, -2.0, 2.0),
        min_tokens=min_tokens,
        ignore_eos=opt_bool(raw, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=opt_str(raw, "user"),
        conversation_id=opt_str(raw, "conversation_id"),
        truncation=parse_truncation(raw),
        response_format=response_format,
        logprobs=_logprobs(raw),
        n=n,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=opt_bool(raw, "parallel_tool_calls", True),
        chat_template_kwargs=with_reasoning_effort(
            _chat_template_kwargs(raw.get("chat_template_kwargs")), raw.get("reasoning_effort"), "reasoning_effort"
        ),
        repetition_penalty=_repetition_penalty(raw),
        logit_bias=parse_logit_bias(raw.get("logit_bias")),
        continue_final_message=_continue_final_message(raw, messages),
        thinking_token_budget=opt_int(raw, "thinking_token_budget", 0),
        sampling_fields_set=frozenset(k for k in _DEFAULTABLE_SAMPLING_FIELDS if raw.get(k) is not None),
    )


def _continue_final_message(raw: dict[str, Any], messages: tuple[ChatMessage, ...]) -> bool:
    wanted = opt_bool(raw, "continue_final_message", False)
    if wanted and (not messages or messages[-1].role != "assistant" or messages[-1].tool_calls):
        raise bad_request(
            "'continue_final_message' needs the last message to be the assistant's text, which the answer continues.",
            param="continue_final_message",
        )
    # vLLM's pair: continuing the last message means no new assistant turn is opened.
    opens_turn = opt_bool(raw, "add_generation_prompt", not wanted)
    if opens_turn == wanted:
        raise bad_request(
            "'add_generation_prompt' must be false exactly when 'continue_final_message' is true (the answer "
            "either continues the last assistant message or opens a new turn).",
            param="add_generation_prompt",
        )
    return wanted


def _check_no_effect_fields(raw: dict[str, Any]) -> None:
    check_service_tier(raw.get("service_tier"))
    for key in _NO_EFFECT_STRINGS:
        opt_str(raw, key)
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise bad_request(f"'verbosity' must be one of low, medium, high; got {verbosity!r}.", param="verbosity")


# Fields a checkpoint's generation_config.json may default when the request leaves them unset.
_DEFAULTABLE_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")

# Set by the server (max_num_tokens: the tokenizer's bound on the prompt, api/prompt.py).
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


def _logprobs(raw: dict[str, Any]) -> int | None:
    wanted = opt_bool(raw, "logprobs", False)
    top = opt_int(raw, "top_logprobs", 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.", param="top_logprobs")
    if top and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    return (top or 0) if wanted else None


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
    if not isinstance(role, str) or role not in ROLES:  # a list or object is no role (nor hashable)
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


def _repetition_penalty(raw: dict[str, Any]) -> float:
    value = opt_float(raw, "repetition_penalty", 1.0, -math.inf, math.inf)
    if value <= 0.0:
        raise bad_request(f"'repetition_penalty' must be greater than 0, got {value:g}.", param="repetition_penalty")
    return value


def _top_p(raw: dict[str, Any]) -> float:
    value = opt_float(raw, "top_p", 1.0, 0.0, 1.0)
    if value == 0.0:
        raise bad_request("'top_p' must be greater than 0 and at most 1, got 0.", param="top_p")
    return value


def _top_k(raw: dict[str, Any]) -> int | None:
    value = opt_int(raw, "top_k", -1)
    return None if value in (None, -1, 0) else value
