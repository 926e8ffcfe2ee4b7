"""Structured outputs and logprobs in the native engine, on a random-weight tiny model.

Only the grammar can make a random model's answer valid JSON, so these tests show the mask
is applied at every step; logprobs are checked against the greedy choice.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer

from engine.grammar import GrammarError, grammar_text, schema_text
from engine.native.llm_engine import LLMEngine
from engine.types import GenerationRequest, SamplingParams, StructuredKind, StructuredOutput
from native_harness import ON_DEVICE
from settings import EngineConfig

VARIANT = "tied-gqa-parameters"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_models) -> LLMEngine:
    config = EngineConfig(**ON_DEVICE, kv_cache_bytes=64 * 8192, max_num_batched_tokens=64, max_num_seqs=4)
    eos = Tokenizer.from_file(str(tiny_models.path(VARIANT) / "tokenizer.json")).token_to_id("<|im_end|>")
    return LLMEngine.from_model_dir(tiny_models.path(VARIANT), config, eos_token_ids=(eos,))


def generate(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], list]]:
    out: dict[str, tuple[list[int], list]] = {r.request_id: ([], []) for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs)
    return out


def decode(tiny_models, ids: list[int]) -> str:
    return Tokenizer.from_file(str(tiny_models.path(VARIANT) / "tokenizer.json")).decode(ids)


def request(request_id: str, structured: StructuredOutput | None, **kw) -> GenerationRequest:
    sampling = SamplingParams(
        max_tokens=kw.pop("max_tokens", 120), temperature=kw.pop("temperature", 0.0), structured=structured, **kw
    )
    return GenerationRequest(request_id, (5, 6, 7, 8, 9), sampling)


def test_a_json_schema_answer_from_a_random_model_validates_and_free_rows_are_untouched(engine, tiny_models):
    schema = StructuredOutput(StructuredKind.JSON_SCHEMA, schema_text(SCHEMA))
    free_alone = generate(engine, [request("free-alone", None, max_tokens=20)])["free-alone"][0]
    out = generate(
        engine,
        [
            request("greedy", schema),
            request("sampled", schema, temperature=1.0, seed=3),
            request("free", None, max_tokens=20),
        ],
    )
    for request_id in ("greedy", "sampled"):
        jsonschema.validate(json.loads(decode(tiny_models, out[request_id][0])), SCHEMA)
    assert out["free"][0] == free_alone  # a constrained neighbour does not change a free row


def test_json_object_mode_answers_that_finish_are_objects(engine, tiny_models):
    # A random model may fill a string until max_tokens; every answer that ends must be an object.
    mode = StructuredOutput(StructuredKind.JSON_OBJECT)
    out = generate(engine, [request(f"obj{s}", mode, max_tokens=60, temperature=1.0, seed=s) for s in range(8)])
    finished = [ids for ids, _ in out.values() if len(ids) < 60]
    assert finished
    for ids in finished:
        assert isinstance(json.loads(decode(tiny_models, ids)), dict)


def test_logprobs_report_the_greedy_choice_as_the_most_likely_token(engine):
    out = generate(engine, [request("lp", None, max_tokens=6, logprobs=3)])
    ids, logprobs = out["lp"]
    assert [lp.token_id for lp in logprobs] == ids
    for lp in logprobs:
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == lp.token_id and lp.top_logprobs[0][1] == pytest.approx(lp.logprob)
        assert lp.top_logprobs[0][1] >= lp.top_logprobs[1][1] >= lp.top_logprobs[2][1]


def test_unsupported_schema_features_are_named():
    bad = StructuredOutput(StructuredKind.JSON_SCHEMA, schema_text({"type": "object", "if": {}, "then": {}}))
    with pytest.raises(GrammarError, match="if"):
        grammar_text(bad)


def test_a_mask_computed_ahead_on_the_mask_thread_equals_one_computed_in_place(engine, tiny_models):
    """The runner starts each constrained row's mask before the forward (GrammarMatcher.prefetch_mask);
    along a whole answer it must equal the mask computed at sampling time, and accept must wait for it."""
    import numpy as np

    assert engine.grammar is not None
    schema = StructuredOutput(StructuredKind.JSON_SCHEMA, schema_text(SCHEMA))
    ahead, in_place = engine.grammar.matcher(schema), engine.grammar.matcher(schema)
    words = (engine.grammar.vocab_size + 31) // 32
    rng = np.random.default_rng(0)
    for _ in range(40):
        ahead.prefetch_mask()
        ahead.prefetch_mask()  # idempotent until the next accept
        a, b = np.zeros(words, np.int32), np.zeros(words, np.int32)
        ahead.fill_bitmask(a)
        in_place.fill_bitmask(b)
        assert (a == b).all()
        allowed = np.flatnonzero(np.unpackbits(a.view(np.uint8), bitorder="little")[: engine.grammar.vocab_size])
        token = int(rng.choice(allowed))
        assert ahead.accept(token) and in_place.accept(token)
        if ahead.is_finished:
            break
    ahead.prefetch_mask()
    assert ahead.accept(int(rng.integers(engine.grammar.vocab_size))) in (True, False)  # waits, then moves on


@pytest.mark.parametrize(
    ("schema", "finite"),
    [
        ({"$ref": "#"}, False),
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}, False),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),  # `a` may be left out
        (
            {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
            True,
        ),
        (  # a linked list ending in null
            {
                "$defs": {
                    "N": {
                        "anyOf": [
                            {"type": "null"},
                            {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]},
                        ]
                    }
                },
                "$ref": "#/$defs/N",
            },
            True,
        ),
        ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # untyped: a string will do
    ],
)
def test_schemas_whose_every_value_holds_another_have_no_finite_instance(schema, finite):
    from engine.grammar import has_finite_instance

    assert has_finite_instance(schema) is finite


def _ref_chain(length: int, end: object, at: str = "#") -> dict:
    """`#/$defs/0` -> 1 -> ... -> `end`: what crashed llguidance (a stack overflow) at a few
    thousand; `at`: where the schema will sit in the whole (its references are absolute)."""
    defs: dict = {str(i): {"$ref": f"{at}/$defs/{i + 1}"} for i in range(length)}
    defs[str(length)] = end
    return {"$defs": defs, "$ref": f"{at}/$defs/0"}


def _compact(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


def test_long_reference_chains_are_judged_without_recursion():
    from engine.grammar import has_finite_instance

    assert has_finite_instance(_ref_chain(3000, {"type": "string"})) is True
    looped = _ref_chain(3000, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]})
    assert has_finite_instance(looped) is False


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        (_ref_chain(3000, {"type": "string"}), "nests too deeply"),  # killed the process before the check
        (_ref_chain(70, {"type": "string"}), "nests too deeply"),
        ({"anyOf": [{}] * 6000}, "more than 5000 objects"),
        ({"type": "string", "description": "x" * 100_001}, "100000"),
        # Hidden under a property named like a data keyword: still a schema, still counted.
        (
            {"type": "object", "properties": {"enum": _ref_chain(100, {"type": "string"}, "#/properties/enum")}},
            "nests too deeply",
        ),
    ],
)
def test_schemas_past_the_size_limits_are_refused_before_llguidance_sees_them(schema, named):
    assert len(_compact(schema)) < 100_000 or named == "100000"  # each limit is met on its own
    with pytest.raises(GrammarError, match=named):
        grammar_text(StructuredOutput(StructuredKind.JSON_SCHEMA, _compact(schema)))


def test_schemas_within_the_limits_compile():
    deep: dict = {"type": "string"}
    for _ in range(30):  # 30 levels of objects: 60 nested objects counting the property maps
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    chain = _ref_chain(50, {"type": "integer"})
    recursive = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    for schema in (deep, chain, recursive):
        assert grammar_text(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)))
