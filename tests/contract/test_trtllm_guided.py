"""TensorRT-LLM's guided decoding and logprobs through the adapter, on the stand-in `tensorrt_llm`.

The mapping (engine/trtllm/mapping.py) is checked against plain objects of TensorRT-LLM 1.x's
shapes; the stand-in then masks its toy model with the real llguidance the way TensorRT-LLM's
llguidance backend does, so a schema's answer must validate whatever the toy model picks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from api.tools import ChoiceMode, Tool, ToolChoice, ToolFormat, forced_call_grammar
from contract_harness import (
    PROMPT_TEXT,
    check_stream_shape,
    collect,
    joined_text,
    make_request,
)
from engine.tokenizer import Tokenizer
from engine.trtllm.backend import TrtllmBackend
from engine.trtllm.mapping import (
    UNKNOWN_LOGPROB,
    guided_decoding_kwargs,
    llm_kwargs,
    sampling_kwargs,
    token_logprobs,
    unsupported_reason,
)
from engine.types import (
    FinishReason,
    RequestRejected,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
)
from settings import ConfigError, TrtllmConfig

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
WEATHER = Tool(
    "get_weather",
    None,
    json.dumps(
        {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        }
    ),
)


def structured_schema() -> StructuredOutput:
    return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))


def forced_weather() -> StructuredOutput:
    return forced_call_grammar((WEATHER,), ToolChoice(ChoiceMode.NAMED, "get_weather"), ToolFormat.HERMES, False)


# ---- the mapping, on plain values --------------------------------------------------------


def test_llguidance_gets_json_schemas_compact_and_lark_grammars_as_grammar():
    guide = guided_decoding_kwargs(structured_schema(), "llguidance")
    assert json.loads(guide["json"]) == {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    obj = guided_decoding_kwargs(StructuredOutput(StructuredKind.JSON_OBJECT), "llguidance")
    assert json.loads(obj["json"])["type"] == "object"
    assert guided_decoding_kwargs(forced_weather(), "llguidance") == {"grammar": forced_weather().spec}


def test_xgrammar_gets_json_object_and_the_schema_as_sent():
    assert guided_decoding_kwargs(StructuredOutput(StructuredKind.JSON_OBJECT), "xgrammar") == {"json_object": True}
    assert guided_decoding_kwargs(structured_schema(), "xgrammar") == {"json": json.dumps(SCHEMA)}


def test_forced_tool_calls_need_llguidance_and_none_refuses_everything():
    assert "llguidance" in unsupported_reason(forced_weather(), "xgrammar")
    assert unsupported_reason(structured_schema(), "xgrammar") is None
    assert "none" in unsupported_reason(structured_schema(), "none")
    with pytest.raises(ValueError, match="forced tool calls"):
        guided_decoding_kwargs(forced_weather(), "xgrammar")


def test_logprobs_ask_tensorrt_llm_for_at_least_one_because_zero_means_off_there():
    assert sampling_kwargs(SamplingParams(max_tokens=4, logprobs=0), ())["logprobs"] == 1
    assert sampling_kwargs(SamplingParams(max_tokens=4, logprobs=5), ())["logprobs"] == 5
    assert "logprobs" not in sampling_kwargs(SamplingParams(max_tokens=4), ())


def test_token_logprobs_read_dicts_of_logprob_objects_and_bare_floats():
    lp = SimpleNamespace  # the shape of tensorrt_llm.executor.result.Logprob(logprob, rank)
    entries = [{7: lp(logprob=-0.1, rank=1), 9: lp(logprob=-2.5, rank=2), 3: lp(logprob=-1.5, rank=3)}, -0.75]
    first, second = token_logprobs((7, 4), entries, num_top=2)
    assert (first.token_id, first.logprob, first.top_logprobs) == (7, -0.1, ((7, -0.1), (3, -1.5)))
    assert (second.token_id, second.logprob, second.top_logprobs) == (4, -0.75, ())


def test_a_sampled_token_outside_the_returned_top_k_reads_openais_floor():
    (only,) = token_logprobs((5,), [{8: SimpleNamespace(logprob=-0.2, rank=1)}], num_top=1)
    assert only.logprob == UNKNOWN_LOGPROB and only.top_logprobs == ((8, -0.2),)


def test_llm_gets_the_guided_decoding_backend_unless_it_is_none(standin_trtllm):
    from engine.trtllm.backend import load_api

    api = load_api()
    on = llm_kwargs(api, Path("/m"), TrtllmConfig(guided_decoding_backend="xgrammar"), 64)
    off = llm_kwargs(api, Path("/m"), TrtllmConfig(guided_decoding_backend="none"), 64)
    assert on["guided_decoding_backend"] == "xgrammar" and "guided_decoding_backend" not in off


def test_an_unknown_guided_decoding_backend_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="guided_decoding_backend"):
        TrtllmBackend(
            tiny_model_dir,
            TrtllmConfig(guided_decoding_backend="outlines"),
            Tokenizer.from_dir(tiny_model_dir),
            max_model_len=512,
        )


# ---- through the adapter and the stand-in ---------------------------------------------------


@pytest.fixture
async def backend(standin_trtllm, tiny_model_dir):
    started: list[TrtllmBackend] = []

    async def start(**config) -> TrtllmBackend:
        config = {"max_batch_size": 8, "max_num_tokens": 256, "stats_interval_s": 0.05, **config}
        b = TrtllmBackend(tiny_model_dir, TrtllmConfig(**config), Tokenizer.from_dir(tiny_model_dir), max_model_len=512)
        await b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        await b.shutdown()


def guided_request(b: TrtllmBackend, structured: StructuredOutput, **sampling):
    # EOS is honoured (the grammar ends on it), unlike the harness's default.
    prompt = b._tokenizer.encode(PROMPT_TEXT)
    request = make_request(prompt, max_tokens=96, structured=structured, **sampling)
    return type(request)(
        request.request_id,
        request.prompt_token_ids,
        type(request.sampling)(**{**_fields(request.sampling), "ignore_eos": False}),
    )


def _fields(sampling: SamplingParams) -> dict:
    return {name: getattr(sampling, name) for name in sampling.__slots__}


async def test_a_json_schema_answer_validates_under_tensorrt_llms_llguidance_backend(backend):
    b = await backend()
    request = guided_request(b, structured_schema())
    b.check_request(request)
    events = await collect(b, request)
    final = check_stream_shape(events, request)
    assert final.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(joined_text(events)), SCHEMA)
    guide = b._llm.submissions[-1].sampling_params.guided_decoding
    assert type(guide).__name__ == "GuidedDecodingParams" and json.loads(guide.json)["required"] == ["ok", "size"]


async def test_a_forced_tool_call_grammar_decodes_to_a_call_whose_arguments_validate(backend):
    b = await backend()
    request = guided_request(b, forced_weather())
    text = joined_text(await collect(b, request))
    match = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.DOTALL)
    assert match is not None, text
    call = json.loads(match.group(1))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], json.loads(WEATHER.parameters))


async def test_structured_requests_are_refused_with_a_400_where_the_backend_cannot_decode_them(backend):
    xgrammar = await backend(guided_decoding_backend="xgrammar")
    with pytest.raises(RequestRejected) as refused:
        xgrammar.check_request(guided_request(xgrammar, forced_weather()))
    assert refused.value.param == "tool_choice" and refused.value.code == "unsupported_value"
    xgrammar.check_request(guided_request(xgrammar, structured_schema()))  # JSON schemas are fine there
    off = await backend(guided_decoding_backend="none")
    with pytest.raises(RequestRejected) as refused:
        off.check_request(guided_request(off, structured_schema()))
    assert refused.value.param == "response_format"


async def test_logprobs_arrive_one_per_token_with_top_alternatives_best_first(backend):
    b = await backend()
    request = make_request(b._tokenizer.encode(PROMPT_TEXT), max_tokens=6, logprobs=3)
    b.check_request(request)
    events = await collect(b, request)
    assert b._llm.submissions[-1].sampling_params.logprobs == 3
    # A token's logprob rides with its text (engine/detokenizer.py's LogprobGate): paired over the stream.
    token_ids, logprobs = [t for e in events for t in e.token_ids], [lp for e in events for lp in e.logprobs]
    pairs = list(zip(token_ids, logprobs, strict=True))
    assert len(pairs) == 6
    for token_id, lp in pairs:
        assert lp.token_id == token_id and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0] == (token_id, lp.logprob)  # greedy: the chosen token is the likeliest
        assert [v for _, v in lp.top_logprobs] == sorted((v for _, v in lp.top_logprobs), reverse=True)


async def test_no_logprobs_are_asked_for_or_returned_unless_requested(backend):
    b = await backend()
    request = make_request(b._tokenizer.encode(PROMPT_TEXT), max_tokens=4)
    events = await collect(b, request)
    assert b._llm.submissions[-1].sampling_params.logprobs is None
    assert all(e.logprobs == () for e in events)
