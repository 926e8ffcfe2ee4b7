"""ReasoningSplitter: <think> text goes to reasoning, the rest to content, whatever the chunking."""

from __future__ import annotations

import pytest

from api.reasoning import ReasoningSplitter, answer_text, prompt_opens_thinking


def split(pieces: list[str], *, in_thinking: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(in_thinking=in_thinking)
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


TEXT = "<think>\nFirst, 2 < 3.\n</think>\n\nThe answer is 3."


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, len(TEXT)])
def test_thinking_and_answer_split_the_same_at_any_chunk_size(size):
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    assert split(pieces) == ("First, 2 < 3.\n", "The answer is 3.")


def test_text_without_think_tags_is_all_content():
    assert split(["  Hello", " <think> is a tag"]) == ("", "  Hello <think> is a tag")


def test_a_prompt_that_opened_think_starts_in_reasoning():
    assert split(["plan", "</th", "ink>answer"], in_thinking=True) == ("plan", "answer")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_unclosed_thinking_stays_reasoning_and_a_held_partial_tag_is_flushed():
    assert split(["<think>still thinking </thi"]) == ("still thinking </thi", "")
    assert split(["<thi"]) == ("", "<thi")


def test_reasoning_is_released_as_it_streams():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>abc") == ("abc", "")
    assert splitter.feed("de</") == ("de", "")
    assert splitter.feed("think>x") == ("", "x")


def test_answer_text_is_what_a_conversation_stores():
    assert answer_text(TEXT, in_thinking=False) == "The answer is 3."
    assert answer_text("plan</think>answer", in_thinking=True) == "answer"
    assert answer_text("no tags at all", in_thinking=False) == "no tags at all"
