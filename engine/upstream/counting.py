"""Token counts for a model served upstream: the local tokenizer when configured, else an estimate.

The front door counts a prompt before it is sent (token buckets, context checks, history
trimming, the coalescer's key). With a local tokenizer the count is exact; without one,
`EstimatingCounter` packs the rendered chat's UTF-8 bytes four to an id: the length is an
estimate (most tokenizers average three to five bytes a token on English text) and the ids
still identify the text exactly. Billing uses the upstream's reported usage either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from engine.tokenizer import Tokenizer
from engine.types import UsageSource

BYTES_PER_TOKEN = 4


class EstimatingCounter:
    """Stands in for a tokenizer when the model has none locally: ~bytes/4 tokens."""

    usage_source = UsageSource.ESTIMATE
    is_exact = False  # counts may be off either way: relayed output is cut only well past max_tokens
    eos_token_ids: tuple[int, ...] = ()
    thinks = True  # no template to tell: the upstream's reasoning, as <think> text, is split (api/reasoning.py)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        rendered = orjson.dumps([dict(m) for m in messages])
        if options:  # tools and the like are sent too, and cost prompt tokens upstream
            rendered += orjson.dumps(options, default=str)
        return _pack(rendered)

    def encode(self, text: str) -> list[int]:
        return _pack(text.encode())

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = b"".join(i.to_bytes(BYTES_PER_TOKEN, "big") for i in token_ids)
        return data.lstrip(b"\x00").decode(errors="replace")

    def count(self, text: str) -> int:
        return -(-len(text.encode()) // BYTES_PER_TOKEN)


class TokenizerCounter:
    """The model's own tokenizer, loaded from a local folder: exact counts."""

    usage_source = UsageSource.TOKENIZER
    is_exact = True  # a text's count (replacement characters aside) is at most the tokens generated for it

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        # A reasoning model (its template knows <think>) as a model served here: its answers carry
        # reasoning_content, split from the upstream's reasoning relayed as <think> text.
        self.thinks = tokenizer.thinks

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        # Tools are counted as JSON with the other options (so requests with different tools have
        # different ids: the coalescer's key); the template gets an empty list, to render as for a
        # chat with tools (with its tool_use template, if any, as an upstream given this folder does).
        tools: list[dict] | None = [] if "tools" in options else None
        ids = self._tokenizer.encode_chat(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tools=tools
        )
        if options:
            ids += self._tokenizer.encode(orjson.dumps(options, default=str).decode())
        return ids

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text))


Counter = EstimatingCounter | TokenizerCounter


def _pack(data: bytes) -> list[int]:
    pad = -len(data) % BYTES_PER_TOKEN  # left-pad so every id is a full word
    data = b"\x00" * pad + data
    return [int.from_bytes(data[i : i + BYTES_PER_TOKEN], "big") for i in range(0, len(data), BYTES_PER_TOKEN)]
