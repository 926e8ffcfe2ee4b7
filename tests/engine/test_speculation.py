"""Prompt-lookup speculation (engine/native/speculation.py): a lone greedy sequence feeds draft
tokens copied from its own tokens, and the output stays transformers' greedy output token for
token, on every kernel path (the verifying step is a chunk, not a one-token decode)."""

from __future__ import annotations

import random
import zlib

import pytest

from engine.native import speculation
from engine.native.loader import load_model_args
from engine.types import GenerationRequest, SamplingParams
from kernel_modes import ALL_MODES
from native_harness import check_invariants
from test_greedy_equality import engine_for, greedy_arrivals, run_with_arrivals

K = 4


def test_proposals_copy_what_followed_the_latest_earlier_occurrence():
    assert speculation.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert speculation.propose([5, 1, 2, 3, 7, 8, 1, 2, 3, 4, 6, 1, 2, 3], 2) == [4, 6]  # the latest occurrence
    assert speculation.propose([1, 2, 8, 9, 4, 1, 2], 5) == [8, 9, 4, 1, 2]  # two tokens matched
    # A repeating run: the latest copy followed by k tokens, not the latest copy (followed by 2).
    assert speculation.propose([4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5], 4) == [6, 4, 5, 6]
    assert speculation.propose([4, 5, 6, 4, 5, 6, 4, 5], 9) == [6, 4, 5]  # none has 9: the earliest (most)
    assert speculation.propose([1, 2, 3, 4, 5], 4) == []  # no earlier occurrence
    assert speculation.propose([7, 7], 4) == []  # too short to match 2 before the last
    assert speculation.propose([1, 2, 3, 1, 2, 3], 0) == []


def test_verification_keeps_the_drafts_the_model_agrees_with_then_its_own_token():
    assert speculation.verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert speculation.verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert speculation.verify([5, 6, 7], [4, 6, 7, 8]) == [4]


def repetitive_requests(vocab_size: int, seed: str) -> list[tuple[list[int], int, bool]]:
    """(prompt, max_tokens, stops): prompts with repeated runs, so drafts are found and, where the
    model continues a run, kept."""
    rng = random.Random(zlib.crc32(seed.encode()))

    def run(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    motif = run(6)
    return [
        (motif * 6, 40, False),
        (run(5) + motif * 4 + run(3), 33, True),
        (run(20), 30, False),
        (motif * 3 + run(2) + motif, 7, False),  # max_tokens close: drafts cut to fit
    ]


def run_one_at_a_time(tiny_models, variant: str, engine, requests) -> None:
    """Each request alone (so it speculates), its output against transformers' greedy one."""
    arrivals, expected = greedy_arrivals(tiny_models, variant, [(0, *request) for request in requests])
    for (_, request), (request_id, reference) in zip(arrivals, expected.items(), strict=True):
        assert run_with_arrivals(engine, [(0, request)])[request_id] == reference, request_id


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("variant", ["tied-gqa-parameters", "qwen2-qkv-bias", "gemma3", "mistral-sliding"])
def test_speculation_gives_transformers_greedy_output_on_every_path(tiny_models, variant, mode):
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=24, kernel_isa=mode.value, speculative_tokens=K)
    requests = repetitive_requests(load_model_args(model_dir).vocab_size, variant)
    run_one_at_a_time(tiny_models, variant, engine, requests)
    stats = engine.stats()  # what /metrics reads
    assert stats.num_draft_tokens > 0, "no step carried drafts"
    # Random tiny models repeat themselves, so some drafts are kept (each one a step saved).
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens


def test_a_cached_prefix_after_speculation_holds_the_right_tokens(tiny_models):
    # The blocks a speculating sequence filled are registered in the prefix cache only with
    # verified tokens: the same request again hits them and answers the same.
    variant = "tied-gqa-parameters"
    model_dir = tiny_models.path(variant)
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=K)
    prompt, max_tokens, _ = repetitive_requests(load_model_args(model_dir).vocab_size, variant)[0]
    expected = tiny_models.greedy(variant, prompt, max_tokens, None)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first = run_with_arrivals(engine, [(0, GenerationRequest("a", tuple(prompt), sampling))])["a"]
    hits_before = engine.stats().prefix_cache_hits
    again = prompt + first[:30]  # the answer's verified blocks are reused
    expected_again = tiny_models.greedy(variant, again, 8, None)
    second = run_with_arrivals(
        engine, [(0, GenerationRequest("b", tuple(again), SamplingParams(max_tokens=8, temperature=0.0)))]
    )["b"]
    assert first == expected and second == expected_again
    assert engine.stats().prefix_cache_hits > hits_before


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop=("x",), ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=30, ignore_eos=True),
    ],
    ids=["sampled", "logprobs", "penalty", "stop-strings", "min-tokens"],
)
def test_only_plain_greedy_requests_speculate(tiny_models, sampling):
    model_dir = tiny_models.path("tied-gqa-parameters")
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=K)
    prompt = repetitive_requests(load_model_args(model_dir).vocab_size, "x")[0][0]
    run_with_arrivals(engine, [(0, GenerationRequest("r", tuple(prompt), sampling))])
    assert engine.stats().num_draft_tokens == 0


def test_two_running_sequences_do_not_speculate(tiny_models):
    model_dir = tiny_models.path("tied-gqa-parameters")
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=K)
    prompt = repetitive_requests(load_model_args(model_dir).vocab_size, "y")[0][0]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [(0, GenerationRequest(f"r{i}", tuple(prompt), sampling)) for i in range(2)]
    outputs = run_with_arrivals(engine, requests)
    assert outputs["r0"] == outputs["r1"]
    assert engine.stats().num_draft_tokens == 0


def test_a_failed_step_takes_its_drafts_back(tiny_models, monkeypatch):
    model_dir = tiny_models.path("tied-gqa-parameters")
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=K)
    prompt = repetitive_requests(load_model_args(model_dir).vocab_size, "z")[0][0]
    engine.add_request(GenerationRequest("r", tuple(prompt), SamplingParams(max_tokens=30, temperature=0.0)))
    for _ in range(30):  # until the next step would carry drafts
        engine.step()
        seq = engine.scheduler.running[0]
        if seq.num_uncomputed_tokens == 1 and speculation.propose(seq.token_ids, K):
            break
    else:
        pytest.fail("no step would have carried drafts")
    tokens = list(seq.token_ids)
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert seq.token_ids == tokens and seq.num_draft_tokens == 0
    check_invariants(engine.block_manager, [seq])


def test_a_sequence_whose_drafts_are_mostly_wrong_stops_drafting(tiny_models):
    model_dir = tiny_models.path("tied-gqa-parameters")
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=K)
    prompt = repetitive_requests(load_model_args(model_dir).vocab_size, "w")[0][0]
    engine.add_request(GenerationRequest("r", tuple(prompt), SamplingParams(max_tokens=30, temperature=0.0)))
    engine.step()  # the prompt
    seq = engine.scheduler.running[0]
    assert speculation.eligible(seq)
    seq.num_drafted, seq.num_kept = 16, 3  # fewer than a quarter kept
    assert not speculation.eligible(seq)
    drafted = engine.stats().num_draft_tokens
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_draft_tokens == drafted
