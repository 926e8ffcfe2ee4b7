"""Incremental detokenization, and the one stop-string filter and logprob gate every backend uses.

`StopStringFilter` turns a request's cumulative output text into deltas that never contain
any part of a stop string (the tail that could still become one is held back); the native
backend feeds it from `IncrementalDetokenizer`, the TensorRT-LLM adapter from the executor's
cumulative text. The detokenizer turns generated token ids into whole characters (a multi-byte
character split across tokens is held until complete) and knows where each token's text starts.
`LogprobGate` lets a token's logprob out with the first of its text that is sent, so the
logprobs sent are exactly those of the content's tokens. None of them decides when generation
ends beyond reporting a stop-string hit.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from engine.tokenizer import Tokenizer
from engine.types import TokenLogprob

# Prompt tokens kept as decoding context, so tokenizers that drop a leading space at the
# start of a decode (SentencePiece-style) still produce the right first word.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed token ids with `push`; read safe text; call `flush` once at the end."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), prompt_token_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0  # start of the decoding window in _ids
        self._read_offset = len(context)  # tokens before this are already in _text
        self._text = ""  # all generated text decoded so far
        self._starts: list[int] = []  # per generated token: where its text starts in _text
        self._stop = StopStringFilter(stop)
        self.stopped = False

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, once one did."""
        return self._stop.matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[: self._stop.num_emitted_chars]

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add new tokens; return (text safe to send now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        for token_id in token_ids:
            self._ids.append(token_id)
            self._starts.append(len(self._text))
            self._text += self._decode_step()
        return self._emit(final=False)

    @property
    def num_tokens_emitted(self) -> int:
        """How many generated tokens the emitted text holds: those whose text starts before its end.
        Tokens past a stop string's start, and trailing tokens without text (EOS), are not counted."""
        return self.num_tokens_before(self._stop.num_emitted_chars)

    def num_tokens_before(self, num_chars: int) -> int:
        """How many generated tokens have text that starts within the first `num_chars` characters."""
        return bisect.bisect_left(self._starts, num_chars)

    def flush(self) -> str:
        """At the end of generation: everything still held back (unless stopped)."""
        if self.stopped:
            return ""
        window = self._tokenizer.decode(self._ids[self._prefix_offset :])
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        if len(window) > len(prefix):
            self._text += self._take(prefix, window)
            self._prefix_offset = self._read_offset
        text, _ = self._emit(final=True)
        return text

    def _decode_step(self) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            return self._take(prefix, window)
        return ""  # an incomplete UTF-8 sequence, or a token that adds no text yet

    def _take(self, prefix: str, window: str) -> str:
        """The window's new text, its tokens now read. Tokens held back for what looked like an
        incomplete character get the start of their own text: bytes of one character share its
        start, but a byte that completed nothing is a U+FFFD of its own, and the next token's text
        starts after it."""
        for i in range(self._read_offset + 1, len(self._ids)):  # none unless tokens were held
            part = self._tokenizer.decode(self._ids[self._prefix_offset : i])
            own = len(part) if window.startswith(part) else len(part.rstrip("\ufffd"))
            self._starts[i - self._num_context] = len(self._text) + max(own - len(prefix), 0)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(prefix) :]

    def _emit(self, *, final: bool) -> tuple[str, bool]:
        text = self._stop.update(self._text, final=final)
        self.stopped = self._stop.stopped
        return text, self.stopped


class StopStringFilter:
    """Safe deltas of a growing text: cut at the first stop string, the possible start of one held.

    Holds back the last `len(longest stop) - 1` characters while the text grows, and a
    trailing U+FFFD (an incomplete UTF-8 sequence still being decoded).
    """

    def __init__(self, stop: tuple[str, ...]):
        self._stop = tuple(s for s in stop if s)
        self._holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self._num_emitted_chars = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    @property
    def num_emitted_chars(self) -> int:
        return self._num_emitted_chars

    def update(self, text: str, *, final: bool) -> str:
        """The new safe text, given the whole output text so far."""
        if self.stopped:
            return ""
        start = self._num_emitted_chars
        # Emitted text never holds a stop string's start, so the search can begin where it ended.
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self._stop) if i >= 0]
        if hits:
            end, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd")) - self._holdback_chars
        end = max(start, min(end, len(text)))
        self._num_emitted_chars = end
        return text[start:end]


class LogprobGate:
    """Holds each token's logprob until some of the token's text is sent, so the logprobs sent are
    those of the content's tokens, in order: a token a stop string cuts is in (its text starts in
    the content), the stop string's own tokens and those after it are not, nor a final EOS (no text).
    The caller says how many tokens the text sent so far holds (`IncrementalDetokenizer`)."""

    def __init__(self) -> None:
        self._held: list[TokenLogprob] = []
        self._num_released = 0

    def release(self, new: Sequence[TokenLogprob], num_tokens_sent: int) -> tuple[TokenLogprob, ...]:
        """The logprobs to send now: of the tokens up to `num_tokens_sent`, not sent before."""
        self._held.extend(new)
        num = num_tokens_sent - self._num_released
        released, self._held = self._held[:num], self._held[num:]
        self._num_released += len(released)
        return tuple(released)
