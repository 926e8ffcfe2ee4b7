"""Every served family's greedy output equals transformers' token for token, on every kernel path.

Each checkpoint comes from transformers' own config class (conftest.FAMILY_VARIANTS). The
workload crosses the sliding windows (24-40 tokens) and the 32-token chunked-prefill step,
shares a prefix (cache hits) and runs in a KV pool small enough to preempt, NaN-filled first.
"""

from __future__ import annotations

import random
import zlib

import pytest

from engine.native.kernels import KernelMode
from engine.native.loader import load_model_args
from engine.types import GenerationRequest, SamplingParams
from family_variants import FAMILY_VARIANTS
from kernel_modes import ALL_MODES
from native_harness import ON_DEVICE, check_invariants
from test_greedy_equality import engine_for, greedy_arrivals, run_with_arrivals


def family_workload(tiny_models, variant: str, vocab_size: int, min_len: int) -> tuple[list, dict[str, list[int]]]:
    """Five requests; every prompt has at least `min_len` tokens (long-context rope variants)."""
    rng = random.Random(zlib.crc32(variant.encode()))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    system = tokens(40 + min_len)
    specs = [  # (arrival step, prompt, max_tokens, stops on a token)
        (0, tokens(5 + min_len), 16, False),
        (0, system + tokens(6), 16, True),
        (1, tokens(70 + min_len), 12, False),  # prefilled in chunks, longer than any window
        (3, system + tokens(9), 16, False),  # shares system's cached blocks
        (5, tokens(20 + min_len), 16, False),
    ]
    return greedy_arrivals(tiny_models, variant, specs)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_family_matches_transformers_greedy_token_for_token(tiny_models, variant, mode):
    # Every kernel path this CPU can run (AVX-512, AVX2, PyTorch ops); the test id names it.
    native_kernels = mode is not KernelMode.TORCH
    model_dir = tiny_models.path(variant)
    args = load_model_args(model_dir)
    # longrope: transformers switches to the long factors once a sequence passes the original
    # context; the engine (serving 512 tokens) always uses them, so every prompt starts past it.
    long_context = args.rope_type == "longrope"
    # Every layer sliding: sequences give back blocks outside the window, so a smaller pool preempts.
    all_sliding = all(layer.sliding_window for layer in args.layers)
    num_blocks = 6 if all_sliding else 16 if long_context else 10
    engine = engine_for(model_dir, num_blocks=num_blocks, kernel_isa=mode.value)
    assert engine.runner.kernel_mode is mode
    arrivals, expected = family_workload(tiny_models, variant, args.vocab_size, 66 if long_context else 0)
    assert run_with_arrivals(engine, arrivals) == expected
    # Which path ran: with the C kernels, every family ran its decode-only steps as one C call
    # (decode_step.c), and Llama-like ones (Qwen3's per-head q/k norms included) their prefill
    # steps as one compiled call per operation; without them, PyTorch ops throughout.
    # (Hunyuan's q/k norms after rope: the general path, PyTorch ops around the C matmuls.)
    assert engine.runner.model.uses_decode_stack == (native_kernels and args.fits_decode_stack)
    assert (engine.runner.model._stack is not None) == (native_kernels and args.fits_decode_stack)
    assert engine.runner.model.fused_cpu_ops == (native_kernels and args.is_llama_like)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "shared prefixes were meant to hit the cache"


def test_family_configs_switch_on_their_features(tiny_models):
    args = {variant: load_model_args(tiny_models.path(variant)) for variant in FAMILY_VARIANTS}
    assert args["qwen3"].head_dim == 32 != args["qwen3"].hidden_size // args["qwen3"].num_heads
    gemma3 = args["gemma3"]
    assert [layer.sliding_window for layer in gemma3.layers] == [24, None, 24]
    assert [layer.rope for layer in gemma3.layers] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma3.embedding_multiplier == 8.0 and gemma3.attention_scale == 20**-0.5
    assert args["gemma2"].attn_logit_softcap == 3.0 and args["gemma2"].final_logit_softcap == 5.0
    assert args["phi3"].rotary_dim("") == 8 and args["phi3"].sliding_window == 40
    assert [layer.rope for layer in args["smollm3"].layers] == ["", None, ""]
    assert args["granite"].residual_multiplier == 0.6 and args["granite"].logits_divisor == 2.5
    olmo3 = args["olmo3"]
    assert [layer.sliding_window for layer in olmo3.layers] == [24, None, 24]
    assert dict(dict(olmo3.rope_parameters)["full_attention"])["rope_type"] == "yarn"
    assert [(layer.sliding_window, layer.rope) for layer in args["ministral"].layers] == [
        (24, ""),
        (None, ""),
        (24, ""),
    ]
    exaone4 = args["exaone4"]
    assert [(layer.sliding_window, layer.rope) for layer in exaone4.layers] == [(24, "")] * 3 + [(None, None)]
    assert all(layer.rope == "" for layer in args["exaone4-global"].layers)
    ernie = args["ernie4_5"]
    assert ernie.family.interleaved_rope and ernie.head_dim == 32 and ernie.tie_word_embeddings
    glm4 = args["glm4"]
    assert glm4.family.interleaved_rope and glm4.rotary_dim("") == 8 and glm4.head_dim == 16
    assert args["llama-yarn"].rope_type == "yarn" and args["llama-dynamic"].rope_type == "dynamic"
    assert all(args[v].is_llama_like for v in ("qwen3", "smollm3", "granite", "ernie4_5"))
    assert not args["gemma2"].is_llama_like


@pytest.mark.parametrize("native_kernels", [True, False], ids=["c-kernel", "pytorch"])
def test_an_all_sliding_model_keeps_only_its_window_of_kv_per_sequence(tiny_models, native_kernels):
    variant = "mistral-sliding"  # window 24, block size 16
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=24, native_kernels=native_kernels)
    prompt = list(range(3, 163))  # 160 tokens: prefilled in 32-token chunks
    expected = tiny_models.greedy(variant, prompt, 48, None)
    sampling = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("long", tuple(prompt), sampling))
    tokens, peak_blocks = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        for seq in engine.scheduler.running:
            peak_blocks = max(peak_blocks, len(seq.block_table) - seq.num_released_blocks)
        check_invariants(engine.block_manager, engine.scheduler.running)
    assert tokens == expected
    # The window (24) plus a 32-token chunk spans at most 5 blocks of 16; the whole 208 tokens, 13.
    assert peak_blocks <= 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("variant", ["gemma3", "gemma2"])
def test_a_mixed_model_keeps_only_the_window_on_its_sliding_layers(tiny_models, variant):
    """Sliding layers interleaved with global ones: the sliding group's blocks per sequence stay
    window-sized while the global group's grow; greedy output still equals transformers' with
    preemption forced and a prefix hit past the window."""
    model_dir = tiny_models.path(variant)  # window 24, block size 16
    engine = engine_for(model_dir, num_blocks=16, max_num_seqs=2)
    bm = engine.block_manager
    assert (bm.full.num_blocks, bm.window.num_blocks) == (16, 16)
    vocab_size = load_model_args(model_dir).vocab_size
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab_size) for _ in range(100)]
    prompts = [shared + [rng.randrange(3, vocab_size) for _ in range(60)] for _ in range(2)]
    prompts.append([rng.randrange(3, vocab_size) for _ in range(150)])
    arrivals, expected = [], {}
    for i, (step, prompt) in enumerate(zip((0, 3, 1), prompts, strict=True)):  # 208 tokens each: 13 of 16 blocks
        expected[f"r{i}"] = tiny_models.greedy(variant, prompt, 48, None)
        sampling = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        arrivals.append((step, GenerationRequest(f"r{i}", tuple(prompt), sampling)))
    outputs = {f"r{i}": [] for i in range(3)}
    peak = {0: 0, 1: 0}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            engine.add_request(arrivals.pop(0)[1])
        arrivals.sort(key=lambda a: a[0])
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        for seq in engine.scheduler.running:
            for g, table in enumerate(seq.block_tables):
                peak[g] = max(peak[g], len(table.block_ids) - table.num_released)
        check_invariants(bm, engine.scheduler.running + engine.scheduler.waiting)
        step += 1
    assert outputs == expected
    # The window (24) plus a 32-token chunk spans at most 5 blocks of 16; the whole 207 tokens, 13.
    assert peak[1] <= 5 and peak[0] == 13
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "the shared 100 tokens were meant to hit the cache"
    assert bm.full.num_free_blocks == 16 and bm.window.num_free_blocks == 16


def test_a_mixed_models_sliding_pool_is_window_sized_and_the_global_pool_gets_the_rest(tiny_models):
    from engine.native.llm_engine import LLMEngine
    from settings import EngineConfig

    model_dir = tiny_models.path("gemma3")  # layers: sliding, global, sliding; window 24
    args = load_model_args(model_dir)
    layer_block_bytes = 2 * 16 * args.num_kv_heads * args.head_dim * 4
    config = EngineConfig(
        **ON_DEVICE,
        block_size=16,
        kv_cache_bytes=100 * 3 * layer_block_bytes,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,), max_model_len=4096)
    # Per running sequence its window (2 blocks) and the block being written and one more, plus
    # one step's 32 tokens: 2 * 4 + 2 = 10 blocks, twice over for the prefix cache.
    assert engine.runner.group_num_blocks == (300 - 2 * 20, 20)
    assert (engine.block_manager.full.num_blocks, engine.block_manager.window.num_blocks) == (260, 20)
    # The budget, all of it (on CUDA, with decode graphs, one scratch block per layer beyond it).
    scratch = args.num_layers if engine.runner.decode_graphs is not None else 0
    assert engine.runner.kv_pool.numel() * 4 == (100 * 3 + scratch) * layer_block_bytes


def test_a_query_scale_is_read_from_every_rope_setting_or_refused():
    """Ministral 3's llama_4_scaling_beta: one for the whole model; a model whose rope settings
    disagree on it (or where only some have it) is refused rather than served with one of them."""
    from engine.native.families import QueryScale, UnsupportedConfig, _query_scale

    scaled = {"rope_type": "yarn", "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16384}
    plain = {"rope_type": "default", "original_max_position_embeddings": 4096}
    assert _query_scale({"": scaled}) == QueryScale(0.1, 16384)
    assert _query_scale({"full_attention": scaled, "sliding_attention": dict(scaled)}) == QueryScale(0.1, 16384)
    assert _query_scale({"full_attention": plain, "sliding_attention": {"rope_type": "default"}}) is None
    with pytest.raises(UnsupportedConfig, match="differs"):
        _query_scale({"full_attention": scaled, "sliding_attention": plain})
    with pytest.raises(UnsupportedConfig, match="original_max_position_embeddings"):
        _query_scale({"": {"llama_4_scaling_beta": 0.1}})
