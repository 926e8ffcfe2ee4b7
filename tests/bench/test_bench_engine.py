"""The engine bench's pure parts: exact chat prompts and the FLOP count (bench/workload.py), the target checks
(bench/engine_report.py)."""

from __future__ import annotations

import pytest

from bench.engine_report import checks
from bench.workload import REFERENCE, LoadResult, make_chat_requests, train_bench_tokenizer, workload_flops
from engine.tokenizer import Tokenizer
from testing.tiny_model import write_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("bench-tok")
    write_tokenizer_files(path, train_bench_tokenizer(2048))
    return Tokenizer.from_dir(path)


def test_bench_tokenizer_decodes_every_id_but_the_specials_to_text(tokenizer):
    empty = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == ""]
    assert len(empty) == 3 and tokenizer.vocab_size == 2048


def test_chat_requests_render_to_exactly_the_asked_length_and_are_reproducible(tokenizer):
    reqs = make_chat_requests(tokenizer, 5, 96, 7, seed=3)
    for req in reqs:
        assert len(req.prompt_token_ids) == 96 and req.max_tokens == 7
        assert tuple(tokenizer.encode_chat([{"role": "user", "content": req.user_text}])) == req.prompt_token_ids
    assert len({r.user_text for r in reqs}) == 5
    assert make_chat_requests(tokenizer, 5, 96, 7, seed=3) == reqs


def test_workload_flops_counts_about_two_flops_per_parameter_per_token():
    per_token = workload_flops(1, 1, 1)  # one fed token (the prompt); the sampled one is never fed
    params = 26.75e6  # the reference model, tied embeddings counted once (as the LM head)
    assert 2 * params * 0.99 < per_token < 2 * params * 1.01
    r = REFERENCE
    attention = 4 * r["num_hidden_layers"] * r["hidden_size"]  # per token of context
    assert workload_flops(10, 1, 1) == pytest.approx(10 * per_token + attention * sum(range(1, 10)), rel=1e-9)


def _result(name: str, concurrency: int, tok_s: float, fraction: float = 0.0) -> LoadResult:
    return LoadResult(name, concurrency, 8, 1.0, 0, 8, tok_s, 1, 1, 1, 1, fraction)


def test_checks_compare_against_the_baselines_and_report_only_what_ran():
    engine = [_result("native engine", 1, 200), _result("native engine", 32, 900, 0.4)]
    http = [_result("HTTP", 1, 190), _result("HTTP", 32, 700)]
    hf = [_result("transformers one-at-a-time", 1, 100), _result("transformers static batch 32", 32, 500)]
    out = checks(engine, http, hf, {"ratio": 2.5}, {"ratio": 0.3})
    assert out["ratios"]["conc32_vs_static_batch"] == pytest.approx(1.8)
    assert out["pass"] == {
        "conc32_ge_1.5x_static": True,
        "conc32_ge_35pct_compute": True,
        "conc1_ge_2x_one_at_a_time": True,
        "http_within_15pct_conc1": True,
        "http_within_15pct_conc32": False,
        "chunked_prefill_p99_lt_3x_median": True,
        "prefix_warm_le_one_fifth_cold": False,
    }
    assert checks(engine, [], [], None, None)["pass"] == {"conc32_ge_35pct_compute": True}
