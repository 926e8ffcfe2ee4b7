"""Incremental detokenization with stop strings, for backends that stream token ids.

Turns one request's generated token ids into text deltas that are always whole characters
(a multi-byte character split across tokens is held until complete) and never contain any
part of a stop string: the tail that could still become a stop string is held back.
It does not decide when generation ends beyond reporting a stop-string hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, so tokenizers that drop a leading space at the
# start of a decode (SentencePiece-style) still produce the right first word.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed token ids with `push`; read safe text; call `flush` once at the end."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), prompt_token_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decoding window in _ids
        self._read_offset = len(context)  # tokens before this are already in _text
        self._text = ""  # all generated text decoded so far
        self._num_emitted_chars = 0
        self._stop = tuple(s for s in stop if s)
        self._holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[: self._num_emitted_chars]

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add new tokens; return (text safe to send now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        for token_id in token_ids:
            self._ids.append(token_id)
            self._text += self._decode_step()
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: everything still held back (unless stopped)."""
        if self.stopped:
            return ""
        window = self._tokenizer.decode(self._ids[self._prefix_offset :])
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        if len(window) > len(prefix):
            self._text += window[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        text, _ = self._emit(final=True)
        return text

    def _decode_step(self) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return window[len(prefix) :]
        return ""  # an incomplete UTF-8 sequence, or a token that adds no text yet

    def _emit(self, *, final: bool) -> tuple[str, bool]:
        start = self._num_emitted_chars
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        elif final:
            end = len(self._text)
        else:
            end = max(start, len(self._text) - self._holdback_chars)
        self._num_emitted_chars = end
        return self._text[start:end], self.stopped
