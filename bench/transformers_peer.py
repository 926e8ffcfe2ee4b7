"""transformers as the engine bench's peer: one request at a time, a static batch, and its own
continuous batching (generate_batch), on the engine's device in its dtype, timed as LoadResults.
Greedy with EOS out of reach, like the engine's load; it must not touch the engine.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from bench.machine import synchronize
from bench.workload import BenchRequest, LoadResult, Plan, make_chat_requests, pct, with_fraction, workload_flops
from engine.tokenizer import Tokenizer

NEVER_EOS = 10**9  # an id past the vocabulary: transformers runs to max_new_tokens


def _hf_config(model, max_tokens: int):
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = max_tokens, None, False
    config.eos_token_id, config.pad_token_id = NEVER_EOS, 0
    return config


@torch.inference_mode()
def hf_one_at_a_time(model, requests: list[BenchRequest]) -> LoadResult:
    ttfts, num_out = [], 0
    start = time.perf_counter()
    for req in requests:
        ids = torch.tensor([req.prompt_token_ids], device=model.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, 1))
        synchronize(model.device)
        ttfts.append((time.perf_counter() - t0) * 1e3)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, req.max_tokens)
        )
        num_out += out.shape[1] - ids.shape[1]
    synchronize(model.device)
    # TTFT runs are separate prefills; subtract them from the wall time of the generation runs.
    wall = time.perf_counter() - start - sum(ttfts) / 1e3
    return LoadResult(
        "transformers one-at-a-time",
        1,
        len(requests),
        wall,
        0,
        num_out,
        num_out / wall,
        pct(ttfts, 50),
        pct(ttfts, 99),
        float("nan"),
        float("nan"),
    )


@torch.inference_mode()
def hf_static_batch(model, requests: list[BenchRequest], batch_size: int) -> LoadResult:
    num_out = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        # Equal lengths: no padding.
        ids = torch.tensor([r.prompt_token_ids for r in requests[i : i + batch_size]], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_hf_config(model, requests[i].max_tokens)
        )
        num_out += out[:, ids.shape[1] :].numel()
    synchronize(model.device)
    wall = time.perf_counter() - start
    return LoadResult.throughput_only(
        f"transformers static batch {batch_size}", batch_size, len(requests), wall, num_out
    )


@torch.no_grad()  # not inference_mode: transformers' continuous batching updates its tensors in place
def hf_generate_batch(model, requests: list[BenchRequest]) -> LoadResult | None:
    if not hasattr(model, "generate_batch"):
        return None
    # Its first call sets up the paged cache and takes seconds: warm it up like the others.
    model.generate_batch(inputs=[list(requests[0].prompt_token_ids)], generation_config=_hf_config(model, 4))
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[list(r.prompt_token_ids) for r in requests], generation_config=_hf_config(model, requests[0].max_tokens)
    )
    wall = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    return LoadResult.throughput_only("transformers generate_batch", len(requests), len(requests), wall, num_out)


def bench_transformers(
    model_dir: Path, plan: Plan, peak_gflops: float, skip_generate_batch: bool, device: torch.device, dtype: torch.dtype
) -> list[LoadResult]:
    """transformers on the engine's device, in the engine's dtype."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    reqs = make_chat_requests(
        tokenizer, max(plan.hf_static_requests, 32), plan.prompt_len, plan.output_len, seed=32, prefix="hf"
    )
    one = hf_one_at_a_time(model, reqs[: plan.hf_one_at_a_time_requests])
    batch = min(32, plan.hf_static_requests)
    static = hf_static_batch(model, reqs[: plan.hf_static_requests], batch)
    flops = workload_flops(plan.prompt_len, plan.output_len, plan.hf_static_requests)
    results = [with_fraction(one, workload_flops(plan.prompt_len, plan.output_len, one.num_requests), peak_gflops)]
    results.append(with_fraction(static, flops, peak_gflops))
    if not skip_generate_batch:
        cb = hf_generate_batch(model, reqs[: plan.hf_generate_batch_requests])
        if cb is not None:
            results.append(
                with_fraction(cb, workload_flops(plan.prompt_len, plan.output_len, cb.num_requests), peak_gflops)
            )
    return results
