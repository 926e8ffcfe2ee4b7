"""Single request fields that several wire formats share (chat completions, Responses, Messages,
completions, embeddings): type checks with OpenAI's messages, stop strings, stream options,
metadata, service tier, reasoning effort and response_format. Each raises a 400 naming the field;
nothing here knows a whole request, tokenizes or touches the engine.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from api import tools as tooling
from api.errors import bad_request
from engine.types import StructuredKind, StructuredOutput

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's; one tier of service here
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_TITLE_CHARS = 200  # a conversation's title as a client sets it (create, update, import)


def kind_of(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def check_metadata(value: Any, param: str = "metadata") -> None:
    """OpenAI's `metadata`: null, or at most 16 string keys (64 characters) to strings (512).
    `param`: where the field is, as its errors name it (`data[2].metadata` in an import)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object of strings, got {kind_of(value)}.", param=param)
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"'{param}' may have at most {MAX_METADATA_PAIRS} keys, got {len(value)}.", param=param)
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"'{param}' keys are at most {MAX_METADATA_KEY_CHARS} characters; {key[:20]!r}... is longer.",
                param=param,
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"'{param}.{key}' must be a string of at most {MAX_METADATA_VALUE_CHARS} characters.",
                param=f"{param}.{key}",
            )


def check_service_tier(value: Any) -> None:
    if value is not None and value not in SERVICE_TIERS:
        raise bad_request(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}; got {value!r}.", param="service_tier"
        )


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
    tooling.check_nesting(schema, f"{where}.schema")
    # Objects that list their keys get no others, integers a bound (as a forced call's arguments): tools.tightened.
    text = tooling.schema_text(tooling.tightened(copy.deepcopy(schema), close_bare=False))
    tooling.check_schema(text, f"{where}.schema")
    return StructuredOutput(StructuredKind.JSON_SCHEMA, text)


def opt_str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {kind_of(value)}.", param=key)
    return value


def opt_bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {kind_of(value)}.", param=key)
    return value


def opt_int(raw: dict[str, Any], key: str, minimum: int) -> int | None:
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


def opt_float(raw: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number, got {value!r}.", param=key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo:g} and {hi:g}, got {value:g}.", param=key)
    return float(value)


MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI's range of each bias: -100 to 100)


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` -> (id, bias) pairs sorted by id; each bias in [-100, 100].
    Whether an id is in the model's vocabulary is checked by the backend (a 400 before the stream)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(
            f"'logit_bias' must be an object mapping token ids to biases, got {kind_of(value)}.", param="logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} token ids, got {len(value)}.", param="logit_bias"
        )
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise bad_request(
                f"'logit_bias' keys must be token ids (non-negative integers, as strings), got {key!r}.",
                param="logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias[{key}]' must be a number from -100 to 100, got {bias!r}.", param="logit_bias"
            )
        if int(key) in pairs:  # "05" and "5": their biases would add up past 100
            raise bad_request(f"'logit_bias' names the token id {int(key)} twice.", param="logit_bias")
        pairs[int(key)] = float(bias)
    return tuple(sorted(pairs.items()))


def parse_stop(value: Any) -> tuple[str, ...]:
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


def parse_stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
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
