"""The upstream wire format: the body we send, the chunks and errors we read, and counting."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from engine.types import ChatPrompt, FinishReason, GenerationRequest, RequestRejected, SamplingParams, UsageSource
from engine.upstream.counting import EstimatingCounter, TokenizerCounter
from engine.upstream.wire import (
    Chunk,
    ErrorKind,
    UpstreamError,
    classify_http_error,
    parse_chunk,
    request_body,
    request_path,
)


def make_request(sampling: SamplingParams, **options) -> GenerationRequest:
    chat = ChatPrompt(({"role": "user", "content": "hi"},), options)
    return GenerationRequest("req_1", (1, 2), sampling, chat=chat)


def test_the_body_always_streams_and_asks_for_usage_and_sends_only_what_was_asked():
    body = request_body(make_request(SamplingParams(max_tokens=16, temperature=0.0)), "Qwen/Qwen3-8B")
    assert body == {
        "model": "Qwen/Qwen3-8B",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
    }


def test_extensions_and_pass_through_options_are_sent_when_present():
    sampling = SamplingParams(
        max_tokens=8,
        seed=7,
        stop=("\n\n",),
        top_k=20,
        min_tokens=2,
        ignore_eos=True,
        presence_penalty=0.5,
        repetition_penalty=1.2,
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = request_body(make_request(sampling, tools=tools, response_format={"type": "json_object"}, n=2), "m")
    assert body["seed"] == 7 and body["stop"] == ["\n\n"] and body["top_k"] == 20
    assert body["min_tokens"] == 2 and body["ignore_eos"] is True and body["presence_penalty"] == 0.5
    assert body["repetition_penalty"] == 1.2
    assert body["tools"] == tools and body["response_format"] == {"type": "json_object"} and body["n"] == 2
    assert "frequency_penalty" not in body


def test_pass_through_fields_never_override_what_the_front_decided():
    body = request_body(make_request(SamplingParams(max_tokens=8), model="other", stream=False), "m")
    assert body["model"] == "m" and body["stream"] is True


def test_chunks_give_text_finish_and_usage():
    assert parse_chunk({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}) == Chunk("Hel")
    last = parse_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert last.finish_reason is FinishReason.LENGTH and last.text == "" and last.stop_str is None
    stopped = parse_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]})
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_str == "END"  # vLLM names the stop string
    by_token = parse_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": 151645}]})
    assert by_token.stop_str is None  # a stop token id is not a stop sequence
    usage = parse_chunk(
        {
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
        }
    ).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (12, 3, 8)
    no_details = parse_chunk(
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None}}
    ).usage
    assert no_details.cached_tokens == 0


def test_an_error_event_in_the_stream_is_an_upstream_error():
    error = parse_chunk({"error": {"message": "CUDA out of memory", "type": "server_error"}})
    assert isinstance(error, UpstreamError) and error.kind is ErrorKind.SERVER and "memory" in error.message


def test_http_errors_are_classified_with_the_upstreams_message():
    client = classify_http_error(
        400, b'{"error": {"message": "too long", "code": "context_length_exceeded", "param": "messages"}}', None
    )
    assert client.kind is ErrorKind.CLIENT
    rejected = client.rejected()
    assert isinstance(rejected, RequestRejected) and rejected.message == "too long" and rejected.param == "messages"
    vllm_style = classify_http_error(400, b'{"object": "error", "message": "bad top_k", "code": 400}', None)
    assert vllm_style.kind is ErrorKind.CLIENT and vllm_style.message == "bad top_k"
    assert classify_http_error(429, b"{}", "7").retry_after_s == 7.0
    assert classify_http_error(429, b"{}", None).kind is ErrorKind.BUSY
    assert classify_http_error(401, b"{}", None).kind is ErrorKind.CONFIG
    assert classify_http_error(502, b"<html>bad gateway</html>", None).kind is ErrorKind.SERVER


def test_the_estimating_counter_counts_about_four_bytes_a_token_and_keeps_prompts_apart():
    counter = EstimatingCounter()
    assert counter.usage_source is UsageSource.ESTIMATE
    assert counter.count("abcdefgh") == 2 and counter.count("abcdefghi") == 3
    a = counter.encode_chat([{"role": "user", "content": "hello there"}])
    b = counter.encode_chat([{"role": "user", "content": "hello where"}])
    assert a != b and len(a) == len(b)
    assert counter.decode(counter.encode("Ünïcödé ok")) == "Ünïcödé ok"


def test_the_tokenizer_counter_counts_with_the_models_own_tokenizer(tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    counter = TokenizerCounter(tokenizer)
    messages = [{"role": "user", "content": "What does the word river mean?"}]
    assert counter.usage_source is UsageSource.TOKENIZER
    assert counter.encode_chat(messages) == tokenizer.encode_chat(messages)
    assert counter.count("A river is a large natural stream.") == len(
        tokenizer.encode("A river is a large natural stream.")
    )
    assert len(counter.encode_chat(messages, tools=[{"type": "function"}])) > len(counter.encode_chat(messages))


def test_what_cannot_be_relayed_is_refused_naming_the_field():
    from types import SimpleNamespace

    from engine.upstream.wire import unsupported_reason

    def req(options: dict) -> SimpleNamespace:
        return SimpleNamespace(
            chat=ChatPrompt(({"role": "user", "content": "hi"},), options),
            sampling=SimpleNamespace(structured=None, logprobs=None),
        )

    assert unsupported_reason(req({"logprobs": True, "top_logprobs": 3})) is None  # relayed (test_logprobs_*)
    grammar_only = SimpleNamespace(chat=ChatPrompt(()), sampling=SimpleNamespace(structured="grammar", logprobs=None))
    assert unsupported_reason(grammar_only)[1] == "response_format"
    forced = SimpleNamespace(
        chat=ChatPrompt((), {"tools": [], "tool_choice": "required"}),
        sampling=SimpleNamespace(structured="grammar", logprobs=None),
    )
    assert unsupported_reason(forced) is None  # the upstream forces the call itself
    echo = SimpleNamespace(chat=ChatPrompt((), prompt="hi"), sampling=SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert unsupported_reason(echo)[1] == "echo"  # the prompt's logprobs: the native engine only
    assert (
        unsupported_reason(make_request(SamplingParams(max_tokens=4), response_format={"type": "json_object"})) is None
    )


def test_streamed_tool_calls_become_the_hermes_text_our_parser_reads():
    from engine.upstream.wire import ToolCallDelta, tool_calls_text

    first = parse_chunk(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    },
                }
            ]
        }
    )
    second = parse_chunk(
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}}]}
    )
    assert first.tool_calls == (ToolCallDelta(0, "get_weather", ""),)
    assert second.tool_calls == (ToolCallDelta(0, "", '{"city": "Par'),)
    text = tool_calls_text({0: ["get_weather", '{"city": "Paris"}'], 1: ["f", "{}"]})
    assert text == (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'
    )


def test_chat_template_kwargs_are_sent_upstream_in_wire_form():
    from api.protocol import parse_chat_request, wire_options

    chat = parse_chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
        max_messages=10,
        max_prompt_chars=1000,
    )
    assert wire_options(chat)["chat_template_kwargs"] == {"enable_thinking": False}


def test_a_thinking_budget_is_sent_upstream_under_vllms_name():
    from api.protocol import parse_chat_request, wire_options

    def options(**extra) -> dict:
        raw = {"messages": [{"role": "user", "content": "hi"}], **extra}
        return wire_options(parse_chat_request(raw, max_messages=10, max_prompt_chars=1000))

    assert options(thinking_token_budget=0)["thinking_token_budget"] == 0
    assert "thinking_token_budget" not in options()


def test_logprobs_are_asked_for_and_the_upstreams_text_tokens_are_read_with_their_bytes():
    from engine.types import TokenLogprob, TokenText

    body = request_body(make_request(SamplingParams(max_tokens=4, logprobs=2)), "m")
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert "logprobs" not in request_body(make_request(SamplingParams(max_tokens=4)), "m")
    chunk = parse_chunk(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " riv"},
                    "logprobs": {
                        "content": [
                            {
                                "token": " riv",
                                "logprob": -0.25,
                                "bytes": [32, 114, 105, 118],
                                "top_logprobs": [
                                    {"token": " riv", "logprob": -0.25, "bytes": [32, 114, 105, 118]},
                                    {"token": "\\xe2", "logprob": -3.0, "bytes": [226]},
                                    {"token": "bad"},
                                ],
                            },
                            {"token": "no logprob"},
                        ]
                    },
                }
            ]
        }
    )
    assert chunk.text == " riv"
    assert chunk.logprobs == (
        TokenLogprob(
            None,
            -0.25,
            ((TokenText(" riv", (32, 114, 105, 118)), -0.25), (TokenText("\\xe2", (226,)), -3.0)),
            TokenText(" riv", (32, 114, 105, 118)),
        ),
    )
    assert parse_chunk({"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None}]}).logprobs == ()


def test_a_raw_prompt_goes_to_the_upstreams_completions_with_legacy_logprobs():
    chat = ChatPrompt((), {"response_format": {"type": "json_object"}}, prompt="Once upon a time")
    request = GenerationRequest("req_1", (1, 2), SamplingParams(max_tokens=8, logprobs=3), chat=chat)
    assert request_path(request) == "/completions"
    assert request_body(request, "m") == {
        "model": "m",
        "prompt": "Once upon a time",
        "response_format": {"type": "json_object"},
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "logprobs": 3,
    }
    assert request_path(make_request(SamplingParams(max_tokens=8))) == "/chat/completions"


def test_a_legacy_completion_chunk_gives_its_text_and_logprobs():
    payload = {
        "choices": [
            {
                "index": 0,
                "text": " there",
                "logprobs": {
                    "tokens": [" there"],
                    "token_logprobs": [-0.25],
                    "top_logprobs": [{" there": -0.25, " here": -1.5}],
                    "text_offset": [5],
                },
                "finish_reason": "length",
            }
        ]
    }
    chunk = parse_chunk(payload)
    assert isinstance(chunk, Chunk) and chunk.text == " there" and chunk.finish_reason is FinishReason.LENGTH
    (lp,) = chunk.logprobs
    assert lp.token.text == " there" and lp.logprob == -0.25
    assert [(t.text, v) for t, v in lp.top_logprobs] == [(" there", -0.25), (" here", -1.5)]


def test_logit_bias_is_relayed_with_its_ids_as_strings():
    body = request_body(make_request(SamplingParams(max_tokens=8, logit_bias=((5, -100.0), (17, 2.5)))), "m")
    assert body["logit_bias"] == {"5": -100.0, "17": 2.5}
    assert "logit_bias" not in request_body(make_request(SamplingParams(max_tokens=8)), "m")
