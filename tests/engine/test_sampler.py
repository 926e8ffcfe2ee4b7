"""Sampler: greedy, seeded reproducibility, temperature/top-k/top-p, penalties, min_tokens."""

from __future__ import annotations

from collections import Counter

import torch

from engine.native.sampler import Sampler, SamplingRow
from engine.types import SamplingParams

VOCAB = 10
EOS = 9


def row(completion: list[int] | None = None, **params) -> SamplingRow:
    prompt = [1, 2, 3]
    sampling = SamplingParams(max_tokens=100, **params)
    return SamplingRow(sampling, prompt + (completion or []), len(prompt), frozenset({EOS}))


def logits_of(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def test_greedy_takes_the_argmax_of_each_row():
    logits = torch.randn(4, VOCAB)
    assert Sampler(VOCAB, seed=0)(logits, [row(temperature=0.0)] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_repeats_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB)
    seeded = row(temperature=1.0, seed=1234)
    alone = [Sampler(VOCAB)(logits, [seeded])[0] for _ in range(5)]
    crowd = Sampler(VOCAB)(torch.cat([torch.randn(3, VOCAB), logits]), [row(temperature=1.0)] * 3 + [seeded])[-1]
    assert len(set(alone)) == 1 and crowd == alone[0]


def test_a_seeded_request_draws_a_fresh_value_at_every_position():
    logits = torch.zeros(1, VOCAB)  # uniform: a stuck generator would repeat one token
    tokens = [Sampler(VOCAB)(logits, [row(list(range(n)), temperature=1.0, seed=7)])[0] for n in range(30)]
    assert len(set(tokens)) > 3


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, VOCAB)
    a = [Sampler(VOCAB)(logits, [row([0] * n, temperature=1.0, seed=1)])[0] for n in range(20)]
    b = [Sampler(VOCAB)(logits, [row([0] * n, temperature=1.0, seed=2)])[0] for n in range(20)]
    assert a != b


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(8, VOCAB)
    sampler = Sampler(VOCAB, seed=0)
    assert sampler(logits, [row(temperature=1.5, top_k=1)] * 8) == logits.argmax(-1).tolist()
    assert sampler(logits, [row(temperature=1.5, top_p=1e-6)] * 8) == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_best():
    logits = logits_of(5, 4, 3, 0, 0, 0, 0, 0, 0, 0)
    sampler = Sampler(VOCAB, seed=0)
    drawn = Counter(sampler(logits.repeat(200, 1), [row(temperature=5.0, top_k=3)] * 200))
    assert set(drawn) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * 6])
    logits = torch.log(probs.clamp_min(1e-12))
    drawn = Counter(Sampler(VOCAB, seed=0)(logits.repeat(300, 1), [row(temperature=1.0, top_p=0.75)] * 300))
    assert set(drawn) == {0, 1}


def test_temperature_sampling_follows_the_softmax():
    logits = logits_of(2.0, 1.0, 0.0, *([-30.0] * 7))
    n = 4000
    drawn = Counter(Sampler(VOCAB, seed=3)(logits.repeat(n, 1), [row(temperature=1.0)] * n))
    expected = torch.softmax(logits[0], -1)[:3]
    for token in range(3):
        assert abs(drawn[token] / n - expected[token].item()) < 0.03


def test_frequency_penalty_counts_repeats_and_presence_penalty_does_not():
    logits = logits_of(0, 0, 0, 0, 3.0, 2.5, 0, 0, 0, 0)
    sampler = Sampler(VOCAB, seed=0)
    # Token 4 appeared twice: frequency 0.3 costs 0.6 (beaten by 5); presence 0.3 costs 0.3 (still wins).
    assert sampler(logits, [row([4, 4], temperature=0.0, frequency_penalty=0.3)]) == [5]
    assert sampler(logits, [row([4, 4], temperature=0.0, presence_penalty=0.3)]) == [4]
    assert sampler(logits, [row([4, 4], temperature=0.0, presence_penalty=0.6)]) == [5]
    assert sampler(logits, [row([], temperature=0.0, frequency_penalty=2.0)]) == [4]


def test_negative_penalties_encourage_repeats():
    logits = logits_of(0, 0, 0, 0, 2.0, 2.5, 0, 0, 0, 0)
    assert Sampler(VOCAB, seed=0)(logits, [row([4], temperature=0.0, presence_penalty=-1.0)]) == [4]


def test_min_tokens_suppresses_stop_tokens_until_reached():
    logits = logits_of(0, 0, 0, 0, 0, 1.0, 0, 0, 0, 5.0)  # EOS (9) is the argmax
    sampler = Sampler(VOCAB, seed=0)
    assert sampler(logits, [row([5], temperature=0.0, min_tokens=3)]) == [5]
    assert sampler(logits, [row([5, 5, 5], temperature=0.0, min_tokens=3)]) == [EOS]
    assert all(t != EOS for t in sampler(logits.repeat(50, 1), [row([], temperature=2.0, min_tokens=2)] * 50))


def test_logits_past_the_vocabulary_are_never_chosen():
    logits = torch.cat([torch.zeros(1, VOCAB), torch.full((1, 6), 100.0)], dim=1)  # padded lm_head
    assert Sampler(VOCAB, seed=0)(logits, [row(temperature=0.0)]) == [0]


def test_repetition_penalty_matches_transformers_per_row_in_one_batch():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB) * 4  # both signs, so division and multiplication both show
    rows = []
    for completion, penalty in (([4, 4, 7], 1.7), ([8], 1.0), ([0, 5], 0.6)):
        r = row(completion, temperature=0.0, repetition_penalty=penalty, logprobs=VOCAB)
        rows.append(SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, r.stop_token_ids, logprobs_sink=[]))
    Sampler(VOCAB, seed=0)(logits, rows)
    for r, line in zip(rows, logits, strict=True):
        processor = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)
        reference = torch.log_softmax(processor(torch.tensor([r.token_ids]), line[None].clone())[0], dim=-1)
        ours = dict(r.logprobs_sink[0].top_logprobs)  # the whole distribution sampled from
        assert torch.allclose(torch.tensor([ours[t] for t in range(VOCAB)]), reference, atol=1e-5)
    # The prompt's tokens count too, as in transformers: a prompt token barely on top loses.
    line = torch.zeros(1, VOCAB)
    line[0, 1], line[0, 6] = 1.0, 0.9
    assert Sampler(VOCAB)(line, [row(temperature=0.0, repetition_penalty=1.2)]) == [6]


def test_seen_tokens_follow_a_growing_sequence_step_by_step():
    from engine.native.sampler import SeenTokens

    seen = SeenTokens(VOCAB, torch.device("cpu"))
    tokens = [1, 2]
    assert seen.update(tokens).nonzero().flatten().tolist() == [1, 2]
    tokens += [6, 2, 99]  # an id past the vocabulary (padding heads) is ignored, not an error
    assert seen.update(tokens).nonzero().flatten().tolist() == [1, 2, 6]
    assert seen.num_tokens == 5


def test_rows_that_need_no_processing_keep_plain_argmax_beside_rows_that_do():
    """Free greedy rows stay on the argmax path; the processed rows (penalties, sampling) get the
    same tokens as in a batch of their own, whatever shares the batch."""
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB)
    penalized = row([int(logits[1].argmax())], temperature=0.0, repetition_penalty=50.0)
    seeded = row(temperature=1.0, seed=7)
    rows = [row(temperature=0.0), penalized, row(temperature=0.0), seeded, row(temperature=0.0), row(temperature=0.0)]
    tokens = Sampler(VOCAB)(logits, rows)
    assert [tokens[i] for i in (0, 2, 4, 5)] == [int(logits[i].argmax()) for i in (0, 2, 4, 5)]
    assert tokens[1] == Sampler(VOCAB)(logits[1:2], [penalized])[0] != int(logits[1].argmax())
    assert tokens[3] == Sampler(VOCAB)(logits[3:4], [seeded])[0]


def test_greedy_ties_go_to_the_first_index_in_float32_and_bfloat16():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0] + [0.0] * (VOCAB - 4)])
    for dtype in (torch.float32, torch.bfloat16):
        assert Sampler(VOCAB)(logits.to(dtype), [row(temperature=0.0)]) == [1]


def test_logit_bias_bans_and_forces_tokens_in_a_batch_of_plain_greedy_rows():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 0, 0, 0, 0, 0, 0]] * 3)
    rows = [
        row(temperature=0.0),  # plain argmax: 1
        row(temperature=0.0, logit_bias=((1, -100.0),)),  # banned: the runner-up
        row(temperature=0.0, logit_bias=((0, 7.0), (3, 2.0))),  # 0 + 7 beats 5
    ]
    assert Sampler(VOCAB, seed=0)(logits, rows) == [1, 2, 0]
    draws = [Sampler(VOCAB)(logits[:1], [row(temperature=1.0, logit_bias=((7, 100.0),))])[0] for _ in range(20)]
    assert set(draws) == {7}  # sampled too: +100 makes it all but certain


def test_logprobs_are_those_of_the_biased_distribution():
    logits = logits_of(*([0.0] * VOCAB))
    sink: list = []
    r = SamplingRow(
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, logit_bias=((4, 3.0),)),
        [1],
        1,
        frozenset(),
        logprobs_sink=sink,
    )
    assert Sampler(VOCAB)(logits, [r]) == [4]
    expected = torch.log_softmax(torch.tensor([0.0] * 4 + [3.0] + [0.0] * 5), -1)[4].item()
    assert abs(sink[0].logprob - expected) < 1e-5
