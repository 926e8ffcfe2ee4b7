"""Splits a reasoning model's streamed text into its thinking and its answer.

Models whose chat template knows `<think>...</think>` (Qwen3, DeepSeek-R1 distills, ...) write
their thinking between those tags; it goes to `reasoning_content` (the field vLLM and llama.cpp
use) and the rest to `content`. Tags split across stream chunks are held back until they are
complete. Pure text in, text out: no I/O, no tokens.
"""

from __future__ import annotations

from enum import Enum

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"


class _State(Enum):
    START = "start"  # nothing but whitespace seen: the answer may still open with <think>
    THINKING_START = "thinking_start"  # just inside <think>: leading whitespace is dropped
    THINKING = "thinking"
    ANSWER_START = "answer_start"  # just after </think>: leading whitespace is dropped
    ANSWER = "answer"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the rendered prompt already ends inside <think> (templates that open it for the model)."""
    return prompt_tail.rstrip().endswith(OPEN_TAG)


class ReasoningSplitter:
    """feed() each piece of generated text; returns (reasoning, content) ready to send."""

    def __init__(self, *, in_thinking: bool = False):
        self._state = _State.THINKING_START if in_thinking else _State.START
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._held and self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    @property
    def is_thinking(self) -> bool:
        return self._state in (_State.THINKING_START, _State.THINKING)

    @property
    def is_undecided(self) -> bool:
        """Nothing but whitespace or the start of <think> seen yet."""
        return self._state is _State.START

    def finish(self) -> tuple[str, str]:
        """What is still held back when generation ends."""
        held, self._held = self._held, ""
        if self._state in (_State.THINKING, _State.THINKING_START):
            return held, ""
        return "", held.lstrip() if self._state is _State.ANSWER_START else held

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current state can; False when the rest must wait for more text."""
        state, held = self._state, self._held
        if state is _State.START:
            stripped = held.lstrip()
            if stripped.startswith(OPEN_TAG):
                self._held, self._state = stripped[len(OPEN_TAG) :], _State.THINKING_START
                return True
            if OPEN_TAG.startswith(stripped):  # maybe the start of the tag: wait
                return False
            self._state = _State.ANSWER
            return True
        if state in (_State.THINKING_START, _State.ANSWER_START):
            self._held = held.lstrip()
            if self._held:
                self._state = _State.THINKING if state is _State.THINKING_START else _State.ANSWER
            return bool(self._held)
        if state is _State.THINKING:
            end = held.find(CLOSE_TAG)
            if end >= 0:
                reasoning.append(held[:end])
                self._held, self._state = held[end + len(CLOSE_TAG) :], _State.ANSWER_START
                return True
            keep = _partial_tag_length(held, CLOSE_TAG)
            reasoning.append(held[: len(held) - keep])
            self._held = held[len(held) - keep :]
            return False
        content.append(held)
        self._held = ""
        return False


class ThinkingCounter:
    """Counts the generated tokens that are thinking (usage's reasoning_tokens): those whose text
    arrives while the answer is inside its thinking block, the tags' own tokens included."""

    def __init__(self, *, in_thinking: bool):
        self._splitter = ReasoningSplitter(in_thinking=in_thinking)
        self.num_tokens = 0
        self._undecided = 0  # tokens before the answer showed whether it opens with <think>

    def feed(self, text: str, num_tokens: int) -> None:
        before = self._splitter.is_thinking
        self._splitter.feed(text)
        if before or self._splitter.is_thinking:
            self.num_tokens += num_tokens + self._undecided
            self._undecided = 0
        elif self._splitter.is_undecided:
            self._undecided += num_tokens
        else:
            self._undecided = 0


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def answer_text(text: str, *, in_thinking: bool) -> str:
    """The answer part of a whole generation (what a conversation stores), thinking removed."""
    splitter = ReasoningSplitter(in_thinking=in_thinking)
    _, content = splitter.feed(text)
    return content + splitter.finish()[1]
