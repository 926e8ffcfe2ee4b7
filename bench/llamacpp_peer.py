"""llama.cpp as a peer: greedy decoding of N streams through its batch API (llama-cpp-python's
low-level bindings), timed like the engine. Runs in its own process (`python -m
bench.llamacpp_peer ...`, one JSON line out) so two llama.cpp builds (native and AVX2-only, from
`make bench-deps`) can be measured in one bench run: PYTHONPATH picks the build.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np


def make_prompts(num_streams: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The same random prompts for every path of the bench."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num_streams)]


def _fill(batch, entries: list[tuple[int, int, int, bool]]) -> None:
    """entries: (token, position, sequence, wants logits)."""
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    batch.n_tokens = len(entries)


def _clear_memory(llama_cpp, ctx) -> None:
    if hasattr(llama_cpp, "llama_memory_clear"):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    else:
        llama_cpp.llama_kv_self_clear(ctx)


def run(gguf: str, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    n = len(prompts)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n * (len(prompts[0]) + output_len + 16)
    params.n_batch = params.n_ubatch = max(512, n * len(prompts[0]))
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, n)

    def step(entries) -> list[int]:
        _fill(batch, entries)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, e in enumerate(entries) if e[3]]
        return [
            int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab_size,)).argmax())
            for i in rows
        ]

    def generate() -> tuple[float, float, list[list[int]]]:
        _clear_memory(llama_cpp, ctx)
        start = time.perf_counter()
        entries = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        outputs = [[t] for t in step(entries)]
        first = time.perf_counter()
        for k in range(output_len - 1):
            outputs = [
                o + [t]
                for o, t in zip(
                    outputs, step([(o[-1], len(prompts[s]) + k, s, True) for s, o in enumerate(outputs)]), strict=True
                )
            ]
        return start, first, outputs

    generate()  # warm-up (page in the weights, size the buffers)
    start, first, outputs = generate()
    end = time.perf_counter()
    info = llama_cpp.llama_print_system_info().decode()
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {
        "tokens_per_s": n * output_len / (end - start),
        "decode_tokens_per_s": n * (output_len - 1) / (end - first),
        "ttft_ms": (first - start) * 1e3,
        "system_info": info,
        "first_tokens": [o[:8] for o in outputs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    prompts = make_prompts(args.streams, args.prompt_len, args.vocab_size, args.seed)
    print(json.dumps(run(args.gguf, prompts, args.output_len, args.threads)))


if __name__ == "__main__":
    main()
