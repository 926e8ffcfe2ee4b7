"""A thinking budget (SamplingParams.thinking) in the native engine: once the budget is spent
inside a thinking block, the closing tokens are forced, and then the model goes on from them
exactly as transformers would from that text (the forced tokens' K/V are computed like any
other token's). Tag ids here are ordinary ids of the tiny model, picked from its own output."""

from __future__ import annotations

import json

import pytest

from engine.native import speculation
from engine.native.loader import load_model_args
from engine.native.thinking import ThinkingState
from engine.types import GenerationRequest, SamplingParams, ThinkingBudget
from kernel_modes import ALL_MODES
from test_greedy_equality import engine_for, run_with_arrivals

VARIANT = "tied-gqa-parameters"
MAX_TOKENS = 24


def test_the_state_counts_thinking_tokens_and_forces_the_closing_ones():
    budget = ThinkingBudget(max_tokens=2, open_id=10, close_id=11, forced_ids=(20, 21, 11))
    state = ThinkingState(budget)
    forced = []
    for token in [5, 10, 6, 7]:  # outside, then the block opens and two tokens are spent
        assert state.forced_token() is None
        state.observe(token)
    while state.forced_token() is not None:
        forced.append(state.forced_token())
        state.observe(forced[-1])
    assert forced == [20, 21, 11] and not state.inside
    state.observe(10)  # a second block: the budget is already spent, so it closes at once
    assert state.forced_token() == 20
    closed_by_model = ThinkingState(budget)
    for token in [10, 6, 11, 7, 8, 9]:  # closed after one token: the rest is answer
        closed_by_model.observe(token)
        assert closed_by_model.forced_token() is None
    assert ThinkingState(ThinkingBudget(0, 10, 11, (11,), opened=True)).forced_token() == 11


def prompt_for(model_dir) -> list[int]:
    vocab = load_model_args(model_dir).vocab_size
    return [(7 * i + 3) % vocab for i in range(12)]


def request(prompt: list[int], budget: ThinkingBudget | None, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, thinking=budget, **sampling)
    return GenerationRequest("r", tuple(prompt), params)


def unused_ids(vocab: int, used: list[int], n: int) -> list[int]:
    return [t for t in range(3, vocab) if t not in used][:n]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_spent_budget_forces_the_closing_tokens_and_the_model_goes_on_from_them(tiny_models, mode):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24, kernel_isa=mode.value)
    prompt = prompt_for(model_dir)
    ref = tiny_models.greedy(VARIANT, prompt, MAX_TOKENS, None)
    close, message = unused_ids(load_model_args(model_dir).vocab_size, ref, 3)[0], [4, 5]
    forced = (*message, close)
    # The prompt opened the block (a template that ends in <think>): 5 tokens of thinking.
    opened = ThinkingBudget(max_tokens=5, open_id=1, close_id=close, forced_ids=forced, opened=True)
    out = run_with_arrivals(engine, [(0, request(prompt, opened))])["r"]
    head = ref[:5] + list(forced)
    assert out == head + tiny_models.greedy(VARIANT, prompt + head, MAX_TOKENS - len(head), None)
    # The model opens the block itself: the first token it did not write before plays the
    # opening tag; 4 tokens after it.
    j = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    natural = ThinkingBudget(max_tokens=4, open_id=ref[j], close_id=close, forced_ids=forced)
    out = run_with_arrivals(engine, [(0, request(prompt, natural))])["r"]
    head = ref[: j + 1 + 4] + list(forced)
    assert out == head + tiny_models.greedy(VARIANT, prompt + head, MAX_TOKENS - len(head), None)


def test_a_block_the_model_closes_within_its_budget_is_left_alone(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    prompt = prompt_for(model_dir)
    ref = tiny_models.greedy(VARIANT, prompt, MAX_TOKENS, None)
    # Opened by the prompt, closed by the model's 4th token; a budget of 6 is never reached.
    budget = ThinkingBudget(max_tokens=6, open_id=1, close_id=ref[3], forced_ids=(4, ref[3]), opened=True)
    assert run_with_arrivals(engine, [(0, request(prompt, budget))])["r"] == ref


def test_a_zero_budget_closes_the_block_before_the_first_token(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    prompt = prompt_for(model_dir)
    budget = ThinkingBudget(max_tokens=0, open_id=1, close_id=9, forced_ids=(9,), opened=True)
    out = run_with_arrivals(engine, [(0, request(prompt, budget))])["r"]
    assert out == [9] + tiny_models.greedy(VARIANT, prompt + [9], MAX_TOKENS - 1, None)


def test_sampled_rows_take_the_forced_tokens_too_with_logprob_zero(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    forced = (4, 5, 9)
    budget = ThinkingBudget(max_tokens=3, open_id=1, close_id=9, forced_ids=forced, opened=True)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=3, logprobs=1, ignore_eos=True, thinking=budget
    )
    engine.add_request(GenerationRequest("r", tuple(prompt_for(model_dir)), params))
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs
    # Sampled thinking can close the block itself (it draws the closing id): then nothing is forced.
    assert tokens[3:6] == list(forced) or 9 in tokens[:3]
    if tokens[3:6] == list(forced):
        assert [lp.logprob for lp in logprobs[3:6]] == [0.0, 0.0, 0.0]


def test_a_request_with_a_budget_does_not_speculate(tiny_models):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24, speculative_tokens=4)
    budget = ThinkingBudget(max_tokens=50, open_id=1, close_id=9, forced_ids=(9,))
    prompt = [5, 6, 7, 8] * 6
    run_with_arrivals(engine, [(0, request(prompt, budget))])
    assert engine.stats().num_draft_tokens == 0
    assert speculation.propose(prompt, 4)  # drafts there were to propose


def test_a_budget_whose_tokens_lie_outside_the_logits_is_refused_before_it_runs(tiny_models):
    from engine.types import RequestRejected

    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    vocab = load_model_args(model_dir).vocab_size
    budget = ThinkingBudget(max_tokens=2, open_id=1, close_id=9, forced_ids=(vocab, 9))
    with pytest.raises(RequestRejected, match="outside the model's"):
        engine.add_request(request(prompt_for(model_dir), budget))
    assert not engine.has_unfinished_requests()


def json_after_close(model_dir, out: list[int], close: int) -> object:
    from engine.tokenizer import Tokenizer

    answer = out[out.index(close) + 1 :]
    return json.loads(Tokenizer.from_dir(model_dir).decode(answer))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_grammar_constrains_only_the_answer_after_the_thinking(tiny_models, mode):
    from engine.types import StructuredKind, StructuredOutput

    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24, kernel_isa=mode.value)
    prompt = prompt_for(model_dir)
    ref = tiny_models.greedy(VARIANT, prompt, MAX_TOKENS, None)
    close = unused_ids(load_model_args(model_dir).vocab_size, ref, 1)[0]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    json_object = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({**schema, "additionalProperties": False}))

    def run(budget: ThinkingBudget, **sampling) -> list[int]:
        params = SamplingParams(max_tokens=64, temperature=0.0, structured=json_object, thinking=budget, **sampling)
        return run_with_arrivals(engine, [(0, GenerationRequest("r", tuple(prompt), params))])["r"]

    # The prompt opened the thinking: 5 free tokens (the model's own), </think>, then JSON.
    out = run(ThinkingBudget(max_tokens=5, open_id=1, close_id=close, forced_ids=(close,), opened=True))
    assert out[:6] == [*ref[:5], close] and json_after_close(model_dir, out, close) in ({"ok": True}, {"ok": False})
    # The model opens it itself: its first token (not JSON) plays <think>, which the grammar lets through.
    out = run(ThinkingBudget(max_tokens=3, open_id=ref[0], close_id=close, forced_ids=(close,)))
    assert out[:5] == [*ref[:4], close] and json_after_close(model_dir, out, close) in ({"ok": True}, {"ok": False})
    # While thinking, a stop token cannot end the answer before the grammar's part came.
    stop = ref[2]
    out = run(
        ThinkingBudget(max_tokens=5, open_id=1, close_id=close, forced_ids=(close,), opened=True),
        stop_token_ids=(stop,),
    )
    assert stop not in out[:5] and json_after_close(model_dir, out, close) in ({"ok": True}, {"ok": False})
