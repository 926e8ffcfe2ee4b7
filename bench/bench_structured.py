"""`make bench` section "structured": what a grammar-constrained request costs per token.

Measured on the running native backend: the inter-token latency of one JSON-schema request
against one free request (same prompt, greedy), and the free rows' ITL in an 8-stream batch
with and without one constrained neighbour (the mask must not slow them). Self-contained:
bench_engine.py only calls `structured_overhead` and `print_structured`.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from engine.native.backend import NativeBackend
from engine.types import GenerationRequest, SamplingParams, StructuredKind, StructuredOutput

# Long enough to measure many tokens: an array of short strings, closed only by maxItems.
_SCHEMA = (
    '{"type":"object","properties":{"items":{"type":"array","minItems":40,"maxItems":40,'
    '"items":{"type":"string","minLength":3,"maxLength":8}}},"required":["items"],"additionalProperties":false}'
)
_STRUCTURED = StructuredOutput(StructuredKind.JSON_SCHEMA, _SCHEMA)


async def _itl(backend: NativeBackend, request: GenerationRequest) -> tuple[float, int]:
    """(mean milliseconds per token after the first, tokens): the span over the count, which stays
    right when a busy event loop hands several tokens over at once."""
    times = []
    async for event in backend.generate(request):
        if event.token_ids:
            times.append(time.perf_counter())
    return (times[-1] - times[0]) * 1e3 / max(len(times) - 1, 1), len(times)


def _request(request_id: str, prompt: tuple[int, ...], max_tokens: int, constrained: bool) -> GenerationRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=not constrained,
        structured=_STRUCTURED if constrained else None,
    )
    return GenerationRequest(request_id, prompt, sampling)


async def structured_overhead(
    backend: NativeBackend, prompt: tuple[int, ...], *, max_tokens: int = 96, rounds: int = 5
) -> dict:
    await _itl(backend, _request("s-warm", prompt, 8, True))  # compiles the schema once (cached after)
    free_ms, _ = await _itl(backend, _request("s-free", prompt, max_tokens, False))
    json_ms, num_json = await _itl(backend, _request("s-json", prompt, max_tokens, True))
    # Alternate the two batches a few times: one pair is within the machine's noise (~5%).
    ratios, alone_ms, mixed_ms = [], [], []
    for r in range(rounds):
        alone = await asyncio.gather(
            *(_itl(backend, _request(f"s-b{r}-{i}", prompt, max_tokens, False)) for i in range(8))
        )
        mixed = await asyncio.gather(
            _itl(backend, _request(f"s-m{r}-json", prompt, max_tokens, True)),
            *(_itl(backend, _request(f"s-m{r}-{i}", prompt, max_tokens, False)) for i in range(7)),
        )
        alone_ms.append(statistics.median(ms for ms, _ in alone))
        mixed_ms.append(statistics.median(ms for ms, _ in mixed[1:]))
        ratios.append(mixed_ms[-1] / alone_ms[-1])
    batch_free_ms, batch_mixed_ms = statistics.median(alone_ms), statistics.median(mixed_ms)
    return {
        "itl_ms_free": free_ms,
        "itl_ms_constrained": json_ms,
        "overhead_ms_per_token": json_ms - free_ms,
        "constrained_tokens": num_json,
        "batch8_free_rows_itl_ms": batch_free_ms,
        "batch8_free_rows_itl_ms_with_one_constrained": batch_mixed_ms,
        "free_rows_ratio": statistics.median(ratios),
        "free_rows_ratios": ratios,
    }


def print_structured(s: dict) -> None:
    print(
        f"structured output (llguidance mask): ITL {s['itl_ms_constrained']:.2f} ms constrained vs "
        f"{s['itl_ms_free']:.2f} ms free = +{s['overhead_ms_per_token']:.2f} ms/token over "
        f"{s['constrained_tokens']} tokens; 8-stream batch, free rows' ITL "
        f"{s['batch8_free_rows_itl_ms_with_one_constrained']:.2f} "
        f"ms with one constrained neighbour vs {s['batch8_free_rows_itl_ms']:.2f} ms without "
        f"({s['free_rows_ratio']:.3f}x, median of "
        f"{', '.join(f'{r:.3f}' for r in s['free_rows_ratios'])})"
    )


def main(argv: list[str] | None = None) -> dict:
    """The same measurement on a model of the size people run: `make bench` times it on the 26.7M
    reference (a ~5 ms step), where a mask's fixed cost per step weighs most; this runs it on the
    390M model of Qwen2.5-0.5B's shape (bench/bench_peers.py, random weights, 32k vocabulary)."""
    import argparse

    from bench.bench_engine import engine_config, parse_args
    from bench.bench_peers import MODELS, build_model
    from bench.workload import FULL as PLAN
    from bench.workload import load_requests, train_bench_tokenizer
    from engine.tokenizer import Tokenizer
    from testing.tiny_model import write_tokenizer_files

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen-390m")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args, rest = p.parse_known_args(argv)
    model_dir = build_model(args.model)
    if not (model_dir / "tokenizer.json").exists():  # the grammar reads the model's vocabulary
        write_tokenizer_files(model_dir, train_bench_tokenizer(MODELS[args.model][1]["vocab_size"]))

    async def run() -> dict:
        tokenizer = Tokenizer.from_dir(model_dir)
        backend = NativeBackend(model_dir, engine_config(parse_args(rest)), tokenizer)
        await backend.start()
        try:
            prompt = load_requests(tokenizer, PLAN, 1)[0].prompt_token_ids
            return await structured_overhead(backend, prompt, max_tokens=args.max_tokens, rounds=args.rounds)
        finally:
            await backend.shutdown()

    result = asyncio.run(run())
    print(f"{args.model}: ", end="")
    print_structured(result)
    return result


if __name__ == "__main__":
    main()
