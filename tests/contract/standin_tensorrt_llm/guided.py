"""STAND-IN for TensorRT-LLM's guided decoding (tests only): the llguidance matcher factory.

Follows `LLGuidanceMatcherFactory` (tensorrt_llm/_torch/pyexecutor/grammar_matcher.py, 1.x): a
`json_object` guide is the schema {"type": "object"}, `json` a JSON schema, `regex` a regular
expression and `grammar` llguidance's Lark dialect; the real llguidance then masks the toy model's
token choice. `structural_tag` is xgrammar's only, as there.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance


class Guide:
    """One request's grammar state: the tokens it allows next, and the tokens it took."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    @property
    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()

    def allowed(self) -> list[int]:
        mask = self._matcher.compute_bitmask()
        return [i for i in range(self._vocab_size) if mask[i // 8] >> (i % 8) & 1]

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"LLGuidance matcher error: {self._matcher.get_error()}")


class GuideFactory:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int):
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self._vocab_size = vocab_size

    def create(self, params: Any) -> Guide:
        if params.json_object:
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        elif params.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif params.grammar is not None:
            grammar = llguidance.LLMatcher.grammar_from_lark(params.grammar)
        else:
            raise ValueError("Unsupported guide type for the llguidance backend")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"LLGuidance matcher error: {matcher.get_error()}")
        return Guide(matcher, self._vocab_size)
