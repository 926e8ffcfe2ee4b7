"""Every validation rule of the chat request, and the wire shapes we render."""

from __future__ import annotations

import math

import pytest

from api.chat_bodies import chunk_body, completion_body, usage_chunk_body, usage_dict
from api.errors import ApiError
from api.protocol import parse_chat_request

MSG = [{"role": "user", "content": "hi"}]


def parse(body):
    return parse_chat_request(body, max_messages=8, max_prompt_chars=100)


def rejects(body, param):
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param, err.message
    assert err.message
    return err


def test_minimal_request_gets_openai_defaults():
    req = parse({"model": "m", "messages": MSG})
    assert req.temperature == 1.0 and req.top_p == 1.0 and req.top_k is None
    assert req.max_tokens is None and req.stop == () and not req.stream and not req.include_usage
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"


def test_content_as_list_of_text_parts_is_joined():
    req = parse(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert req.messages[0].content == "ab"


def test_developer_role_is_treated_as_system_and_null_assistant_content_as_empty():
    req = parse({"messages": [{"role": "developer", "content": "x"}, {"role": "assistant", "content": None}, *MSG]})
    assert [m.role for m in req.messages] == ["system", "assistant", "user"]
    assert req.messages[1].content == ""


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7


def test_stop_accepts_a_string_or_up_to_four_strings():
    assert parse({"messages": MSG, "stop": "x"}).stop == ("x",)
    assert parse({"messages": MSG, "stop": ["a", "b", "c", "d"]}).stop == ("a", "b", "c", "d")


def test_top_k_zero_or_minus_one_means_off():
    assert parse({"messages": MSG, "top_k": 0}).top_k is None
    assert parse({"messages": MSG, "top_k": -1}).top_k is None
    assert parse({"messages": MSG, "top_k": 5}).top_k == 5


def test_stream_options_include_usage_is_read_when_streaming():
    assert parse({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}).include_usage


def test_continuous_usage_stats_needs_include_usage():
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse({"messages": MSG, "stream": True, "stream_options": both}).continuous_usage
    alone = {"continuous_usage_stats": True}
    assert not parse({"messages": MSG, "stream": True, "stream_options": alone}).continuous_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ("not an object", None),
        ([1, 2], None),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{}]}, "messages[0].role"),
        ({"messages": ["x"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),  # unhashable: was a 500
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": MSG * 9}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 101}]}, "messages"),
        ({"messages": MSG, "model": 3}, "model"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "temperature": 2.5}, "temperature"),
        ({"messages": MSG, "temperature": math.nan}, "temperature"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": MSG, "temperature": True}, "temperature"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "top_p": 1.5}, "top_p"),
        ({"messages": MSG, "top_k": -2}, "top_k"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": -1}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": MSG, "frequency_penalty": -3}, "frequency_penalty"),
        ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": MSG, "repetition_penalty": -1.2}, "repetition_penalty"),
        ({"messages": MSG, "repetition_penalty": "high"}, "repetition_penalty"),
        ({"messages": MSG, "repetition_penalty": math.inf}, "repetition_penalty"),
        ({"messages": MSG, "n": 2}, "n"),
        ({"messages": MSG, "n": 0}, "n"),
        ({"messages": MSG, "stop": ["a"] * 5}, "stop"),
        ({"messages": MSG, "stop": [""]}, "stop"),
        ({"messages": MSG, "stop": 7}, "stop"),
        ({"messages": MSG, "stream": "yes"}, "stream"),
        ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": MSG, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
            "stream_options.continuous_usage_stats",
        ),
        ({"messages": MSG, "seed": "x"}, "seed"),
        ({"messages": MSG, "min_tokens": -1}, "min_tokens"),
        ({"messages": MSG, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"messages": MSG, "ignore_eos": "no"}, "ignore_eos"),
        ({"messages": MSG, "user": 1}, "user"),
        ({"messages": MSG, "conversation_id": 1}, "conversation_id"),
        ({"messages": MSG, "frobnicate": 1}, "frobnicate"),
        ({"messages": MSG, "logprobs": "yes"}, "logprobs"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": MSG, "prompt_cache_key": 7}, "prompt_cache_key"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"messages": MSG, "safety_identifier": ["u"]}, "safety_identifier"),
        ({"messages": MSG, "verbosity": "extreme"}, "verbosity"),
        ({"messages": MSG, "service_tier": "bogus"}, "service_tier"),
        ({"messages": MSG, "logit_bias": {"05": 100, "5": 100}}, "logit_bias"),  # one id twice: 200 in all
    ],
)
def test_invalid_request_is_a_400_naming_the_field(body, param):
    rejects(body, param)


def test_harmless_defaults_of_unsupported_fields_are_accepted():
    parse({"messages": MSG, "logprobs": False, "tools": None, "response_format": {"type": "text"}, "store": False})


def test_newer_openai_fields_without_effect_here_are_accepted():
    """What current SDKs and Codex-style clients send: refusing them kept those clients out."""
    parse({"messages": MSG, "prompt_cache_key": "thread-7", "safety_identifier": "user-hash", "verbosity": "low"})


def test_completion_body_has_openai_shape():
    usage = usage_dict(10, 4, 3, 0.001)
    body = completion_body("chatcmpl-x", "m", 1, "hello", "stop", usage, {})
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    assert body["usage"]["total_tokens"] == 13
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_chunks_carry_null_usage_until_the_usage_chunk():
    chunk = chunk_body("chatcmpl-x", "m", 1, {"content": "a"}, None, True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert "usage" not in chunk_body("chatcmpl-x", "m", 1, {}, "stop", False)
    last = usage_chunk_body("chatcmpl-x", "m", 1, usage_dict(1, 0, 1, None))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 2
