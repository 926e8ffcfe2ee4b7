"""The engine against the peers a self-hoster would pick, at the sizes people run (`make
bench-peers`, part of `make bench`; llama.cpp comes from `make bench-deps`).

Models (random weights from seed 0, built by this script, fp32): the 30M reference of bench_engine
and a 390M model of Qwen2.5-0.5B's shape with a 32k vocabulary. Paths, each decoding the same
random prompts greedily, every figure in one run: the engine on each kernel path this CPU has
(AVX-512, AVX2, PyTorch ops), fp32 and int8; transformers (static batch); llama.cpp f32 and Q8_0
(the same weights as GGUF), built natively and, on AVX-512 machines, for AVX2 only. Also printed:
decode at one stream as a share of the measured memory bandwidth, the linear layers of one step
against torch's library kernels (bench/linear_bench.py), and int8 quality (bench/quant_quality.py).
`--device cuda`: the engine against transformers on the GPU, both in bfloat16 (`--dtype`), decode
at one stream as a share of the GPU memory's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llamacpp_peer import make_prompts  # noqa: E402
from bench.machine import machine_info, synchronize  # noqa: E402
from bench.workload import REFERENCE  # noqa: E402
from engine.native import kernels  # noqa: E402
from engine.native.runner import resolve_device, resolve_dtype  # noqa: E402

QWEN_390M = dict(
    vocab_size=32000,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
MODELS = {"ref-30m": ("llama", REFERENCE), "qwen-390m": ("qwen2", QWEN_390M)}
LLAMA_BUILDS = {"native": ROOT / "build" / "llama-cpp" / "native", "avx2": ROOT / "build" / "llama-cpp" / "avx2"}


@dataclass(frozen=True, slots=True)
class Workload:
    model: str
    streams: int
    prompt_len: int
    output_len: int


WORKLOADS = (Workload("qwen-390m", 1, 128, 32), Workload("qwen-390m", 8, 128, 32), Workload("ref-30m", 32, 128, 64))


@dataclass(frozen=True, slots=True)
class PeerResult:
    workload: str
    path: str  # e.g. "ours avx512 int8", "llama.cpp native Q8_0"
    tokens_per_s: float  # all output tokens / wall time, prefill included
    decode_tokens_per_s: float  # once every stream has its first token
    weight_bytes: int  # read per decode step


def build_model(name: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, shape = MODELS[name]
    path = ROOT / "build" / "peer-models" / name
    if (path / "model.safetensors").exists():
        return path
    torch.manual_seed(0)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    model = model_cls(config_cls(**shape, eos_token_id=1, pad_token_id=0, bos_token_id=None))
    if arch == "qwen2":  # transformers initialises the q/k/v biases to zero; give them values, as trained ones have
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.02)
    model.to(torch.float32).save_pretrained(path)
    return path


def matmul_bytes(shape: dict, bytes_per_weight: float) -> int:
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    per_layer = (
        h * head_dim * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
        + 3 * h * shape["intermediate_size"]
    )
    return int((layers * per_layer + shape["vocab_size"] * h) * bytes_per_weight)


def run_ours(
    model_dir: Path,
    w: Workload,
    kernel_isa: str,
    quantization: str,
    device: str = "cpu",
    dtype: str = "auto",
    cuda_graphs: str = "auto",
    amx_prefill: str = "off",
) -> tuple[float, float]:
    from engine.native.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams
    from settings import EngineConfig

    config = EngineConfig(
        device=device,
        dtype=dtype,
        kv_cache_bytes=512 << 20,
        max_num_seqs=64,
        kernel_isa=kernel_isa,
        quantization=quantization,
        cuda_graphs=cuda_graphs,
        amx_prefill=amx_prefill,
    )
    engine = LLMEngine.from_model_dir(model_dir, config, eos_token_ids=())
    prompts = make_prompts(w.streams, w.prompt_len, MODELS[w.model][1]["vocab_size"], seed=w.streams)
    sampling = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)

    def once(tag: str) -> tuple[float, float, float, int]:
        """(start, when every stream had its first token, end, tokens generated after that)."""
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerationRequest(f"{tag}{i}", tuple(prompt), sampling))
        started, first, counts, at_first = time.perf_counter(), None, {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if first is None and len(counts) == len(prompts):
                # Chunked prefill: the first streams may already be well into their answers.
                first, at_first = time.perf_counter(), sum(counts.values())
        return started, first, time.perf_counter(), sum(counts.values()) - at_first

    once("warm")
    started, first, end, decoded = once("run")
    return w.streams * w.output_len / (end - started), decoded / (end - first)


@torch.inference_mode()
def run_transformers(
    model_dir: Path, w: Workload, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    import copy

    from transformers import AutoModelForCausalLM

    device = device or torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    prompts = make_prompts(w.streams, w.prompt_len, MODELS[w.model][1]["vocab_size"], seed=w.streams)
    ids = torch.tensor(prompts, device=device)

    def generate(max_tokens: int) -> float:
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.do_sample = max_tokens, max_tokens, False
        config.eos_token_id, config.pad_token_id = 10**9, 0
        synchronize(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        synchronize(device)
        return time.perf_counter() - start

    generate(2)
    prefill_s, total_s = generate(1), generate(w.output_len)
    n = w.streams
    return n * w.output_len / total_s, n * (w.output_len - 1) / (total_s - prefill_s)


def run_llamacpp(build: str, gguf: Path, w: Workload) -> tuple[float, float, str]:
    env = {**os.environ, "PYTHONPATH": f"{LLAMA_BUILDS[build]}:{ROOT}"}
    cmd = [
        sys.executable,
        "-m",
        "bench.llamacpp_peer",
        "--gguf",
        str(gguf),
        "--streams",
        str(w.streams),
        "--prompt-len",
        str(w.prompt_len),
        "--output-len",
        str(w.output_len),
        "--vocab-size",
        str(MODELS[w.model][1]["vocab_size"]),
        "--seed",
        str(w.streams),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        raise RuntimeError(f"llama.cpp ({build}) failed with {how}: {done.stderr[-1500:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return record["tokens_per_s"], record["decode_tokens_per_s"], record["system_info"]


def llama_builds() -> list[str]:
    """The llama.cpp builds `make bench-deps` made (the AVX2 one only matters on AVX-512 CPUs)."""
    return [b for b, path in LLAMA_BUILDS.items() if (path / "llama_cpp").is_dir()]


def measure_copy_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5, device: torch.device | None = None) -> float:
    """Bytes read + written per second by a large tensor copy (torch's threads, or the GPU's memory),
    the memory's practical limit."""
    device = device or torch.device("cpu")
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def our_paths() -> list[tuple[str, str]]:
    modes = [m.value for m in kernels.supported_modes()] + ["torch"]
    return [(mode, q) for mode in modes for q in ("none", "int8", "int4") if not (mode == "torch" and q != "none")]


# Bytes read per matmul weight: fp32; int8 and int4 with one fp32 scale per 32 (ours); llama.cpp's
# Q8_0 and Q4_0 with one fp16 scale per 32.
BYTES_PER_WEIGHT = {"none": 4.0, "int8": 1.125, "int4": 0.625, "f32": 4.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}


def bench_on_gpu(w: Workload, model_dir: Path, device: torch.device, dtype: torch.dtype) -> list[PeerResult]:
    """On a GPU: the engine (PyTorch ops; decode steps from CUDA graphs, and without them) against
    transformers, all on `device` in `dtype`. The warm-up pass captures the graphs."""
    shape, name = MODELS[w.model][1], f"{w.model} x{w.streams}"
    label = str(dtype).removeprefix("torch.")  # also the engine.dtype name
    weight_bytes = matmul_bytes(shape, dtype.itemsize)
    results = []
    for graphs, suffix in (("auto", ""), ("off", " no graphs")):
        tps, decode = run_ours(model_dir, w, "torch", "none", device=str(device), dtype=label, cuda_graphs=graphs)
        results.append(PeerResult(name, f"ours {device.type} {label}{suffix}", tps, decode, weight_bytes))
    tps, decode = run_transformers(model_dir, w, device, dtype)
    return [*results, PeerResult(name, f"transformers {device.type} {label}", tps, decode, weight_bytes)]


def bench_workload(
    w: Workload, model_dir: Path, ggufs: dict[str, Path], builds: list[str]
) -> tuple[list[PeerResult], dict]:
    shape = MODELS[w.model][1]
    name = f"{w.model} x{w.streams}"
    results, system_info = [], {}
    for mode, quantization in our_paths():
        tps, decode = run_ours(model_dir, w, mode, quantization)
        label = "fp32" if quantization == "none" else quantization
        results.append(
            PeerResult(name, f"ours {mode} {label}", tps, decode, matmul_bytes(shape, BYTES_PER_WEIGHT[quantization]))
        )
    tps, decode = run_transformers(model_dir, w)
    results.append(PeerResult(name, "transformers static batch", tps, decode, matmul_bytes(shape, 4.0)))
    for build in builds:
        for kind, gguf in ggufs.items():
            try:
                tps, decode, info = run_llamacpp(build, gguf, w)
            except RuntimeError as exc:  # a peer that crashes (seen: llama.cpp's AMX backend) is reported, not fatal
                reason = str(exc).split(":", 1)[0]
                print(f"{name}: llama.cpp {build} {kind}: {reason}; left out", file=sys.stderr, flush=True)
                system_info.setdefault("failed", []).append(f"{name} llama.cpp {build} {kind}: {reason}")
                continue
            system_info[build] = info
            per_weight = BYTES_PER_WEIGHT[kind]
            results.append(PeerResult(name, f"llama.cpp {build} {kind}", tps, decode, matmul_bytes(shape, per_weight)))
    return results, system_info


def print_table(results: list[PeerResult], bandwidth_gbs: float) -> None:
    header = (
        f"{'workload':16} {'path':28} {'out tok/s':>10} {'decode tok/s':>13} {'weights GB/s':>13} {'of copy bw':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        weights_gbs = r.weight_bytes * r.decode_tokens_per_s / 1e9 if r.workload.endswith("x1") else float("nan")
        share = weights_gbs / bandwidth_gbs
        print(
            f"{r.workload:16} {r.path:28} {r.tokens_per_s:>10.1f} {r.decode_tokens_per_s:>13.1f} "
            f"{weights_gbs:>13.1f} {share:>10.0%}"
        )


def ratios(results: list[PeerResult]) -> dict[str, float]:
    """ours / llama.cpp at the same ISA, for the targets of issue #22 (out tok/s)."""
    by = {(r.workload, r.path): r.tokens_per_s for r in results}
    out = {}
    for workload in sorted({r.workload for r in results}):
        for ours, peer in (
            ("ours avx512 fp32", "llama.cpp native f32"),
            ("ours avx512 int8", "llama.cpp native Q8_0"),
            ("ours avx2 fp32", "llama.cpp avx2 f32"),
            ("ours avx2 int8", "llama.cpp avx2 Q8_0"),
            ("ours avx512 int4", "llama.cpp native Q4_0"),
            ("ours avx2 int4", "llama.cpp avx2 Q4_0"),
            ("ours avx512 int4", "ours avx512 int8"),
            ("ours avx2 int4", "ours avx2 int8"),
            ("ours avx512 fp32", "transformers static batch"),
            ("ours avx2 fp32", "transformers static batch"),
            ("ours cuda bfloat16", "transformers cuda bfloat16"),
            ("ours cuda bfloat16 no graphs", "transformers cuda bfloat16"),
            ("ours cuda bfloat16", "ours cuda bfloat16 no graphs"),
            ("ours cuda float32", "transformers cuda float32"),
        ):
            if (workload, ours) in by and (workload, peer) in by:
                out[f"{workload}: {ours} / {peer}"] = by[(workload, ours)] / by[(workload, peer)]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(f"{w.model}x{w.streams}" for w in WORKLOADS))
    p.add_argument("--quick", action="store_true", help="16-token prompts and 4 output tokens: checks the script runs")
    p.add_argument("--skip-linear", action="store_true", help="skip the linear layers against torch's kernels")
    p.add_argument("--skip-quality", action="store_true", help="skip the int8 and int4 quality measurements")
    p.add_argument("--device", default="cpu", help="cuda: the engine against transformers on the GPU (no llama.cpp)")
    p.add_argument("--dtype", default="auto", help="with --device cuda: engine.dtype (auto: bfloat16)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    wanted = set(args.workloads.split(","))
    device = resolve_device(args.device)
    gpu_dtype = resolve_dtype(args.dtype, device, torch.float32) if device.type != "cpu" else None
    isa_modes = [m.value for m in kernels.supported_modes()]
    machine = {**machine_info(float("nan"), device, gpu_dtype or torch.float32), "isa_modes": isa_modes}
    bandwidth = measure_copy_bandwidth_gbs(device=device)
    builds = llama_builds() if gpu_dtype is None else []
    if gpu_dtype is not None:
        args.skip_linear = args.skip_quality = True  # CPU measurements
    elif not builds:
        print("llama.cpp is not built: run `make bench-deps` (about 15-30 minutes) to compare with it")
    results, system_info, failed = [], {}, []
    for w in WORKLOADS:
        if f"{w.model}x{w.streams}" not in wanted:
            continue
        if args.quick:
            w = Workload(w.model, w.streams, 16, 4)
        model_dir = build_model(w.model)
        ggufs = {}
        if builds:
            from bench.gguf_export import quantize_q4_0, quantize_q8_0, write_f32_gguf

            f32 = write_f32_gguf(model_dir, model_dir / "model-f32.gguf")
            ggufs = {
                "f32": f32,
                "Q8_0": _in_llama_process(quantize_q8_0, f32, model_dir / "model-q8_0.gguf"),
                "Q4_0": _in_llama_process(quantize_q4_0, f32, model_dir / "model-q4_0.gguf"),
            }
        if gpu_dtype is not None:
            results += bench_on_gpu(w, model_dir, device, gpu_dtype)
            continue
        rows, info = bench_workload(w, model_dir, ggufs, builds)
        results += rows
        failed += info.pop("failed", [])
        system_info.update(info)
    where = machine["gpu"] if "gpu" in machine else f"{machine['threads']} threads"
    print(
        f"machine: {machine['cpu']} | {where} | kernel ISAs {machine['isa_modes']} | "
        f"copy bandwidth {bandwidth:.1f} GB/s (read + write)"
    )
    for build, info in system_info.items():
        print(f"llama.cpp {build}: {info.strip()}")
    for line in failed:
        print(f"failed, left out: {line}")
    print_table(results, bandwidth)
    summary = ratios(results)
    for name, value in summary.items():
        print(f"  {name}: {value:.2f}x")
    record = {
        "machine": machine,
        "copy_bandwidth_gbs": bandwidth,
        "llama_cpp": system_info,
        "failed": failed,
        "results": [asdict(r) for r in results],
        "ratios": summary,
    }
    if not args.skip_linear:
        from bench.linear_bench import main as linear_main

        record["linear"] = linear_main(QWEN_390M)
    if not args.skip_quality:
        from bench.quant_quality import measure
        from engine.native.quant import Quantization

        for quantization in (Quantization.INT8, Quantization.INT4):
            quality = measure(quantization=quantization)
            print(
                f"{quality.quantization} quality on {quality.model}: held-out perplexity "
                f"{quality.perplexity_fp32:.3f} fp32 vs {quality.perplexity_quantized:.3f} {quality.quantization}; "
                f"greedy agreement with fp32 {quality.greedy_agreement:.1%} "
                f"({quality.num_prompts} prompts x {quality.tokens_per_prompt} tokens)"
            )
            record[f"{quality.quantization}_quality"] = asdict(quality)
    line = json.dumps(record, default=float)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return record


def _in_llama_process(fn, *args):
    """llama.cpp's quantizer, from the native build, in a child process (this one stays llama.cpp-free)."""
    code = (
        f"import sys; from bench.gguf_export import {fn.__name__} as f; "
        "f(*map(__import__('pathlib').Path, sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": f"{LLAMA_BUILDS[llama_builds()[0]]}:{ROOT}"}
    subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, cwd=ROOT, check=True)
    return args[-1]


if __name__ == "__main__":
    main()
