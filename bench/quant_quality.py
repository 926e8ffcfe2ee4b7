"""What int8 or int4 weights cost in quality, on the bundled demo model (printed by `make bench`,
checked loosely by tests/engine/test_int8.py). `python -m bench.quant_quality [int8|int4]`.

- Held-out perplexity: transformers on models/heldout.jsonl, fp32 weights against the same
  weights rounded as the quantized kernels compute with them (the kernels equal F.linear on the
  dequantized weights, int4's on inputs rounded per group of 32: tests/engine/test_cpu_kernels.py).
- Greedy agreement: the engine itself, fp32 against the quantized weights, on the held-out
  questions: the share of generated tokens that match before the first difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.native.quant import Quantization, fake_quantize, quantize_activations

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-flagship"
HELDOUT = ROOT / "models" / "heldout.jsonl"


@dataclass(frozen=True, slots=True)
class QuantQuality:
    model: str
    quantization: str  # int8 or int4
    perplexity_fp32: float
    perplexity_quantized: float
    greedy_agreement: float  # share of fp32's greedy tokens that the quantized model reproduces before diverging
    num_prompts: int
    tokens_per_prompt: int


@torch.no_grad()
def rounded_like(model, quantization: Quantization = Quantization.INT8):
    """A copy of a transformers causal LM whose decoder linears and lm_head hold weights rounded
    as the engine's `engine.quantization` rounds them (int4 keeps the lm_head at int8, as the
    engine does; a tied lm_head gets its own rounded copy; the embedding lookup stays fp32). int4's
    decoder linears also round their inputs as the engine's w4a8 kernels do."""
    head = Quantization.INT8 if quantization is Quantization.INT4 else quantization
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quantize(module.weight, quantization))
                if quantization is Quantization.INT4:
                    module.register_forward_pre_hook(_round_inputs)
    model.lm_head.weight = torch.nn.Parameter(fake_quantize(model.lm_head.weight, head))
    return model


def _round_inputs(module, args):
    return (quantize_activations(args[0]), *args[1:])


def heldout_perplexities(
    model_dir: Path = DEMO_MODEL, quantization: Quantization = Quantization.INT8
) -> tuple[float, float]:
    from scripts.demo_model.dataset import read_jsonl
    from scripts.demo_model.evaluate import heldout_loss, load_for_eval, perplexity
    from scripts.demo_model.tokenizer import encode_conversation

    model, tokenizer = load_for_eval(model_dir)
    encoded = [encode_conversation(tokenizer.backend_tokenizer, c) for c in read_jsonl(HELDOUT)]
    rounded = rounded_like(model, quantization)
    return perplexity(heldout_loss(model, encoded)), perplexity(heldout_loss(rounded, encoded))


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
    model_dir: Path = DEMO_MODEL,
    *,
    max_tokens: int = 32,
    kernel_isa: str = "auto",
    limit: int = 16,
    quantization: Quantization = Quantization.INT8,
) -> float:
    prompts = heldout_prompts(model_dir, limit)
    fp32 = _engine_greedy(model_dir, prompts, max_tokens, "none", kernel_isa)
    quantized = _engine_greedy(model_dir, prompts, max_tokens, quantization.value, kernel_isa)
    agreed = 0
    for a, b in zip(fp32, quantized, strict=True):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))  # may stop apart
    return agreed / (max_tokens * len(prompts))


def measure(
    model_dir: Path = DEMO_MODEL,
    *,
    kernel_isa: str = "auto",
    limit: int = 16,
    max_tokens: int = 32,
    quantization: Quantization = Quantization.INT8,
) -> QuantQuality:
    ppl_fp32, ppl_quantized = heldout_perplexities(model_dir, quantization)
    agreement = greedy_agreement(
        model_dir, max_tokens=max_tokens, kernel_isa=kernel_isa, limit=limit, quantization=quantization
    )
    return QuantQuality(model_dir.name, quantization.value, ppl_fp32, ppl_quantized, agreement, limit, max_tokens)


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or ["int8", "int4"]:
        q = measure(quantization=Quantization(name))
        print(
            f"{q.model} {q.quantization}: held-out perplexity {q.perplexity_fp32:.4f} fp32, "
            f"{q.perplexity_quantized:.4f} {q.quantization} ({q.perplexity_quantized / q.perplexity_fp32 - 1:+.2%}); "
            f"greedy agreement with fp32 {q.greedy_agreement:.1%} ({q.num_prompts} x {q.tokens_per_prompt} tokens)"
        )
