"""The demo models through the project's own serving path: engine.tokenizer reads their
template and EOS ids, and the native engine's greedy reply to a held-out question equals
transformers' reply on the same weights, token for token, stopping at <|im_end|>."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.native.llm_engine import LLMEngine
from engine.tokenizer import Tokenizer
from engine.types import FinishReason, GenerationRequest, SamplingParams, StructuredKind, StructuredOutput
from scripts.demo_model.dataset import unknown_words
from settings import EngineConfig

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODEL_NAMES = ("demo-mini", "demo-flagship")
MAX_TOKENS = 64


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_engine_tokenizer_reads_template_and_im_end_eos(name):
    tokenizer = Tokenizer.from_dir(MODELS_DIR / name)
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = "What does café mean? 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any input round-trips


def _engine_greedy(model_dir: Path, prompt_ids: list[int], eos_ids: tuple[int, ...]) -> tuple[list[int], FinishReason]:
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=8 * 1024 * 1024)
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=eos_ids)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    engine.add_request(GenerationRequest("demo", tuple(prompt_ids), sampling))
    token_ids: list[int] = []
    finish = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids += output.new_token_ids
            finish = output.finish_reason or finish
    return token_ids, finish


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_native_engine_greedy_reply_equals_transformers(name, loaded_models, heldout_sample):
    question = f"What does {unknown_words(heldout_sample)[0]} mean?"  # a word never taught
    tokenizer = Tokenizer.from_dir(MODELS_DIR / name)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
    engine_ids, finish = _engine_greedy(MODELS_DIR / name, prompt_ids, tokenizer.eos_token_ids)

    model, _ = loaded_models(name)
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    reference = output[0, len(prompt_ids) :].tolist()
    assert engine_ids == reference
    assert finish is FinishReason.STOP and engine_ids[-1] in tokenizer.eos_token_ids


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_json_schema_answer_from_a_demo_model_parses(name):
    """The demo tokenizers drop quote marks around words from their input; the grammar's
    tokenizer must not, or the closing quote the grammar forces after a key is lost and the
    answer stops as `{"a:` (seen over HTTP before the grammar's tokenizer left those steps out)."""
    tokenizer = Tokenizer.from_dir(MODELS_DIR / name)
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=8 * 1024 * 1024)
    engine = LLMEngine.from_model_dir(MODELS_DIR / name, config, eos_token_ids=tokenizer.eos_token_ids)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 24}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Give me JSON."}]))
    for i, temperature in enumerate((0.0, 1.0, 1.0)):
        sampling = SamplingParams(max_tokens=48, temperature=temperature, seed=i, structured=structured)
        engine.add_request(GenerationRequest(f"json-{i}", tuple(prompt), sampling))
    texts: dict[str, list[int]] = {}
    finishes: dict[str, FinishReason | None] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            texts.setdefault(output.request_id, []).extend(output.new_token_ids)
            finishes[output.request_id] = output.finish_reason or finishes.get(output.request_id)
    for request_id, ids in texts.items():
        text = tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids])
        assert finishes[request_id] is FinishReason.STOP, (request_id, text)
        assert set(json.loads(text)) == {"answer"}, text
