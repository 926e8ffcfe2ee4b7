"""engine.amx_prefill: on CPUs with AMX, steps of many rows (prompts) run the decoder's matmuls in
bf16 on AMX tiles. The decision is checked everywhere; the path itself where the CPU has AMX
(skipped with the reason elsewhere, so the report says whether it ran)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.native.kernels import AMX_FLAGS, KernelMode, resolve_amx_prefill, supported_modes
from engine.native.loader import load_model_args
from engine.native.model import AMX_MIN_ROWS, amx_rows
from engine.types import EngineError, GenerationRequest, SamplingParams
from native_harness import TEST_DEVICE
from test_greedy_equality import engine_for

AMX = frozenset({"avx512f", *AMX_FLAGS})
HAS_AMX = KernelMode.AVX512 in supported_modes() and resolve_amx_prefill(
    "auto", mode=KernelMode.AVX512, is_quantized=False, checkpoint_dtype=torch.bfloat16
)
needs_amx = pytest.mark.skipif(not HAS_AMX or TEST_DEVICE != "cpu", reason="this CPU lacks AMX (amx_tile, amx_bf16)")


def test_auto_is_on_only_for_bf16_checkpoints_on_amx_with_the_avx512_kernels_and_fp32_weights():
    def resolve(setting="auto", mode=KernelMode.AVX512, quantized=False, dtype=torch.bfloat16, flags=AMX):
        return resolve_amx_prefill(setting, mode=mode, is_quantized=quantized, checkpoint_dtype=dtype, flags=flags)

    assert resolve() is True
    assert resolve(dtype=torch.float32) is False  # the bf16 copy would round an fp32 checkpoint's weights
    assert resolve(setting="on", dtype=torch.float32) is True  # asked for
    assert resolve(setting="off") is False
    assert resolve(flags=AMX - {"amx_bf16"}) is False
    assert resolve(mode=KernelMode.AVX2) is False and resolve(mode=KernelMode.TORCH) is False
    assert resolve(quantized=True) is False
    for bad in (dict(flags=frozenset({"avx512f"})), dict(mode=KernelMode.AVX2), dict(quantized=True)):
        with pytest.raises(EngineError, match="amx_prefill = on needs"):
            resolve(setting="on", **bad)
    with pytest.raises(EngineError, match="not one of"):
        resolve(setting="yes")


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_models, tmp_path_factory) -> Path:
    """The tiny Llama with its weights stored in bfloat16, as most released checkpoints are."""
    source = tiny_models.path("tied-gqa-parameters")
    target = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    target.mkdir()
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, target / path.name)
        else:
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["dtype"] = "bfloat16"  # what the engine reads (loader.checkpoint_dtype)
    (target / "config.json").write_text(json.dumps(config))
    return target


def prompt_logprobs(engine, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob given the ones before it (the first has none), from one prefill."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine.add_request(GenerationRequest("p", tuple(prompt), sampling))
    found: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            found += [lp.logprob for lp in out.prompt_logprobs if lp is not None]
    assert len(found) == len(prompt) - 1
    return found


@needs_amx
def test_prompts_of_many_tokens_run_on_amx_close_to_fp32_and_short_ones_exactly_as_fp32(bf16_model_dir):
    engines = {
        name: engine_for(bf16_model_dir, num_blocks=48, max_num_batched_tokens=256, amx_prefill=name)
        for name in ("auto", "off")
    }
    amx, fp32 = engines["auto"], engines["off"]
    assert amx.runner.amx_prefill and not fp32.runner.amx_prefill
    qkv = amx.runner.model.weights.layers[0].qkv
    assert qkv.amx is not None and qkv.amx.dtype == torch.bfloat16
    assert amx.runner.model.weights.lm_head.amx is None  # logits stay fp32

    rng = random.Random(3)
    vocab_size = load_model_args(bf16_model_dir).vocab_size
    short = [rng.randrange(3, vocab_size) for _ in range(AMX_MIN_ROWS - 1)]
    assert prompt_logprobs(amx, short) == prompt_logprobs(fp32, short)  # below the threshold: the fp32 kernels

    long = [rng.randrange(3, vocab_size) for _ in range(150)]
    on, off = prompt_logprobs(amx, long), prompt_logprobs(fp32, long)
    gap = max(abs(a - b) for a, b in zip(on, off, strict=True))
    assert 0 < gap < 0.05, gap  # bf16 activations: not the same numbers, nearly the same model


@needs_amx
def test_auto_leaves_fp32_checkpoints_on_the_fp32_kernels(tiny_models):
    engine = engine_for(tiny_models.path("tied-gqa-parameters"), num_blocks=16, amx_prefill="auto")
    assert not engine.runner.amx_prefill and engine.runner.model.weights.layers[0].qkv.amx is None


@needs_amx
def test_amx_prefill_continues_into_the_fp32_decode_and_matches_greedy_mostly(bf16_model_dir):
    # The decode after an AMX prefill reads its K/V; tokens may differ where two logits are within
    # bf16 rounding of each other (random weights make such ties common), so most, not all, agree.
    rng = random.Random(5)
    vocab_size = load_model_args(bf16_model_dir).vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (40, 90, 120)]
    outputs = {}
    for name in ("auto", "off"):
        engine = engine_for(bf16_model_dir, num_blocks=64, max_num_batched_tokens=256, amx_prefill=name)
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(f"r{i}", tuple(p), sampling))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        outputs[name] = got
    first_tokens = [outputs["auto"][r][0] == outputs["off"][r][0] for r in outputs["off"]]
    assert sum(first_tokens) >= 2, outputs


def test_amx_steps_run_with_few_distinct_row_counts():
    """oneDNN compiles and keeps a kernel per matmul shape: a step's row count is rounded up, so
    the cache stays small and warm instead of growing by one kernel per new count."""
    counts = {amx_rows(m) for m in range(AMX_MIN_ROWS, 2049)}
    assert len(counts) <= 45
    for m in range(AMX_MIN_ROWS, 2049):
        assert m <= amx_rows(m) < m + (16 if m <= 512 else 128)


def test_a_padded_amx_matmul_gives_each_row_what_it_gives_unpadded():
    from engine.native.cpu_ops import PackedLinear
    from engine.native.model import linear

    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    # Only the bf16 copy is read on this path (no kernels: it runs wherever bf16 matmuls do).
    packed = PackedLinear(torch.empty(0), None, 96, 64, kernels=None, amx=weight.to(torch.bfloat16))  # type: ignore[arg-type]
    x = torch.randn(37, 64)  # padded to 48 rows
    expected = torch.nn.functional.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    torch.testing.assert_close(linear(x, packed), expected, rtol=1e-2, atol=1e-2)


@needs_amx
def test_auto_drops_the_bf16_copies_when_they_would_not_leave_room_and_on_keeps_them(bf16_model_dir, monkeypatch):
    """A 3.1B model on 24 GB took 18.6 GB with the copies: "auto" leaves them out when the float32
    weights and the copies would take more than 60% of the memory available."""
    from engine.native import runner

    monkeypatch.setattr(runner, "free_memory_bytes", lambda device: 1024)  # 1 KiB available: the tiny model needs more
    auto = engine_for(bf16_model_dir, num_blocks=48, amx_prefill="auto")
    assert not auto.runner.amx_prefill and auto.runner.model.weights.layers[0].qkv.amx is None
    on = engine_for(bf16_model_dir, num_blocks=48, amx_prefill="on")
    assert on.runner.amx_prefill and on.runner.model.weights.layers[0].qkv.amx is not None


@pytest.mark.parametrize(
    ("q_len", "kv_len", "masked"), [(37, 37, False), (37, 100, True), (48, 64, True), (33, 33, True)]
)
def test_a_padded_prefill_chunk_attends_as_unpadded_with_shapes_in_few_sizes(q_len, kv_len, masked):
    """PyTorch's bf16 flash kernel keeps a compiled GEMM per block shape with no bound: chunks are
    padded to multiples of 16 queries and keys so few shapes exist, and the padding changes
    nothing a real query sees (checked in fp32, where the kernel's own rounding is exact enough)."""
    from engine.native.attention import AMX_ATTENTION_ROWS, padded_for_amx

    torch.manual_seed(0)
    qs, keys, values = torch.randn(4, q_len, 16), torch.randn(2, kv_len, 16), torch.randn(2, kv_len, 16)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len) if masked else None
    pq, pk, pv, pmask = padded_for_amx(qs, keys, values, mask)
    assert pq.shape[1] % AMX_ATTENTION_ROWS == 0 and pk.shape[1] % AMX_ATTENTION_ROWS == 0 == pv.shape[1] % 16
    assert pk.shape[1] - kv_len < AMX_ATTENTION_ROWS and pq.shape[1] - q_len < AMX_ATTENTION_ROWS

    def attend(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=m, is_causal=m is None, enable_gqa=True
        )[0]

    padded = attend(pq, pk, pv, pmask)
    assert not padded.isnan().any()  # padded queries see a key too
    torch.testing.assert_close(padded[:, :q_len], attend(qs, keys, values, mask), rtol=1e-5, atol=1e-5)
