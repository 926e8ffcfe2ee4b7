"""LLMEngine on a tiny model: admission checks, abort at every stage, cache scopes, stats."""

from __future__ import annotations

import pytest

from engine.native.llm_engine import LLMEngine
from engine.native.loader import load_model_args
from engine.native.sequence import SequenceStatus
from engine.types import FinishReason, GenerationRequest, RequestRejected, SamplingParams
from native_harness import ON_DEVICE, check_invariants
from settings import EngineConfig

VARIANT = "tied-gqa-parameters"
BLOCK_BYTES = 8192  # 2 layers x K,V x 16 tokens x 2 KV heads x 16 dims x 4 bytes


def make_engine(tiny_models, num_blocks: int = 16, **overrides) -> LLMEngine:
    config = EngineConfig(
        **ON_DEVICE,
        kv_cache_bytes=num_blocks * BLOCK_BYTES,
        **{"max_num_batched_tokens": 32, "max_num_seqs": 4, **overrides},
    )
    return LLMEngine.from_model_dir(tiny_models.path(VARIANT), config, eos_token_ids=(2,))


def req(request_id: str, prompt: list[int], max_tokens: int = 8, **kw) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id, tuple(prompt), sampling, **kw)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_invariants(engine.block_manager, engine.scheduler.running + engine.scheduler.waiting)
    return out


def test_a_request_that_could_never_fit_the_cache_is_rejected_naming_the_numbers(tiny_models):
    engine = make_engine(tiny_models, num_blocks=4)  # 64 tokens of KV
    with pytest.raises(
        RequestRejected, match=r"needs 80 tokens of KV cache \(60 prompt \+ 20 max_tokens\).*holds 64"
    ) as exc:
        engine.add_request(req("big", [5] * 60, max_tokens=20))
    assert exc.value.param == "max_tokens"
    engine.check_request(req("fits", [5] * 60, max_tokens=5))


def test_a_request_past_the_context_window_is_rejected(tiny_models):
    engine = make_engine(tiny_models, num_blocks=64)
    with pytest.raises(RequestRejected, match=r"context window is 512 tokens.*needs 530") as exc:
        engine.check_request(req("long", [5] * 500, max_tokens=30))
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="empty"):
        engine.check_request(req("empty", [], max_tokens=3))


def test_duplicate_request_ids_are_refused(tiny_models):
    engine = make_engine(tiny_models)
    engine.add_request(req("same", [5, 6]))
    with pytest.raises(RequestRejected, match="already running"):
        engine.add_request(req("same", [7, 8]))


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_every_stage_frees_all_blocks(tiny_models, stage):
    engine = make_engine(tiny_models, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=16)
    engine.add_request(req("keeper", [9] * 20, max_tokens=40, priority=1))
    engine.add_request(req("victim", list(range(3, 35)), max_tokens=40))
    engine.add_request(req("third", [4] * 8, max_tokens=20))
    victim = next(s for s in engine.scheduler.waiting if s.request_id == "victim")
    conditions = {
        "waiting": lambda: True,
        "prefilling": lambda: victim.status is SequenceStatus.RUNNING and 0 < victim.num_computed_tokens < 32,
        "decoding": lambda: victim.status is SequenceStatus.RUNNING and victim.num_completion_tokens > 0,
        "preempted": lambda: engine.scheduler.num_preemptions > 0 and victim.status is SequenceStatus.WAITING,
    }
    while not conditions[stage]():
        engine.step()
    out = engine.abort_request("victim")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert victim.block_table == [] and victim.is_finished
    check_invariants(engine.block_manager, engine.scheduler.running + engine.scheduler.waiting, [victim])
    assert engine.abort_request("victim") is None  # harmless twice
    outputs = run(engine)
    assert "victim" not in outputs and len(outputs["keeper"]) + 0 > 0
    assert engine.block_manager.num_free_blocks == 6 and engine.num_requests == 0


def test_cache_is_salted_per_tenant_unless_configured_shared(tiny_models):
    system = list(range(3, 40))
    for scope, expect_hit in (("org", False), ("shared", True)):
        engine = make_engine(tiny_models, num_blocks=32, prefix_cache_scope=scope, max_num_batched_tokens=128)
        engine.add_request(req("a", system + [50], cache_salt="org-a"))
        run(engine)
        engine.add_request(req("b", system + [60], cache_salt="org-b"))
        engine.add_request(req("a2", system + [70], cache_salt="org-a"))
        engine.step()
        cached = {s.request_id: s.num_cached_tokens for s in engine.scheduler.running}
        assert cached["a2"] == 32
        assert (cached["b"] == 32) is expect_hit
        run(engine)


def test_outputs_report_cached_tokens_and_stats_count_the_work(tiny_models):
    engine = make_engine(tiny_models, num_blocks=32)
    engine.add_request(req("first", list(range(3, 40)), max_tokens=4))
    run(engine)
    engine.add_request(req("second", list(range(3, 40)) + [99], max_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 32 and outs[-1].num_prompt_tokens == 38
    assert outs[-1].num_completion_tokens == 4 and outs[-1].finish_reason is FinishReason.LENGTH
    stats = engine.stats()
    assert stats.prefix_cache_queries == 37 + 38 and stats.prefix_cache_hits == 32
    assert stats.num_prompt_tokens_processed == 37 + (38 - 32)
    assert stats.num_generation_tokens == 8
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total == 32


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(tiny_models):
    prompt = [40, 41, 42, 43]
    free_run = make_engine(tiny_models)
    free_run.add_request(req("free", prompt, max_tokens=12))
    tokens = run(free_run)["free"]
    eos = tokens[5]
    first_eos = tokens.index(eos)
    engine = LLMEngine(free_run.runner, free_run.config, eos_token_ids=(eos,))
    engine.add_request(GenerationRequest("stops", tuple(prompt), SamplingParams(max_tokens=12, temperature=0.0)))
    min_tokens = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=first_eos + 2)
    engine.add_request(GenerationRequest("held", tuple(prompt), min_tokens))
    out = run(engine)
    assert out["stops"] == tokens[: first_eos + 1]
    assert len(out["held"]) >= first_eos + 2 and eos not in out["held"][: first_eos + 1]


def test_sampled_requests_draw_on_the_engines_device_and_a_seed_repeats(tiny_models):
    # Unseeded draws use the sampler's own generator, seeded ones one per request: both must live
    # on the device of the logits (TEST_DEVICE), or the draw fails there.
    engine = make_engine(tiny_models)
    prompt = [5, 6, 7, 8]

    def sampled(request_id: str, seed: int | None) -> GenerationRequest:
        params = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True, seed=seed)
        return GenerationRequest(request_id, tuple(prompt), params)

    for r in (sampled("free-a", None), sampled("free-b", None), sampled("seed-a", 7), sampled("seed-b", 7)):
        engine.add_request(r)
    out = run(engine)
    assert all(len(tokens) == 12 for tokens in out.values())
    assert out["seed-a"] == out["seed-b"]
    vocab = load_model_args(tiny_models.path(VARIANT)).vocab_size
    assert all(0 <= t < vocab for tokens in out.values() for t in tokens)


def _transformers_prompt_logprobs(tiny_models, prompt: list[int]) -> list[float]:
    """log p(prompt[p] | prompt[:p]) for p >= 1, from transformers' logits."""
    import torch

    with torch.inference_mode():
        logits = tiny_models.reference(VARIANT)(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[p - 1, prompt[p]].item() for p in range(1, len(prompt))]


# The whole prompt in one step; in chunks (the last of one token); past a slice of scored rows (64).
@pytest.mark.parametrize(("chunk", "length"), [(32, 29), (7, 29), (160, 150)])
def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(tiny_models, chunk, length):
    engine = make_engine(tiny_models, num_blocks=16, max_num_batched_tokens=chunk)
    prompt = [(7 * i + 3) % 200 + 3 for i in range(length)]
    expected = _transformers_prompt_logprobs(tiny_models, prompt)
    for round_ in range(2):  # the second time its blocks are cached: still every position is computed
        sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
        engine.add_request(GenerationRequest(f"r{round_}", tuple(prompt), sampling))
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                first = first or o
            check_invariants(engine.block_manager, engine.scheduler.running + engine.scheduler.waiting)
        assert first is not None and first.num_cached_tokens == 0
        got = first.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        assert [lp.token_id for lp in got[1:]] == prompt[1:]
        assert [lp.logprob for lp in got[1:]] == pytest.approx(expected, abs=1e-4)
        for lp in got[1:]:
            assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][1] >= lp.logprob - 1e-6
    # A request that does not ask hits the cache as before.
    engine.add_request(req("plain", prompt, max_tokens=2))
    outs = [o for _ in range(4) for o in engine.step()]
    assert outs[0].num_cached_tokens > 0 and outs[0].prompt_logprobs == ()
