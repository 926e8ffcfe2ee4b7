"""Qwen3.5: Gated DeltaNet layers (a recurrent state per sequence) beside gated attention layers.

The engine's greedy output equals transformers' token for token on every kernel path, with
continuous batching, 32-token prefill chunks (a state carried from chunk to chunk), prompts
longer than the closed-form block (linear_attention.CHUNK), and a KV pool small enough to
preempt (a preempted sequence restarts its state from zeros). Every state row is accounted for
after every step (native_harness.check_invariants) and the pools start NaN-filled, so a state
read before it was written would show.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.quant_quality import rounded_like
from engine.native.kernels import KernelMode
from engine.native.linear_attention import CHUNK, RecurrentPools, _delta_rule_prefill, _delta_rule_step
from engine.native.llm_engine import LLMEngine
from engine.native.loader import ModelLoadError, load_model_args, preflight
from engine.native.quant import Quantization
from engine.types import EngineError, GenerationRequest, SamplingParams, TokenLogprob
from kernel_modes import ALL_MODES, COMPILED_MODES, cpu_kernels
from native_harness import ON_DEVICE
from settings import EngineConfig
from test_amx_prefill import needs_amx, prompt_logprobs
from test_greedy_equality import run_with_arrivals
from testing.tiny_model import QWEN3_5_TINY, build_tiny_family

BLOCK_SIZE = 16
VARIANTS = {
    "qwen3_5_text": dict(model_type="qwen3_5_text", seed=31, **QWEN3_5_TINY),  # Qwen3_5ForCausalLM
    # The releases: Qwen3_5ForConditionalGeneration, the language model under model.language_model.
    "qwen3_5": dict(model_type="qwen3_5", seed=32, tie_word_embeddings=True, **QWEN3_5_TINY),
}


class Checkpoints:
    def __init__(self, root):
        self.root, self._dirs, self._hf = root, {}, {}

    def path(self, variant: str):
        if variant not in self._dirs:
            self._dirs[variant] = build_tiny_family(self.root / variant, **VARIANTS[variant])
        return self._dirs[variant]

    def reference(self, variant: str):
        """transformers' model of the variant's checkpoint."""
        if variant not in self._hf:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

            auto = AutoModelForImageTextToText if variant == "qwen3_5" else AutoModelForCausalLM
            self._hf[variant] = auto.from_pretrained(self.path(variant), dtype=torch.float32).eval()
        return self._hf[variant]

    def greedy(self, variant: str, prompt: list[int], max_tokens: int, model=None) -> list[int]:
        """transformers' greedy answer, of the variant's model or of `model` (its rounded copy)."""
        model = model or self.reference(variant)
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.do_sample, config.pad_token_id, config.eos_token_id = max_tokens, False, 0, 10**9
        with torch.inference_mode():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            out = model.generate(torch.tensor([prompt]), attention_mask=mask, generation_config=config)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("qwen3_5"))


def make_engine(model_dir, *, num_blocks: int, mode: KernelMode, **overrides) -> LLMEngine:
    args = load_model_args(model_dir)
    block_bytes = args.num_attention_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4
    config = EngineConfig(
        **ON_DEVICE,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=num_blocks * block_bytes,
        native_kernels=mode is not KernelMode.TORCH,
        kernel_isa=mode.value,
        **{"max_num_batched_tokens": 32, "max_num_seqs": 3, **overrides},
    )
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,))
    assert engine.block_manager.num_blocks == num_blocks  # only the attention layer has a KV cache
    engine.runner.kv_pool.fill_(float("nan"))
    assert engine.runner.recurrent is not None
    for conv, state in engine.runner.recurrent.layers:
        conv.fill_(float("nan"))
        state.fill_(float("nan"))
    return engine


def workload(checkpoints: Checkpoints, variant: str, max_tokens: int = 12):
    rng = random.Random(variant)
    lengths = [(0, 5), (0, CHUNK + 40), (1, 2 * CHUNK + 30), (2, 33), (4, 20)]
    arrivals, expected = [], {}
    for i, (step, n) in enumerate(lengths):
        prompt = [rng.randrange(3, 512) for _ in range(n)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        arrivals.append((step, GenerationRequest(f"r{i}", tuple(prompt), sampling)))
        expected[f"r{i}"] = checkpoints.greedy(variant, prompt, max_tokens)
    return arrivals, expected


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_qwen3_5_matches_transformers_greedy_with_batching_chunks_and_preemption(checkpoints, variant, mode):
    engine = make_engine(checkpoints.path(variant), num_blocks=16, mode=mode)
    assert engine.runner.kernel_mode is mode
    arrivals, expected = workload(checkpoints, variant)
    assert run_with_arrivals(engine, arrivals) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.block_manager.num_used_slots == 0  # every state row came back
    # Which path ran: the matmuls on the mode's kernels, every layer as PyTorch ops around them
    assert not engine.runner.model.uses_decode_stack and not engine.runner.model.fused_cpu_ops


def test_a_state_row_comes_back_on_abort_and_the_next_sequence_starts_from_zeros(checkpoints):
    engine = make_engine(checkpoints.path("qwen3_5_text"), num_blocks=32, mode=KernelMode.TORCH, max_num_seqs=1)
    prompt = tuple(range(3, 50))
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("first", prompt, sampling))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_slots == 1
    engine.abort_request("first")
    assert engine.block_manager.num_used_slots == 0
    # The one row is reused (its state is the aborted sequence's, mid-answer): the answer is as fresh
    engine.add_request(GenerationRequest("second", prompt, sampling))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == checkpoints.greedy("qwen3_5_text", list(prompt), 6)


def test_a_one_token_row_at_position_0_starts_from_zeros(checkpoints):
    """A one-token prompt, and a prompt whose first chunk the step's budget cuts to one token, run
    among the decode rows (batch_inputs.py): their state rows start from zeros too, not from the
    NaN-filled pools (or a finished sequence's state)."""
    engine = make_engine(checkpoints.path("qwen3_5_text"), num_blocks=32, mode=KernelMode.TORCH)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"long": tuple(range(3, 34)), "cut": tuple(range(40, 60)), "one": (7,)}
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        engine.add_request(GenerationRequest(request_id, prompt, sampling))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if engine.num_steps == 1:  # 31 tokens of the 32-token budget went to "long"
            assert [(seq.request_id, seq.num_computed_tokens) for seq in engine.scheduler.running] == [
                ("long", 31),
                ("cut", 1),
            ]
    assert outputs == {rid: checkpoints.greedy("qwen3_5_text", list(p), 6) for rid, p in prompts.items()}


def test_prefix_caching_and_speculation_are_off_for_a_recurrent_state(checkpoints):
    engine = make_engine(checkpoints.path("qwen3_5_text"), num_blocks=32, mode=KernelMode.TORCH, speculative_tokens=4)
    assert engine.config.enable_prefix_caching  # asked for, and not possible: a state cannot be shared
    assert not engine.block_manager.enable_prefix_caching
    assert engine.scheduler.config.speculative_tokens == 0
    prompt = tuple([7, 8, 9] * 30)  # repeats: prompt lookup would draft here
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for request_id in ("a", "b"):  # the same prompt twice: no cache hit
        engine.add_request(GenerationRequest(request_id, prompt, sampling))
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.num_draft_tokens == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_num_parameters_counts_every_matmul_weight_of_the_language_model(checkpoints, variant):
    """ModelArgs.num_parameters: every linear layer a token passes through, lm_head included."""
    model = checkpoints.reference(variant)
    language_model = model.model.language_model if variant == "qwen3_5" else model.model
    matmuls = [m for m in (*language_model.modules(), model.lm_head) if isinstance(m, torch.nn.Linear)]
    assert load_model_args(checkpoints.path(variant)).num_parameters == sum(m.weight.numel() for m in matmuls)


def test_the_state_rows_come_out_of_the_kv_share_and_an_engine_they_fill_says_so(checkpoints, monkeypatch):
    from engine.native import runner

    model_dir = checkpoints.path("qwen3_5_text")
    config = EngineConfig(**ON_DEVICE, block_size=BLOCK_SIZE, kv_cache_memory_fraction=0.5, max_num_seqs=4)
    args = load_model_args(model_dir)
    state_bytes = 4 * RecurrentPools.bytes_per_slot(args.linear_attention, args.num_linear_layers)
    block_bytes = args.num_attention_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4
    monkeypatch.setattr(runner, "free_memory_bytes", lambda device: 2 * (state_bytes + 10 * block_bytes))
    assert LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,)).block_manager.num_blocks == 10
    monkeypatch.setattr(runner, "free_memory_bytes", lambda device: state_bytes)
    with pytest.raises(EngineError, match=r"recurrent states of engine.max_num_seqs = 4 sequences take"):
        LLMEngine.from_model_dir(model_dir, config, eos_token_ids=(2,))


def test_a_config_without_an_attention_layer_is_refused_before_loading(tmp_path):
    model_dir = build_tiny_family(tmp_path / "linear-only", **VARIANTS["qwen3_5_text"])
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["linear_attention"] * 4
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="at least one full_attention layer"):
        preflight(model_dir)


@needs_amx
def test_amx_prefill_runs_a_bf16_checkpoint_close_to_fp32(checkpoints, tmp_path):
    """engine.amx_prefill "auto" turns on for a bf16 checkpoint; the Gated DeltaNet layers' in_proj
    and out_proj then run on AMX for long steps, their recurrence in float32. transformers running
    this model in bf16 is 0.17 off its fp32 prompt logprobs; the engine's bf16 matmuls, less."""
    model_dir = tmp_path / "bf16"
    model_dir.mkdir()
    for path in checkpoints.path("qwen3_5_text").iterdir():
        if path.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, model_dir / path.name)
        else:
            (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    prompt = [random.Random(3).randrange(3, 512) for _ in range(150)]
    found = {}
    for setting in ("auto", "off"):
        engine = make_engine(
            model_dir, num_blocks=32, mode=KernelMode.AVX512, amx_prefill=setting, max_num_batched_tokens=256
        )
        assert engine.runner.amx_prefill is (setting == "auto")
        found[setting] = prompt_logprobs(engine, prompt)
    gap = max(abs(a - b) for a, b in zip(found["auto"], found["off"], strict=True))
    assert 0 < gap < 0.15, gap


def test_the_closed_form_block_equals_the_recurrence_token_by_token():
    """linear_attention._delta_rule_prefill (blocks of CHUNK tokens, a triangular solve each)
    against the recurrence one token at a time, from a nonzero state, across block boundaries."""
    torch.manual_seed(0)
    tokens, heads, dk, dv = 2 * CHUNK + 22, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, dk), dim=-1)
    v, beta, log_decay = torch.randn(tokens, heads, dv), torch.rand(tokens, heads), -2 * torch.rand(tokens, heads)
    start = torch.randn(heads, dk, dv)
    state, outputs = _delta_rule_prefill(start.clone(), q, k, v, beta, log_decay)
    step_state, step_outputs = start[None], []
    for t in range(tokens):
        row = slice(t, t + 1)
        step_state, o = _delta_rule_step(step_state, q[row], k[row], v[row], beta[row], log_decay[row])
        step_outputs.append(o[0])
    torch.testing.assert_close(outputs, torch.stack(step_outputs), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, step_state[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_the_compiled_decode_step_updates_its_rows_in_place_as_the_pytorch_step(mode):
    """gated_delta.c against _delta_rule_step: rows out of order, other rows untouched."""
    cpu = cpu_kernels(mode)
    torch.manual_seed(1)
    slots, heads, dk, dv = 6, 4, 32, 16
    pool = torch.randn(slots, heads, dk, dv)
    rows = torch.tensor([4, 0, 2])
    q = torch.nn.functional.normalize(torch.randn(3, heads, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(3, heads, dk), dim=-1)
    v, beta, log_decay = torch.randn(3, heads, dv), torch.rand(3, heads), -2 * torch.rand(3, heads)
    expected_state, expected = _delta_rule_step(pool[rows].clone(), q, k, v, beta, log_decay)
    before = pool.clone()
    out = cpu.gated_delta_decode(pool, rows, q, k, v, beta, log_decay)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[rows], expected_state, rtol=1e-5, atol=1e-5)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(pool[untouched], before[untouched])


QUANTIZED_PROMPTS = {  # 1 token, a few, and more than a closed-form block
    f"r{i}": [random.Random(i).randrange(3, 512) for _ in range(n)] for i, n in enumerate((1, 9, CHUNK + 10))
}


@pytest.fixture(scope="module")
def rounded_references(checkpoints):
    """transformers' model with its weights rounded as each engine.quantization rounds them."""
    model = checkpoints.reference("qwen3_5_text")
    return {quantization: rounded_like(model, quantization) for quantization in (Quantization.INT8, Quantization.INT4)}


def quantized_run(checkpoints: Checkpoints, mode: KernelMode, quantization: Quantization) -> dict[str, list]:
    """The engine at `quantization` over QUANTIZED_PROMPTS, batched: each one's greedy tokens' logprobs."""
    engine = make_engine(checkpoints.path("qwen3_5_text"), num_blocks=32, mode=mode, quantization=quantization.value)
    assert engine.runner.quantization is quantization and engine.runner.kernel_mode is mode
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    for request_id, prompt in QUANTIZED_PROMPTS.items():
        engine.add_request(GenerationRequest(request_id, tuple(prompt), sampling))
    logprobs: dict[str, list[TokenLogprob]] = {request_id: [] for request_id in QUANTIZED_PROMPTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += out.logprobs
    return logprobs


@pytest.fixture(scope="module")
def int8_greedy(checkpoints, rounded_references) -> dict[str, list[int]]:
    reference = rounded_references[Quantization.INT8]
    return {rid: checkpoints.greedy("qwen3_5_text", p, 12, reference) for rid, p in QUANTIZED_PROMPTS.items()}


@pytest.mark.parametrize("mode", ALL_MODES)
def test_int8_qwen3_5_matches_transformers_on_the_rounded_weights_token_for_token(checkpoints, int8_greedy, mode):
    """The fused in_proj ([q k v | z | b | a]) and the gated attention's [q | k | v | gate] are
    rounded row by row, as transformers' separate projections are (test_int8.py's reference)."""
    logprobs = quantized_run(checkpoints, mode, Quantization.INT8)
    assert {rid: [lp.token_id for lp in lps] for rid, lps in logprobs.items()} == int8_greedy


@pytest.mark.parametrize("mode", ALL_MODES)
def test_int4_qwen3_5_follows_the_rounded_weights_up_to_near_ties(checkpoints, rounded_references, mode):
    """int4 rounds each matmul's inputs too (w4a8), which turns float noise into whole rounding
    steps, and the recurrent state carries them: transformers' own one-pass and token-by-token
    logprobs of this model differ by 0.1 at int4 (1e-5 at int8). So each greedy token is one that
    the rounded reference, fed the engine's answer, ranks within 0.15 of its best, with a
    logprob as close; a layer rounded differently from the reference is off by more."""
    reference = rounded_references[Quantization.INT4]
    for request_id, logprobs in quantized_run(checkpoints, mode, Quantization.INT4).items():
        prompt, tokens = QUANTIZED_PROMPTS[request_id], [lp.token_id for lp in logprobs]
        with torch.inference_mode():  # [answer, vocab]: the reference's logprobs before each answer token
            expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        for lp, row in zip(logprobs, expected, strict=True):
            assert row.max() - row[lp.token_id] < 0.15
            assert abs(row[lp.token_id] - lp.logprob) < 0.15


def test_a_conv_kernel_under_2_is_refused_at_load(checkpoints, tmp_path):
    config = json.loads((checkpoints.path("qwen3_5_text") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "linear_conv_kernel_dim": 1}))
    with pytest.raises(ModelLoadError, match="linear_conv_kernel_dim must be 2 or more; got 1"):
        load_model_args(tmp_path)


@pytest.mark.parametrize("top, text, tied", [(True, False, True), (False, True, False), (None, True, True)])
def test_the_releases_top_level_tie_word_embeddings_wins_over_the_text_configs(checkpoints, tmp_path, top, text, tied):
    """As transformers reads Qwen3_5ForConditionalGeneration's; the text config's where the top is silent."""
    config = json.loads((checkpoints.path("qwen3_5") / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    if top is not None:
        config["tie_word_embeddings"] = top
    config["text_config"]["tie_word_embeddings"] = text
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_args(tmp_path).tie_word_embeddings is tied
