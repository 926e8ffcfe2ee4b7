"""Tool-call formats: the streaming parser on each format's text, split at every character, and
the forced-call grammar of each format accepting what the parser reads back."""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance
import pytest
from tokenizers import Tokenizer

from api.errors import ApiError
from api.fields import parse_response_format
from api.toolparse import ToolCallParser
from api.tools import ChoiceMode, Tool, ToolChoice, ToolFormat, detect_format, forced_call_grammar, parse_tools
from engine.grammar import grammar_text
from engine.types import StructuredOutput

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
NAMES = frozenset(t.name for t in TOOLS)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEXTS = {
    ToolFormat.HERMES: f"Let me check.<tool_call>\n{CALL}\n</tool_call><tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>',
    ToolFormat.MISTRAL: f'Let me check.[TOOL_CALLS][{CALL}, {{"name": "get_time", "arguments": {{}}}}]',
    ToolFormat.LLAMA3_JSON: (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    ),
}


def run(fmt: ToolFormat, text: str, step: int, *, forced: bool = False, forced_name: str | None = None):
    parser = ToolCallParser(fmt, NAMES, forced=forced, forced_name=forced_name)
    content, calls = "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        content, calls = content + out.content, calls + out.calls
    out = parser.close()
    return content + out.content, calls + out.calls


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_each_format_parses_two_calls_whatever_the_chunking(fmt, step):
    content, calls = run(fmt, TEXTS[fmt], step)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and json.loads(calls[1].arguments) == {}
    assert content == ("" if fmt is ToolFormat.LLAMA3_JSON else "Let me check.")
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_plain_text_and_broken_calls_stay_content(fmt):
    assert run(fmt, "Paris is sunny <tool and {fine}.", 2) == ("Paris is sunny <tool and {fine}.", [])
    broken = {
        ToolFormat.HERMES: "<tool_call>{not json}</tool_call>",
        ToolFormat.MISTRAL: "[TOOL_CALLS][{oops",
        ToolFormat.LLAMA3_JSON: '{"name": "unknown_tool", "parameters": {}}',
    }[fmt]
    assert run(fmt, broken, 4) == (broken, [])


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_forced_call_the_length_limit_cut_is_a_call_not_markup_in_the_content(fmt):
    """OpenAI's shape for a forced call cut by max_tokens: the call, its arguments as far as they
    got, finish_reason length. The unterminated markup came back as the answer's text."""
    whole = TEXTS[fmt].removeprefix("Let me check.")
    first_args = whole.index('"Par')
    content, calls = run(fmt, whole[:first_args], 3, forced=True)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments.replace(" ", "") == '{"city":'
    content, calls = run(fmt, whole[: whole.index("get_weather") - 2], 3, forced=True)
    assert (content, calls) == ("", [])  # cut before the name: nothing to call, and still no markup
    content, calls = run(fmt, whole[: whole.index("get_weather") - 2], 3, forced=True, forced_name="get_weather")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", "")]  # the only one it can be
    args_end = whole.index('"Paris"}') + len('"Paris"}')
    content, calls = run(fmt, whole[: args_end + 2], 3, forced=True)  # the arguments whole, the call's end cut
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Paris"}
    content, calls = run(fmt, whole, 5, forced=True)  # whole calls parse as they always did
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]


def test_no_parameters_schema_means_an_object_without_arguments():
    """`"parameters": {}` (OpenAI's "no parameters"): as a grammar it allowed any JSON value, and
    a forced call came back as a string of arguments and no call."""
    (tool,) = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert json.loads(tool.parameters) == {"type": "object", "properties": {}}
    (typed,) = parse_tools([{"type": "function", "function": {"name": "g", "parameters": {"properties": {}}}}])
    assert json.loads(typed.parameters)["type"] == "object"


def test_the_format_is_read_from_the_template_unless_set():
    assert detect_format("{{ '[TOOL_CALLS]' }}", "auto") is ToolFormat.MISTRAL
    assert detect_format("<tool_call>{{ x }}</tool_call>", "auto") is ToolFormat.HERMES
    assert detect_format("<|python_tag|>", "auto") is ToolFormat.LLAMA3_JSON
    assert detect_format("plain", "auto") is ToolFormat.HERMES
    assert detect_format("<tool_call>", "mistral") is ToolFormat.MISTRAL


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_the_forced_grammar_accepts_the_format_and_refuses_other_text(fmt, tiny_model_dir):
    text = TEXTS[fmt].removeprefix("Let me check.")
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    llt = llguidance.LLTokenizer(tok.to_str())
    grammar = grammar_text(forced_call_grammar(TOOLS, ToolChoice(ChoiceMode.REQUIRED), fmt, True))
    compact = text.replace(": ", ":").replace(", ", ",").replace("; ", ";")  # the grammar writes compact JSON
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    assert matcher.consume_tokens(tok.encode(compact).ids) and not matcher.is_error(), matcher.get_error()
    named = grammar_text(forced_call_grammar(TOOLS, ToolChoice(ChoiceMode.NAMED, "get_time"), fmt, True))
    refused = llguidance.LLMatcher(llt, named, log_level=0)
    assert not refused.consume_tokens(tok.encode(compact).ids)  # get_weather is not allowed there


def test_a_tools_references_are_rebased_but_its_data_and_names_are_not():
    params = {
        "type": "object",
        "properties": {
            "$ref": {"type": "string"},  # a property named "$ref"
            "default": {"$ref": "#/$defs/default"},
            "loop": {"$ref": "#"},
            "kind": {"const": {"$ref": "#/not/a/reference"}},
        },
        "$defs": {"default": {"enum": ["a", {"$ref": "#"}]}},
    }
    tool = Tool("t", None, json.dumps(params))
    fmt = ToolFormat.LLAMA3_JSON
    grammar = forced_call_grammar((tool,), ToolChoice(ChoiceMode.REQUIRED), fmt, False).spec
    envelope = json.loads(grammar.split("%json ", 1)[1])
    rebased = envelope["$defs"]["tool_0"]
    assert rebased["properties"]["$ref"] == {"type": "string"}
    assert rebased["properties"]["default"] == {"$ref": "#/$defs/tool_0/$defs/default"}
    assert rebased["properties"]["loop"] == {"$ref": "#/$defs/tool_0"}
    assert rebased["properties"]["kind"] == params["properties"]["kind"]
    assert rebased["$defs"]["default"] == params["$defs"]["default"]


def test_a_forced_calls_objects_are_closed_unless_they_say_otherwise():
    """Plain JSON Schema lets an object take any other key; under a forced call that lets a
    model never close the call, so objects without `additionalProperties` are closed."""
    params = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property so named
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        },
    }
    tool = Tool("t", None, json.dumps(params))
    grammar = forced_call_grammar((tool,), ToolChoice(ChoiceMode.REQUIRED), ToolFormat.LLAMA3_JSON, False).spec
    closed = json.loads(grammar.split("%json ", 1)[1])["$defs"]["tool_0"]
    assert closed["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "open", "tags"}  # no key added among the names
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert json.loads(tool.parameters) == params  # the tool itself is unchanged (what the template shows)


def test_objects_combined_with_all_of_or_requiring_unlisted_keys_stay_open_and_compile():
    b = {"type": "string"}
    schemas = [
        {"type": "object", "allOf": [{"properties": {"a": b}, "required": ["a"]}, {"properties": {"b": b}}]},
        {"type": "object", "properties": {"a": b}, "allOf": [{"properties": {"b": b}, "required": ["b"]}]},
        {"type": "object", "properties": {"a": b}, "required": ["a", "b"]},
    ]
    for params in schemas:
        tool = Tool("t", None, json.dumps(params))
        structured = forced_call_grammar((tool,), ToolChoice(ChoiceMode.REQUIRED), ToolFormat.HERMES, False)
        grammar_text(structured)  # compiles: no part closed against another's keys
        rebased = json.loads(structured.spec.split("%json ", 1)[1].rsplit('"\\n</tool_call>"', 1)[0])
        assert "additionalProperties" not in json.dumps(rebased["$defs"]["tool_0"])


def test_a_bare_object_schema_is_closed_to_no_arguments():
    tool = Tool("now", None, json.dumps({"type": "object"}))
    spec = forced_call_grammar((tool,), ToolChoice(ChoiceMode.REQUIRED), ToolFormat.LLAMA3_JSON, False).spec
    closed = json.loads(spec.split("%json ", 1)[1])["$defs"]["tool_0"]
    assert closed == {"type": "object", "additionalProperties": False}


def format_accepts(schema: dict, model_dir) -> tuple[StructuredOutput, Callable[[str], bool]]:
    """The response format for `schema`, and whether its grammar takes a text whole (in the tiny model's tokens)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    llt = llguidance.LLTokenizer(tok.to_str())
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert fmt is not None
    grammar = grammar_text(fmt)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
        return matcher.consume_tokens(tok.encode(text).ids) and not matcher.is_error()

    return fmt, accepts


@pytest.mark.parametrize(
    ("schema", "extra_key_allowed"),
    [
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, False),  # pydantic's shape
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, True),
        ({"type": "object"}, True),  # a bare object: any JSON object, as json_object gives
    ],
)
def test_a_response_formats_objects_that_list_their_keys_get_no_others(schema, extra_key_allowed, tiny_model_dir):
    """As a forced call's arguments: plain JSON Schema would let a model keep adding keys (the demo
    model wrote `{"name":..., "population":8, "IGPLet's...":892, ...}` to max_tokens)."""
    _, accepts = format_accepts(schema, tiny_model_dir)
    assert accepts('{"a":1}')
    assert accepts('{"a":1,"b":2}') is extra_key_allowed
    assert "additionalProperties" not in json.dumps(schema) or schema.get("additionalProperties") is True  # unchanged


def test_integers_without_bounds_get_the_safe_range_and_bounds_given_stay(tiny_model_dir):
    """A small model repeating digits would otherwise write one number until max_tokens."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"], "minimum": 5}},
        "required": ["n"],
    }
    fmt, accepts = format_accepts(schema, tiny_model_dir)
    tightened = json.loads(fmt.spec)["properties"]
    assert tightened["n"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert tightened["m"]["minimum"] == 5 and tightened["m"]["maximum"] == 2**53 - 1
    assert accepts('{"n":9007199254740991}') and accepts('{"n":-42,"m":null}')
    assert not accepts('{"n":9007199254740992}') and not accepts('{"n":1,"m":4}')


def test_a_schemas_properties_are_written_in_the_order_given_and_a_tool_shows_its_own_order(tiny_model_dir):
    """A "reasoning" property placed before its "answer" is generated first (they were sorted by name)."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
    }
    _, accepts = format_accepts(schema, tiny_model_dir)
    assert accepts('{"reasoning":"two and two","answer":4}')
    assert not accepts('{"answer":4,')
    (tool,) = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert list(json.loads(tool.parameters)) == ["type", "properties", "required"]
    assert list(json.loads(tool.parameters)["properties"]) == ["reasoning", "answer"]


@pytest.mark.parametrize("required", [[["a"]], [{"x": 1}], [5]])
def test_a_response_format_whose_required_holds_no_names_is_a_400_naming_the_schema(required):
    """An unhashable entry was looked up among the properties while closing the object (a 500)."""
    schema = {"type": "object", "properties": {"a": {}}, "required": required}
    with pytest.raises(ApiError) as exc:
        parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert exc.value.status == 400 and exc.value.param == "response_format.json_schema.schema"


def _deep_schema() -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(400):  # schemas inside schemas: the copy before closing them recursed
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _deep_data() -> dict:
    value: list = []
    for _ in range(990):  # data, within what the body's parser reads: the schema's JSON text recursed
        value = [value]
    return {"type": "object", "properties": {"a": {"enum": [value]}}}


@pytest.mark.parametrize("make_schema", [_deep_schema, _deep_data])
def test_a_schema_nested_past_what_is_walked_is_a_400_for_a_response_format_and_a_tool(make_schema):
    """Each was a RecursionError (a 500)."""
    schema = make_schema()
    with pytest.raises(ApiError) as exc:
        parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert exc.value.status == 400 and "nests too deeply" in exc.value.message
    with pytest.raises(ApiError) as exc:
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert exc.value.status == 400 and exc.value.param == "tools[0].function.parameters"


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "integer", "minimum": 2**53}, str(2**53 + 7)),
        ({"type": "integer", "exclusiveMaximum": -(2**53)}, str(-(2**53) - 7)),
        ({"type": ["integer", "null"], "minimum": 10**16}, str(10**16)),
        ({"type": "integer", "const": 2**60}, str(2**60)),
        ({"type": "integer", "enum": [2**60, -(2**60)]}, str(-(2**60))),
    ],
)
def test_integers_listed_or_bounded_beyond_the_safe_range_keep_their_values(schema, value, tiny_model_dir):
    """The safe bound was added beside them: no value satisfied the schema, a 400 for a valid one."""
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert fmt is not None
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tok.to_str()), grammar_text(fmt), log_level=0)
    assert matcher.consume_tokens(tok.encode(value).ids) and not matcher.is_error()
