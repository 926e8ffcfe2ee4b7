"""What int8 weights cost in quality, on the bundled demo model (printed by `make bench`, checked
loosely by tests/engine/test_int8.py).

- Held-out perplexity: transformers on models/heldout.jsonl, fp32 weights against the same
  weights rounded as the int8 kernels compute with them (the kernels equal F.linear on the
  dequantized weights: tests/engine/test_cpu_kernels.py).
- Greedy agreement: the engine itself, fp32 against int8, on the held-out questions: the share of
  generated tokens that match before the first difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.native.quant import fake_quantize

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-flagship"
HELDOUT = ROOT / "models" / "heldout.jsonl"


@dataclass(frozen=True, slots=True)
class Int8Quality:
    model: str
    perplexity_fp32: float
    perplexity_int8: float
    greedy_agreement: float  # share of fp32's greedy tokens that int8 reproduces before diverging
    num_prompts: int
    tokens_per_prompt: int


@torch.no_grad()
def rounded_like_int8(model):
    """A copy of a transformers causal LM whose decoder linears and lm_head hold int8-rounded
    weights (a tied lm_head gets its own rounded copy; the embedding lookup stays fp32, as in the engine)."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quantize(module.weight))
    model.lm_head.weight = torch.nn.Parameter(fake_quantize(model.lm_head.weight))
    return model


def heldout_perplexities(model_dir: Path = DEMO_MODEL) -> tuple[float, float]:
    from scripts.demo_model.dataset import read_jsonl
    from scripts.demo_model.evaluate import heldout_loss, load_for_eval, perplexity
    from scripts.demo_model.tokenizer import encode_conversation

    model, tokenizer = load_for_eval(model_dir)
    encoded = [encode_conversation(tokenizer.backend_tokenizer, c) for c in read_jsonl(HELDOUT)]
    return perplexity(heldout_loss(model, encoded)), perplexity(heldout_loss(rounded_like_int8(model), encoded))


def _engine_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, quantization: str, kernel_isa: str):
    from engine.native.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams
    from settings import EngineConfig

    config = EngineConfig(device="cpu", kv_cache_bytes=64 << 20, quantization=quantization, kernel_isa=kernel_isa)
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=())
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"q{i}", tuple(prompt), sampling))
        outputs[f"q{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[f"q{i}"] for i in range(len(prompts))]


def heldout_prompts(model_dir: Path = DEMO_MODEL, limit: int = 16) -> list[list[int]]:
    """The held-out conversations' first user turns, rendered with the chat template."""
    from engine.tokenizer import Tokenizer
    from scripts.demo_model.dataset import read_jsonl

    tokenizer = Tokenizer.from_dir(model_dir)
    conversations = read_jsonl(HELDOUT)[:limit]
    return [tokenizer.encode_chat([{"role": "user", "content": c.messages[0][1]}]) for c in conversations]


def greedy_agreement(
    model_dir: Path = DEMO_MODEL, *, max_tokens: int = 32, kernel_isa: str = "auto", limit: int = 16
) -> float:
    prompts = heldout_prompts(model_dir, limit)
    fp32 = _engine_greedy(model_dir, prompts, max_tokens, "none", kernel_isa)
    int8 = _engine_greedy(model_dir, prompts, max_tokens, "int8", kernel_isa)
    agreed = 0
    for a, b in zip(fp32, int8, strict=True):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))  # may stop apart
    return agreed / (max_tokens * len(prompts))


def measure(
    model_dir: Path = DEMO_MODEL, *, kernel_isa: str = "auto", limit: int = 16, max_tokens: int = 32
) -> Int8Quality:
    ppl_fp32, ppl_int8 = heldout_perplexities(model_dir)
    agreement = greedy_agreement(model_dir, max_tokens=max_tokens, kernel_isa=kernel_isa, limit=limit)
    return Int8Quality(model_dir.name, ppl_fp32, ppl_int8, agreement, limit, max_tokens)
