"""The engine's greedy output equals transformers' token for token, under a mixed workload:
different prompt lengths, late arrivals, shared prefixes, chunked prefill and preemption."""

from __future__ import annotations

import random
import zlib

import pytest

from engine.native.kernels import KernelMode
from engine.native.llm_engine import LLMEngine
from engine.native.loader import load_model_args
from engine.types import FinishReason, GenerationRequest, SamplingParams
from kernel_modes import ALL_MODES
from native_harness import ON_DEVICE, check_invariants
from settings import EngineConfig

BLOCK_SIZE = 16


def engine_for(model_dir, *, num_blocks: int, native_kernels: bool = True, **overrides) -> LLMEngine:
    args = load_model_args(model_dir)
    block_bytes = args.num_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4
    config = EngineConfig(
        **ON_DEVICE,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=num_blocks * block_bytes,
        native_kernels=native_kernels,
        **{"max_num_batched_tokens": 32, "max_num_seqs": 6, **overrides},
    )
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,))
    assert engine.block_manager.num_blocks == num_blocks
    # The pool is never zeroed: a slot read before it is written would poison the output.
    engine.runner.kv_pool.fill_(float("nan"))
    return engine


def run_with_arrivals(engine: LLMEngine, arrivals: list[tuple[int, GenerationRequest]]) -> dict[str, list[int]]:
    """Add each request at its step; check the block-pool invariants after every step."""
    outputs: dict[str, list[int]] = {r.request_id: [] for _, r in arrivals}
    finish: dict[str, FinishReason] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        live = engine.scheduler.running + engine.scheduler.waiting
        check_invariants(engine.block_manager, live)
        step += 1
    assert set(finish) == set(outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs


def greedy_arrivals(tiny_models, variant: str, specs: list) -> tuple[list, dict[str, list[int]]]:
    """specs: (arrival step, prompt, max_tokens, stops on a token) -> the requests by arrival step,
    and each one's greedy tokens from transformers (a request that stops on a token stops on its
    reference answer's middle token)."""
    arrivals, expected = [], {}
    for i, (step, prompt, max_tokens, stops) in enumerate(specs):
        ref = tiny_models.greedy(variant, prompt, max_tokens, None)
        stop_ids: tuple[int, ...] = ()
        if stops:
            stop_ids = (ref[len(ref) // 2],)
            ref = tiny_models.greedy(variant, prompt, max_tokens, stop_ids[0])
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop_ids)
        arrivals.append((step, GenerationRequest(f"r{i}", tuple(prompt), sampling)))
        expected[f"r{i}"] = ref
    return arrivals, expected


def mixed_workload(tiny_models, variant: str, vocab_size: int, seed: int = 0) -> tuple[list, dict[str, list[int]]]:
    rng = random.Random(zlib.crc32(variant.encode()) + seed)
    system = [rng.randrange(3, vocab_size) for _ in range(40)]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    specs = [  # (arrival step, prompt, max_tokens, stops on a token)
        (0, tokens(1), 20, False),
        (0, tokens(7), 24, True),
        (0, system + tokens(5), 16, False),
        (1, tokens(33), 24, False),
        (2, tokens(150), 12, False),  # longer than the step budget: prefilled in chunks
        (4, tokens(16), 24, True),
        (6, system + tokens(9), 20, False),  # shares system's blocks once they are cached
        (9, tokens(64), 24, False),
        (12, system + tokens(2), 24, True),
        (15, tokens(31), 20, False),
        (20, system[:32], 24, False),
    ]
    return greedy_arrivals(tiny_models, variant, specs)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(
    "variant",
    ["tied-gqa-parameters", "untied-gqa-theta", "untied-mha-parameters", "tied-gqa-llama3-rope", "qwen2-qkv-bias"],
)
def test_mixed_workload_matches_transformers_greedy_token_for_token(tiny_models, variant, mode):
    # Every kernel path this CPU can run (AVX-512, AVX2, PyTorch ops); the test id names it.
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=24, kernel_isa=mode.value)
    assert engine.runner.kernel_mode is mode
    arrivals, expected = mixed_workload(tiny_models, variant, load_model_args(model_dir).vocab_size)
    outputs = run_with_arrivals(engine, arrivals)
    assert outputs == expected
    # With the CPU kernels, the decode-only steps ran every layer in one C call (decode_step.c).
    assert (engine.runner.model._stack is not None) == (mode is not KernelMode.TORCH)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "shared prefixes were meant to hit the cache"


def test_roomy_pool_without_preemption_also_matches(tiny_models):
    variant = "tied-gqa-parameters"
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=200, max_num_batched_tokens=512, max_num_seqs=64)
    arrivals, expected = mixed_workload(tiny_models, variant, load_model_args(model_dir).vocab_size)
    assert run_with_arrivals(engine, arrivals) == expected
    assert engine.stats().num_preemptions == 0


def test_prefix_caching_off_gives_the_same_tokens_without_hits(tiny_models):
    variant = "tied-gqa-parameters"
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=24, enable_prefix_caching=False)
    arrivals, expected = mixed_workload(tiny_models, variant, load_model_args(model_dir).vocab_size)
    assert run_with_arrivals(engine, arrivals) == expected
    assert engine.stats().prefix_cache_hits == 0


def test_repetition_penalty_matches_transformers_generate_per_request(tiny_models):
    """Three requests in one batch, each with its own penalty (one off), prompts past a chunk."""
    import copy

    import torch

    variant = "untied-gqa-theta"
    model_dir = tiny_models.path(variant)
    vocab_size = load_model_args(model_dir).vocab_size
    rng = random.Random(7)
    reference = tiny_models.reference(variant)
    arrivals, expected, prompts = [], {}, {}
    for i, penalty in enumerate((1.3, 1.0, 0.7)):
        prompt = [rng.randrange(3, vocab_size) for _ in range(40 + 7 * i)]
        config = copy.deepcopy(reference.generation_config)
        config.max_new_tokens, config.do_sample, config.pad_token_id, config.eos_token_id = 24, False, 0, 10**9
        config.repetition_penalty = penalty
        with torch.inference_mode():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            out = reference.generate(torch.tensor([prompt]), attention_mask=mask, generation_config=config)
        expected[f"r{i}"], prompts[f"r{i}"] = out[0, len(prompt) :].tolist(), prompt
        sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
        arrivals.append((0, GenerationRequest(f"r{i}", tuple(prompt), sampling)))
    assert run_with_arrivals(engine_for(model_dir, num_blocks=24), arrivals) == expected
    for request_id in ("r0", "r2"):  # the penalties changed the output (else this proves nothing)
        assert expected[request_id] != tiny_models.greedy(variant, prompts[request_id], 24, None)
