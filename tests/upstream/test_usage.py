"""Pure pieces of the relay's accounting: the bounds an upstream's usage must fall within, the
output's size against max_tokens (exact with a tokenizer, lenient on the estimate), and what
is taken out of upstream messages."""

from __future__ import annotations

import threading

import pytest

from engine.tokenizer import Tokenizer
from engine.upstream.counting import EstimatingCounter, TokenizerCounter
from engine.upstream.progress import OFF_LOOP_CHARS, OutputSize
from engine.upstream.usage import UsageBounds, usage_problem
from engine.upstream.wire import Usage, parse_usage, redact
from tests.upstream.helpers import ThreadRecordingCounter

BOUNDS = UsageBounds(
    num_prompt_tokens=100, max_tokens=50, num_output_bytes=20, num_tool_calls=0, num_stop_bytes=0, max_model_len=0
)


@pytest.mark.parametrize(
    ("usage", "problem"),
    [
        (Usage(120, 8, 64), None),
        (Usage(13, 36, 0), None),  # 20 bytes relayed + 16 hidden tokens (end of sequence, tags)
        (Usage(120, 37, 0), "completion_tokens 37 > 36"),
        (Usage(11, 8, 0), "prompt_tokens 11 outside 12..656"),  # our count / 8 is the least
        (Usage(657, 8, 0), "prompt_tokens 657 outside"),  # our count x 4 + 256 is the most
        (Usage(-1, 8, 0), "negative counts"),
        (Usage(120, 8, 121), "cached_tokens 121 > prompt_tokens 120"),
        (Usage(0, 0, 0, problem="prompt_tokens is not an integer: '5'"), "not an integer"),
    ],
)
def test_reported_usage_is_billed_only_within_the_documented_bounds(usage, problem):
    found = usage_problem(usage, BOUNDS)
    assert found is None if problem is None else problem in (found or "")


def test_completion_tokens_are_bounded_by_max_tokens_and_the_context_window_bounds_the_prompt():
    long_answer = UsageBounds(100, 50, 10_000, 2, 10, 150)
    assert usage_problem(Usage(120, 50, 0), long_answer) is None
    assert "max_tokens 50" in (usage_problem(Usage(120, 51, 0), long_answer) or "")
    assert "outside 12..150" in (usage_problem(Usage(151, 5, 0), long_answer) or "")


def test_usage_counts_must_be_integers():
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": 2}) == Usage(5, 2, 0)
    for bad in ("5", 5.5, True, [1]):
        assert parse_usage({"prompt_tokens": bad, "completion_tokens": 2}).problem is not None
    assert parse_usage({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": "3"}}).problem is not None


async def test_without_a_tokenizer_output_is_cut_at_max_tokens_chunks_or_sixteen_bytes_a_token():
    size = OutputSize(EstimatingCounter(), max_tokens=3)
    assert [await size.add(" extraordinarily", 0) for _ in range(3)] == [True] * 3  # 16 bytes a chunk: in the slack
    assert not await size.add("a", 0)  # a fourth chunk: each holds at least one token
    assert await size.count() == 3  # 48 bytes are 12 by the estimate, billed at most max_tokens
    assert not await OutputSize(EstimatingCounter(), max_tokens=3).add("x" * 49, 0)
    assert not await OutputSize(EstimatingCounter(), max_tokens=3).add("a", 4)  # four logprob entries: four tokens


async def test_with_a_tokenizer_output_is_cut_at_exactly_max_tokens(tiny_model_dir):
    counter = TokenizerCounter(Tokenizer.from_dir(tiny_model_dir))
    text = "The river flows to the sea, and the sea is wide."
    limit = counter.count(text)
    size = OutputSize(counter, max_tokens=limit)
    assert await size.add(text, 0)
    assert await size.count() == limit
    assert not await size.add(" more", 0)
    assert not await OutputSize(counter, max_tokens=limit - 1).add(text, 0)


async def test_a_long_output_is_recounted_off_the_loop_and_still_cut_at_exactly_max_tokens(tiny_model_dir):
    """Near max_tokens the whole output is recounted at each chunk: on the event loop, that held every
    other stream (about 4 ms per 16 KB with the demo tokenizer, some 30 times an answer). A long
    recount runs on a worker thread; the counts and the chunk the output is cut at are as before."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    counter, plain = ThreadRecordingCounter(tokenizer), TokenizerCounter(tokenizer)
    pieces = [f" Sentence {i}: the river flows to the sea." for i in range(600)]
    limit = plain.count("".join(pieces[:400])) + 5
    size = OutputSize(counter, max_tokens=limit)
    num_kept = 0
    while await size.add(pieces[num_kept], 0):
        num_kept += 1
    kept = "".join(pieces[:num_kept])
    assert len(kept) > 2 * OFF_LOOP_CHARS
    assert plain.count(kept) <= limit < plain.count(kept + pieces[num_kept])  # the first piece past it is cut
    assert await size.count() == plain.count(kept) and size.num_tokens >= plain.count(kept)
    loop_thread = threading.get_ident()
    long_ones = [thread for num_chars, thread in counter.counts if num_chars >= OFF_LOOP_CHARS]
    assert len(long_ones) >= 5 and loop_thread not in long_ones
    assert all(thread == loop_thread for num_chars, thread in counter.counts if num_chars < OFF_LOOP_CHARS)


def test_our_key_and_anything_like_a_key_is_taken_out_of_upstream_messages():
    message = "Incorrect API key provided: Bearer my-own-key-123 (sk-proj-abc123XYZ); key my-own-key-123"
    redacted = redact(message, ["my-own-key-123"])
    assert "my-own-key-123" not in redacted and "abc123XYZ" not in redacted
    assert redacted.startswith("Incorrect API key provided: Bearer [redacted]")
    assert redact("bearer abc.def-ghi, retry") == "Bearer [redacted], retry"
