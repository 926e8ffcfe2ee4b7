"""Ollama's native API requests: a POST /api/chat or /api/generate body validated into the
`ChatRequest` that chat completions serve, each error naming Ollama's field (`options.top_p`,
`messages[1].images[0]`).

`messages` (with `images` as base64 strings, an assistant's `tool_calls` with arguments as an
object, `tool` messages matched to their call by `tool_name`), `tools` (OpenAI's shape),
`format` ("json" or a JSON schema: the answer is constrained by grammar), `think` (true/false:
the template's `enable_thinking`; "low"/"medium"/"high": a reasoning effort; true or a level for
a model that cannot think is a 400 in api/job.py, as Ollama's), `logprobs` and
`top_logprobs`, and `options`: `temperature`, `top_p`, `top_k`, `seed` (-1: random),
`num_predict` (-1 and -2: as many as the context and the tier allow), `stop`, `repeat_penalty`,
`presence_penalty`, `frequency_penalty`. `num_ctx` is checked and ignored: the context is the
model's, as the tier caps it (a prompt that does not fit is a 400, never cut). Other options
(`min_p`, `mirostat`, `num_gpu`...) are ignored, as Ollama ignores options it does not know, and
so is `keep_alive`, except on a load call. `num_predict` is a cap, as the Messages API's max_tokens:
Ollama's clients ask for more than a tier allows. A body with no messages (/api/chat) or an empty
prompt (/api/generate) is Ollama's "load the model" call (`LoadOnly`), or its "unload" call with
`keep_alive` 0.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from dataclasses import dataclass, replace
from typing import Any

import orjson

from api import protocol
from api.errors import ApiError, bad_request
from api.fields import (
    kind_of,
    opt_bool,
    opt_float,
    opt_int,
    parse_response_format,
    parse_stop,
    with_reasoning_effort,
)
from api.parts import ImagePart, named
from engine.types import StructuredKind, StructuredOutput

ROLES = ("system", "user", "assistant", "tool")
# Magic bytes of the images a vision model takes here, and their media types.
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))
# Ollama's options with a chat-completions field of their own.
_NUMBER_OPTIONS = {  # option: (chat field, lowest, highest)
    "temperature": ("temperature", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "repeat_penalty": ("repetition_penalty", 0.0, 1e9),
    "presence_penalty": ("presence_penalty", -2.0, 2.0),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0),
}
# A zero Go duration, as Ollama reads `keep_alive` ("0", "0s", "0m0s"; a number is seconds).
_ZERO_DURATION = re.compile(r"[+-]?(0|((0+(\.0*)?|\.0+)(ns|us|µs|μs|ms|s|m|h))+)")
_UNSUPPORTED_GENERATE = {
    "suffix": "fill-in-the-middle is not served here; send the text before the gap as the prompt",
    "template": "each model's own chat template is used; send 'raw': true with a prompt already templated",
    "context": "answers carry no 'context'; send the conversation to /api/chat as messages instead",
}


class Endpoint(enum.Enum):
    CHAT = "chat"
    GENERATE = "generate"


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    chat: protocol.ChatRequest  # model: the served name (a ':latest' tag dropped)
    endpoint: Endpoint
    model: str  # as the client named it: its answers repeat it


class LoadOnly(Exception):
    """Ollama's "load the model" call, or with `keep_alive` 0 its "unload" call: nothing to generate."""

    def __init__(self, model: str, endpoint: Endpoint, *, is_unload: bool):
        super().__init__(model)
        self.model = model
        self.endpoint = endpoint
        self.is_unload = is_unload


def is_zero_keep_alive(value: Any) -> bool:
    """`keep_alive` 0: seconds as a number, or a Go duration string ("0", "0s")."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == 0
    return isinstance(value, str) and _ZERO_DURATION.fullmatch(value) is not None


def resolve_model(name: str, known: frozenset[str]) -> str:
    """A model name as Ollama's clients write it: `tiny:latest` is `tiny` (Ollama's default tag)."""
    if name in known or not name.endswith(":latest"):
        return name
    bare = name.removesuffix(":latest")
    return bare if bare in known else name


def parse_chat(raw: Any, *, known: frozenset[str], max_messages: int, max_prompt_chars: int) -> OllamaRequest:
    """POST /api/chat; raises ApiError(400) naming the field, or LoadOnly for no messages."""
    model = _model(raw)
    if not raw.get("messages"):
        if raw.get("messages") is not None and not isinstance(raw["messages"], list):
            raise bad_request(f"'messages' must be an array, got {kind_of(raw['messages'])}.", param="messages")
        raise LoadOnly(model, Endpoint.CHAT, is_unload=is_zero_keep_alive(raw.get("keep_alive")))
    messages, images = _messages(raw["messages"], max_messages)
    chat = _common(raw, model, known, messages)
    if raw.get("tools") is not None:
        chat["tools"] = _tools(raw["tools"])
    parsed = protocol.parse_chat_request(chat, max_messages=max_messages, max_prompt_chars=max_prompt_chars)
    return OllamaRequest(_finish(parsed, raw, images), Endpoint.CHAT, model)


def parse_generate(raw: Any, *, known: frozenset[str], max_prompt_chars: int) -> OllamaRequest:
    """POST /api/generate; raises ApiError(400) naming the field, or LoadOnly for an empty prompt."""
    model = _model(raw)
    for key, why in _UNSUPPORTED_GENERATE.items():
        if raw.get(key):
            raise bad_request(f"'{key}' is not supported by this server: {why}.", param=key)
    prompt, system = _opt_text(raw, "prompt"), _opt_text(raw, "system")
    images = _images(raw.get("images"), "images")
    is_raw = opt_bool(raw, "raw", False)
    if not prompt and (is_raw or (not system and not images)):  # raw mode ignores `system`, as Ollama does
        raise LoadOnly(model, Endpoint.GENERATE, is_unload=is_zero_keep_alive(raw.get("keep_alive")))
    if is_raw and images:
        raise bad_request("'images' need the model's chat template; send them with 'raw': false.", param="images")
    user: dict[str, Any] = {"role": "user", "content": _with_images(prompt, images)}
    # Raw: the prompt goes to the model as it is (as /v1/completions); `system` needs a template.
    messages = [user] if is_raw or not system else [{"role": "system", "content": system}, user]
    chat = _common(raw, model, known, messages)
    parsed = protocol.parse_chat_request(chat, max_messages=2, max_prompt_chars=max_prompt_chars)
    where = {(len(messages) - 1, j): f"images[{j}]" for j in range(len(images))}
    parsed = _finish(parsed, raw, where)
    return OllamaRequest(replace(parsed, raw_prompt=prompt) if is_raw else parsed, Endpoint.GENERATE, model)


def _model(raw: Any) -> str:
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a model name from /api/tags.", param="model")
    return model


def _opt_text(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {kind_of(value)}.", param=key)
    return value or ""


def _common(raw: dict[str, Any], model: str, known: frozenset[str], messages: list[dict]) -> dict[str, Any]:
    """The chat-completions body both endpoints share: model, messages, stream, options, logprobs."""
    chat: dict[str, Any] = {
        "model": resolve_model(model, known),
        "messages": messages,
        "stream": opt_bool(raw, "stream", True),  # Ollama streams unless told not to
        **_options(raw.get("options")),
    }
    for key in ("logprobs", "top_logprobs"):
        if raw.get(key) is not None:
            chat[key] = raw[key]
    return chat


def _finish(
    parsed: protocol.ChatRequest, raw: dict[str, Any], images: dict[tuple[int, int], str]
) -> protocol.ChatRequest:
    """What the chat parser does not know: `format`, `think`, num_predict as a cap, image names."""
    kwargs = _think(raw.get("think"))
    return replace(
        parsed,
        messages=_named_images(parsed.messages, images),
        response_format=_format(raw.get("format")),
        chat_template_kwargs=kwargs,
        max_tokens_is_cap=True,
        thinking_required=bool(kwargs and kwargs.get("enable_thinking")),
    )


def _options(value: Any) -> dict[str, Any]:
    """Ollama's `options` as chat-completions fields; each error names `options.<name>`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'options' must be an object, got {kind_of(value)}.", param="options")
    out: dict[str, Any] = {}
    for name, (field, lo, hi) in _NUMBER_OPTIONS.items():
        if value.get(name) is not None:
            out[field] = opt_float({f"options.{name}": value[name]}, f"options.{name}", 0.0, lo, hi)
    if out.get("top_p") == 0.0 or out.get("repetition_penalty") == 0.0:
        which = "top_p" if out.get("top_p") == 0.0 else "repeat_penalty"
        raise bad_request(f"'options.{which}' must be greater than 0.", param=f"options.{which}")
    top_k = _int_option(value, "top_k", -1)
    if top_k is not None:
        out["top_k"] = top_k  # 0 and -1: no top-k cut
    seed = _int_option(value, "seed", -(2**63))
    if seed is not None and seed != -1:  # Ollama's -1: a random seed
        out["seed"] = seed
    num_predict = _int_option(value, "num_predict", -2)
    if num_predict == 0:
        raise bad_request(
            "'options.num_predict' must be a positive number of tokens, or -1 (no limit) or -2 (fill the context).",
            param="options.num_predict",
        )
    if num_predict is not None and num_predict > 0:
        out["max_tokens"] = num_predict
    _int_option(value, "num_ctx", 1)  # checked, not used: the context is the model's (module docstring)
    if value.get("stop") is not None:
        try:
            out["stop"] = list(parse_stop(value["stop"]))
        except ApiError as exc:
            raise bad_request(exc.message.replace("'stop'", "'options.stop'"), param="options.stop") from None
    return out


def _int_option(options: dict[str, Any], name: str, minimum: int) -> int | None:
    key = f"options.{name}"
    return opt_int({key: options.get(name)}, key, minimum)


def _think(value: Any) -> dict[str, Any] | None:
    """`think` as template variables: a boolean is `enable_thinking`; a level is a reasoning effort."""
    if value is None:
        return None  # the model's own default (a reasoning model thinks)
    if isinstance(value, bool):
        return {"enable_thinking": value}
    if value in ("none", "minimal"):
        return with_reasoning_effort(None, value, "think")
    if value not in ("low", "medium", "high"):
        raise bad_request(f"'think' must be true, false, or one of low, medium, high; got {value!r}.", param="think")
    return with_reasoning_effort({"enable_thinking": True}, value, "think")


def _format(value: Any) -> StructuredOutput | None:
    """`format`: "json" (any JSON object) or a JSON schema the answer must follow."""
    if value is None or value == "":
        return None
    if value == "json":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if not isinstance(value, dict):
        raise bad_request(f"'format' must be \"json\" or a JSON schema object, got {value!r}.", param="format")
    return parse_response_format({"type": "json_schema", "name": "format", "schema": value}, param="format")


def _messages(value: Any, max_messages: int) -> tuple[list[dict[str, Any]], dict[tuple[int, int], str]]:
    """Ollama's messages as chat messages, and where each image part came from (for its errors)."""
    if not isinstance(value, list):
        raise bad_request(f"'messages' must be an array, got {kind_of(value)}.", param="messages")
    if len(value) > max_messages:
        raise bad_request(f"'messages' has {len(value)} entries; the limit is {max_messages}.", param="messages")
    out: list[dict[str, Any]] = []
    images: dict[tuple[int, int], str] = {}
    calls: list[tuple[str, str]] = []  # (id, name) of the assistant's calls no tool message answered yet
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}.", param=f"{where}.role")
        text = message.get("content")
        text = "" if text is None else text  # a falsy content of another type (false, 0, []) is a 400 too
        if not isinstance(text, str):
            raise bad_request(f"'{where}.content' must be a string, got {kind_of(text)}.", param=f"{where}.content")
        urls = _images(message.get("images"), f"{where}.images")
        if urls and role != "user":
            raise bad_request(f"Only user messages may carry images ('{where}.images').", param=f"{where}.images")
        images.update({(i, j): f"{where}.images[{j}]" for j in range(len(urls))})
        chat: dict[str, Any] = {"role": role, "content": _with_images(text, urls)}
        made = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls", i) if role == "assistant" else []
        if made:  # null and [] are no calls; any other value that is not an array is a 400
            chat["tool_calls"] = made
            calls.extend((c["id"], c["function"]["name"]) for c in made)
        if role == "tool":
            chat["tool_call_id"] = _answered_call(message, calls, i)
        out.append(chat)  # an assistant's earlier `thinking` is not sent back to the model
    return out, images


def _with_images(text: str, urls: list[str]) -> str | list[dict[str, Any]]:
    """The images first, then the text (where Ollama's templates put them)."""
    if not urls:
        return text
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [*parts, {"type": "text", "text": text}] if text else parts


def _images(value: Any, where: str) -> list[str]:
    """Base64 images (Ollama sends no media type: it is read from the bytes) as data: URLs."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array of base64-encoded images.", param=where)
    return [_data_url(image, f"{where}[{j}]") for j, image in enumerate(value)]


def _data_url(image: Any, where: str) -> str:
    if isinstance(image, str) and image.startswith("data:image/"):
        return image  # some clients send a data: URL already
    try:
        head = base64.b64decode(image[:16], validate=True) if isinstance(image, str) else b""
    except (binascii.Error, ValueError):
        head = b""
    media = next((kind for magic, kind in _IMAGE_MAGIC if head.startswith(magic)), None)
    if media is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        media = "image/webp"
    if media is None:
        raise bad_request(f"'{where}' must be a base64-encoded PNG, JPEG, GIF or WebP image.", param=where)
    return f"data:{media};base64,{image}"


def _named_images(
    messages: tuple[protocol.ChatMessage, ...], images: dict[tuple[int, int], str]
) -> tuple[protocol.ChatMessage, ...]:
    """Each image part's errors (not a vision model, undecodable) name Ollama's `images[j]`."""
    if not images:
        return messages
    out = list(messages)
    for m, message in enumerate(messages):
        parts, num_images = list(message.parts), 0
        for j, part in enumerate(parts):
            if isinstance(part, ImagePart):
                parts[j] = named(part, images.get((m, num_images), part.where))
                num_images += 1
        out[m] = replace(message, parts=tuple(parts))
    return tuple(out)


def _tool_calls(value: Any, where: str, index: int) -> list[dict[str, Any]]:
    """An assistant's earlier calls (arguments as an object) in OpenAI's shape, each with an id
    (Ollama's clients send none: the tool message answering it is matched by name)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array of tool calls.", param=where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        arguments = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
            raise bad_request(
                f'\'{where}[{j}]\' must be {{"function": {{"name": ..., "arguments": {{...}}}}}}.',
                param=f"{where}[{j}]",
            )
        text = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
        call_id = call.get("id") if isinstance(call.get("id"), str) and call["id"] else f"call_{index}_{j}"
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": text}})
    return out


def _answered_call(message: dict[str, Any], calls: list[tuple[str, str]], index: int) -> str:
    """The call a tool message answers: its `tool_call_id` when sent, else the first open call of
    its `tool_name`, else the first open call."""
    sent = message.get("tool_call_id")
    name = message.get("tool_name")
    if isinstance(sent, str) and sent:
        chosen = next((c for c in calls if c[0] == sent), (sent, ""))
    else:
        chosen = next((c for c in calls if c[1] == name), calls[0] if calls else (f"call_{index}", ""))
    if chosen in calls:
        calls.remove(chosen)
    return chosen[0]


def _tools(value: Any) -> list[Any]:
    """OpenAI's tool shape; Ollama's clients may leave out `"type": "function"`."""
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of function tools.", param="tools")
    return [{"type": "function", **t} if isinstance(t, dict) and "type" not in t else t for t in value]
