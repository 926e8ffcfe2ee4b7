"""The engine bench's verdict and report: each target's ratio and pass/fail from the run's
figures, the table, and the restart lines. Reads results only; runs nothing.
"""

from __future__ import annotations

from bench.workload import LoadResult


def checks(
    engine: list[LoadResult], http: list[LoadResult], hf: list[LoadResult], itl: dict | None, prefix: dict | None
) -> dict:
    """Each target that this run has the figures for: its ratio and whether it passed."""
    ratios: dict[str, float] = {}
    passed: dict[str, bool] = {}
    by_c = {r.concurrency: r for r in engine}
    one = next((r for r in hf if "one-at-a-time" in r.name), None)
    static = next((r for r in hf if "static" in r.name), None)
    top = by_c.get(32) or (engine[-1] if engine else None)
    if top is not None and static is not None:
        ratios["conc32_vs_static_batch"] = top.output_tokens_per_s / static.output_tokens_per_s
        passed["conc32_ge_1.5x_static"] = ratios["conc32_vs_static_batch"] >= 1.5
    if top is not None:
        ratios["conc32_compute_fraction"] = top.compute_fraction
        passed["conc32_ge_35pct_compute"] = top.compute_fraction >= 0.35
    if 1 in by_c and one is not None:
        ratios["conc1_vs_one_at_a_time"] = by_c[1].output_tokens_per_s / one.output_tokens_per_s
        passed["conc1_ge_2x_one_at_a_time"] = ratios["conc1_vs_one_at_a_time"] >= 2.0
    for h in http:
        if h.concurrency in by_c:
            ratio = h.output_tokens_per_s / by_c[h.concurrency].output_tokens_per_s
            ratios[f"http_vs_engine_conc{h.concurrency}"] = ratio
            passed[f"http_within_15pct_conc{h.concurrency}"] = ratio >= 0.85
    if itl is not None:
        passed["chunked_prefill_p99_lt_3x_median"] = itl["ratio"] < 3.0
    if prefix is not None:
        passed["prefix_warm_le_one_fifth_cold"] = prefix["ratio"] <= 0.2
    return {"ratios": ratios, "pass": passed}


def print_report(rows: list[LoadResult], itl: dict | None, prefix: dict | None, summary: dict, machine: dict) -> None:
    peak = f"{machine['dtype']} matmul peak {machine['peak_gflops']:.0f} GFLOP/s"
    where = f"{machine['gpu']} ({machine['device']})" if "gpu" in machine else f"{machine['threads']} threads"
    print(f"machine: {machine['cpu']} | {where} | {peak}")
    header = (
        f"{'path':34} {'conc':>5} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'compute':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.name:34} {r.concurrency:>5} {r.num_requests:>5} {r.output_tokens_per_s:>10.1f} {r.ttft_ms_p50:>9.1f} "
            f"{r.ttft_ms_p99:>9.1f} {r.itl_ms_p50:>8.1f} {r.itl_ms_p99:>8.1f} {r.compute_fraction:>7.1%}"
        )
    if itl is not None:
        print(
            f"chunked prefill: {itl['long_prompt_tokens']}-token prompt over {itl['streams']} streams: "
            "ITL during prefill "
            f"p50 {itl['itl_ms_p50_during_prefill']:.1f} / p99 {itl['itl_ms_p99_during_prefill']:.1f} / max "
            f"{itl['itl_ms_max_during_prefill']:.1f} ms vs median {itl['itl_ms_median']:.1f} ms: "
            f"p99 = {itl['ratio']:.2f}x (< 3x); "
            f"prefill took {itl['prefill_ms']:.0f} ms"
        )
    if prefix is not None:
        print(
            f"prefix cache: {prefix['system_prompt_tokens']}-token system prompt: "
            f"TTFT warm {prefix['ttft_ms_warm']:.1f} ms "
            f"vs cold {prefix['ttft_ms_cold']:.1f} ms = {prefix['ratio']:.3f} (<= 0.2)"
        )
    for name, value in summary["ratios"].items():
        print(f"  {name}: {value:.3f}")
    if summary["pass"] and machine.get("device", "cpu") != "cpu":
        print("  (the targets below were set for the 2-core CPU; on a GPU they only describe the run)")
    for name, ok in summary["pass"].items():
        print(f"  {'PASS' if ok else 'FAIL'} {name}")


def print_restart(r: dict) -> None:
    print(
        f"\nfirst request after a restart, behind a {r['system_prompt_tokens']}-token system prompt the last "
        f"process saw (medians):\n  prefix cache kept: TTFT {r['ttft_ms_after_restart_kept']:.0f} ms "
        f"(cold {r['ttft_ms_cold_kept']:.0f} ms; the stop took {r['stop_s_kept']:.2f} s)\n"
        f"  not kept:          TTFT {r['ttft_ms_after_restart_not_kept']:.0f} ms "
        f"(cold {r['ttft_ms_cold_not_kept']:.0f} ms; the stop took {r['stop_s_not_kept']:.2f} s)\n"
        f"  ratio kept / not kept: {r['ratio_after_restart_kept_vs_not']:.2f}"
    )
