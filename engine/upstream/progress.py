"""What one upstream request has received so far: the text relayed (its reasoning as <think> text,
its tool calls held until complete), the upstream's usage, and the output's size in tokens, which
the relay holds to the request's max_tokens whatever the upstream does. State fed one parsed chunk
at a time (a long recount awaits a worker thread); the backend reads the stream, closes it and
decides which usage to bill.
"""

from __future__ import annotations

import asyncio

from engine.tokenizer import GIL_FREE_CHARS
from engine.types import FinishReason, GenerationRequest, TokenEvent, TokenLogprob
from engine.upstream.counting import BYTES_PER_TOKEN, Counter
from engine.upstream.usage import UsageBounds
from engine.upstream.wire import Chunk, Usage, tool_calls_text

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Without a tokenizer the 4-bytes estimate runs ahead of the real count on long words and code,
# so an answer is cut on it only past this many times max_tokens (16 bytes a token: a legitimate
# answer never averages that); chunks and logprob entries still cut at max_tokens itself.
ESTIMATE_SLACK = 4
# A tokenizer count of this many characters or more runs on a worker thread, where the tokenizer
# lets go of the GIL (engine/tokenizer.py). Near max_tokens the whole output is recounted at most
# chunks (tens of times for an answer that reaches it, about 4 ms per 16 KB with the demo
# tokenizer): on the loop, that held every other stream. The trade-off: the recount stays whole,
# as CPU-costly as before, rather than counting only the new text, because a text's count is not
# the sum of its parts' (a token can span the split; the pre-tokenizer and normalizer see the text
# around it) and max_tokens is held exactly; so the counts and the chunk the relay stops at are
# unchanged. A shorter text is counted on the loop: `encode` holds the GIL for it anyway, and the
# count costs less than the hop to a thread.
OFF_LOOP_CHARS = GIL_FREE_CHARS


class OutputSize:
    """The upstream's own output so far (no tags or markup of ours): chunks, logprob entries, bytes,
    and tokens by the model's counter. `add` refuses the piece that would take it past max_tokens."""

    def __init__(self, counter: Counter, max_tokens: int):
        self._counter = counter
        self.max_tokens = max_tokens
        self.pieces: list[str] = []
        self.num_chunks = 0  # chunks that carried output: each holds at least one generated token
        self.num_logprobs = 0  # logprob entries, when asked: one per generated token
        self.num_bytes = 0
        self._num_counted = 0  # the tokenizer's count of the whole output at its last recount
        self._num_bytes_since = 0  # bytes added since: each adds at most one token to that count
        self._num_chunks_since = 0

    @property
    def num_tokens(self) -> int:
        """A running count for the events (cheap): the last recount (or the estimate) and a token
        per chunk since, at least a token per chunk and per logprob entry."""
        if self._counter.is_exact:
            own = self._num_counted + self._num_chunks_since
        else:
            own = -(-self.num_bytes // BYTES_PER_TOKEN)
        return max(own, self.num_chunks, self.num_logprobs)

    async def count(self) -> int:
        """The whole output counted by the model's counter (at least a token a chunk and a logprob
        entry), at most max_tokens: what is billed when the upstream's usage is missing or implausible."""
        if not self.pieces:
            counted = 0
        elif self._counter.is_exact and self._num_chunks_since == 0:  # the last recount was of all of it
            counted = self._num_counted
        else:
            counted = await self._count("".join(self.pieces))
        return min(self.max_tokens, max(counted, self.num_chunks, self.num_logprobs))

    async def add(self, piece: str, num_logprobs: int) -> bool:
        """Count one chunk's output; False, counting nothing, when it would pass max_tokens."""
        limit = self.max_tokens
        if self.num_chunks + 1 > limit or self.num_logprobs + num_logprobs > limit:
            return False
        size = len(piece.encode())
        recount = None
        if not self._counter.is_exact:
            if -(-(self.num_bytes + size) // BYTES_PER_TOKEN) > ESTIMATE_SLACK * limit:
                return False
        elif self._num_counted + self._num_bytes_since + size > limit:  # maybe past it: count exactly
            recount = await self._count("".join(self.pieces) + piece)
            if recount > limit:
                return False
        self.pieces.append(piece)
        self.num_chunks += 1
        self.num_logprobs += num_logprobs
        self.num_bytes += size
        if recount is not None:
            self._num_counted, self._num_bytes_since, self._num_chunks_since = recount, 0, 0
        else:
            self._num_bytes_since += size
            self._num_chunks_since += 1
        return True

    async def _count(self, text: str) -> int:
        text = _countable(text)
        if not self._counter.is_exact or len(text) < OFF_LOOP_CHARS:
            return self._counter.count(text)
        return await asyncio.to_thread(self._counter.count, text)


def _countable(text: str) -> str:
    """The text to count tokens of: without replacement characters, which stand for bytes the
    upstream could not decode (a generated token each, or more: their chunks count them) and
    would count as three tokens each re-encoded."""
    return text.replace("\ufffd", "")


class Progress:
    """One request's relay so far (kept across attempts only while nothing was yielded)."""

    def __init__(self, request: GenerationRequest, counter: Counter):
        self.num_prompt_tokens = len(request.prompt_token_ids)  # our own count
        self.output = OutputSize(counter, request.sampling.max_tokens)
        self._usage_source = counter.usage_source
        # Our reasoning splitter runs only for a model that thinks in <think> tags (its template
        # says so, or no tokenizer to tell): for any other, tags would reach the answer's content.
        self._relays_reasoning = counter.thinks
        self._stop = request.sampling.stop
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None
        self.num_yielded = 0  # events passed on: a failure before the first is retried elsewhere
        self.has_output = False  # any text, reasoning, tool-call piece or logprob: the first token
        self.is_cut = False  # ended here at max_tokens while the upstream went on
        self.stop_str: str | None = None  # the stop string that ended it (one of the request's)
        self.tool_calls: dict[int, list[str]] = {}  # index -> [name, arguments so far], until the finish
        self.num_tool_calls = 0
        self.is_reasoning = False  # inside relayed reasoning (<think> sent, </think> not yet)

    async def feed(self, chunk: Chunk) -> TokenEvent | None:
        """The event for this chunk, if it has anything to pass on; past max_tokens, the cut instead."""
        piece = chunk.reasoning + chunk.text + "".join(c.name + c.arguments for c in chunk.tool_calls)
        if piece or chunk.logprobs:
            if not await self.output.add(piece, len(chunk.logprobs)):
                self.finish, self.is_cut = FinishReason.LENGTH, True
                return self._event(self._close(), ())
            self.has_output = True
        if chunk.usage is not None:
            self.usage = chunk.usage
        for call in chunk.tool_calls:
            if call.index not in self.tool_calls:
                self.num_tool_calls += 1
            name_and_args = self.tool_calls.setdefault(call.index, ["", ""])
            name_and_args[0] += call.name
            name_and_args[1] += call.arguments
        text = self._reasoning_tags(chunk) + chunk.text
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason
            self.stop_str = chunk.stop_str if chunk.stop_str in self._stop else None
            text += self._close()
        return self._event(text, chunk.logprobs)

    def usage_bounds(self, max_model_len: int) -> UsageBounds:
        return UsageBounds(
            num_prompt_tokens=self.num_prompt_tokens,
            max_tokens=self.output.max_tokens,
            num_output_bytes=self.output.num_bytes,
            num_tool_calls=self.num_tool_calls,
            num_stop_bytes=max((len(s.encode()) for s in self._stop), default=0),
            max_model_len=max_model_len,
        )

    def _reasoning_tags(self, chunk: Chunk) -> str:
        """An upstream's separate reasoning, relayed as the <think> text our reasoning splitter reads
        (api/reasoning.py), so the client gets `reasoning_content` as from a model served here."""
        if chunk.reasoning and not self._relays_reasoning:
            return ""  # counted (max_tokens, usage) but not shown: no reasoning_content for this model
        if chunk.reasoning:
            opened = "" if self.is_reasoning else THINK_OPEN
            self.is_reasoning = True
            return opened + chunk.reasoning
        if self.is_reasoning and (chunk.text or chunk.tool_calls):
            self.is_reasoning = False
            return THINK_CLOSE
        return ""

    def _close(self) -> str:
        """At the finish: the reasoning closed, and the tool calls, complete now, as the text our
        tool-call parser reads (a call cut by max_tokens left open, as a model served here leaves it)."""
        text = ""
        if self.is_reasoning:
            text, self.is_reasoning = THINK_CLOSE, False
        if self.tool_calls:
            text += tool_calls_text(self.tool_calls, is_cut=self.finish is FinishReason.LENGTH)
            self.tool_calls = {}
        return text

    def _event(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> TokenEvent | None:
        if not text and not logprobs:
            return None
        # Counts so far are ours: what a request cut short (client gone, failure) is billed on.
        return TokenEvent(
            text,
            (),
            self.num_prompt_tokens,
            0,
            self.output.num_tokens,
            usage_source=self._usage_source,
            logprobs=logprobs,
        )
