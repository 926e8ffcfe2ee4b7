"""One request's state inside the native engine: its tokens, progress and KV block table.

Torch-free. The scheduler and block manager mutate it; the runner only reads it. A sequence
counts its own progress in tokens whose K/V are in the cache (`num_computed_tokens`), so
prefill, chunked prefill, decode and recompute after preemption are one mechanism.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from typing import TYPE_CHECKING

from engine.native.thinking import ThinkingState
from engine.types import FinishReason, GenerationRequest, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher
    from engine.native.sampler import SeenTokens


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted for recompute)
    RUNNING = "running"  # holds blocks; gets tokens scheduled every step it fits
    FINISHED = "finished"


def block_hash(parent_hash: bytes, token_ids: list[int] | tuple[int, ...], extra: tuple[object, ...] = ()) -> bytes:
    """Chained hash of one full block: its parent's hash, its own token ids, and the content
    keys of any images whose tokens it holds (image tokens share one id, so the ids alone
    would let two different pictures share blocks)."""
    data = parent_hash + array("q", token_ids).tobytes()
    if extra:
        data += repr(extra).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a sequence's first block; the salt namespaces the whole chain."""
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    return hashlib.blake2b(b"salt:" + salt, digest_size=16).digest()


class BlockTable:
    """A sequence's blocks in one KV group (block_manager.py): all layers, or in a model that mixes
    sliding and global layers, the global layers (group 0) or the sliding ones (group 1)."""

    __slots__ = ("block_ids", "num_hashed", "num_released")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.num_hashed = 0  # leading blocks registered in the prefix cache
        # Sliding groups: leading entries released once every future query's window starts
        # past them; they are stale ids, no longer this sequence's.
        self.num_released = 0

    def clear(self) -> None:
        self.block_ids = []
        self.num_hashed = self.num_released = 0

    def live_block_ids(self) -> list[int]:
        """The ids with released entries pointing at the first block still held (written, finite)."""
        if not self.num_released:
            return self.block_ids
        return [self.block_ids[self.num_released]] * self.num_released + self.block_ids[self.num_released :]


class Sequence:
    """A request being generated. `seq_id` grows with arrival: larger means newer."""

    __slots__ = (
        "seq_id",
        "request_id",
        "sampling",
        "priority",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_tables",
        "block_hashes",
        "root_hash",
        "status",
        "finish_reason",
        "stop_token_ids",
        "max_num_tokens",
        "grammar",
        "logprobs",
        "prompt_logprobs",
        "images",
        "seen_tokens",
        "num_draft_tokens",
        "num_new_tokens",
        "num_drafted",
        "num_kept",
        "thinking",
        "state_slot",
    )

    def __init__(self, seq_id: int, request: GenerationRequest, *, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.seq_id = seq_id
        self.request_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self.priority = request.priority
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in this sequence's blocks
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.block_tables = (BlockTable(), BlockTable())  # per KV group; group 1 only for mixed models
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, computed lazily
        self.root_hash = root_hash(request.cache_salt)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        eos = () if self.sampling.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(eos) | frozenset(self.sampling.stop_token_ids)
        self.max_num_tokens = min(max_model_len, self.num_prompt_tokens + self.sampling.max_tokens)
        self.grammar: GrammarMatcher | None = None  # set by the engine for structured outputs
        self.logprobs: list[TokenLogprob] = []  # one per completion token, filled by the sampler when asked
        # Per prompt position (the first has none), filled by the runner as the prompt is computed;
        # a sequence asking for them never takes prefix-cache blocks (every position is computed).
        asked = self.sampling.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] * self.num_prompt_tokens if asked else None
        self.images = request.images  # vision models: which prompt tokens take image embeddings
        self.seen_tokens: SeenTokens | None = None  # the sampler's SeenTokens (repetition penalty), made by the runner
        # Speculation (speculation.py): draft tokens at the end of token_ids during the step that
        # verifies them (0 otherwise), and the tokens the last step appended (1, or up to k + 1).
        self.num_draft_tokens = 0
        self.num_new_tokens = 0
        self.num_drafted = self.num_kept = 0  # drafts fed and kept over the sequence's life
        # A reasoning model's thinking, followed for its budget or its grammar (thinking.py).
        budget = self.sampling.thinking
        structured = self.sampling.structured is not None
        self.thinking = ThinkingState(budget, reopens=not structured) if budget is not None else None
        # A model with Gated DeltaNet layers: the row of its recurrent state (state_slots.py) while it holds blocks
        self.state_slot: int | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def block_table(self) -> list[int]:
        """Group 0's block ids (every layer's, unless the model mixes sliding and global layers)."""
        return self.block_tables[0].block_ids

    @property
    def num_released_blocks(self) -> int:
        return self.block_tables[0].num_released

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_token_ids(self, index: int, block_size: int) -> tuple[object, ...]:
        """The block's token ids, then the keys of the image content it holds (checked on a cache hit)."""
        ids = tuple(self.token_ids[index * block_size : (index + 1) * block_size])
        return ids + self._image_keys(index * block_size, (index + 1) * block_size) if self.images else ids

    def _image_keys(self, start: int, end: int) -> tuple[tuple[str, int], ...]:
        """(content hash, first image-token index in the block) for each image overlapping [start, end)."""
        return tuple(
            (img.content_hash, max(start, img.offset) - img.offset)
            for img in self.images
            if img.offset < end and img.offset + img.length > start
        )

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks (token ids never change once written)."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self.root_hash
            i = len(hashes)
            start, end = i * block_size, (i + 1) * block_size
            extra = self._image_keys(start, end) if self.images else ()
            hashes.append(block_hash(parent, self.token_ids[start:end], extra))
        return hashes[:num_blocks]

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a sampled token; returns why the sequence is now finished, if it is."""
        self.token_ids.append(token_id)
        is_thinking = self.thinking is not None and self.thinking.observe(token_id)
        if (
            self.grammar is not None
            and not is_thinking
            and (not self.grammar.accept(token_id) or self.grammar.is_finished)
        ):
            return FinishReason.STOP  # the structured answer is complete (or its grammar is stuck)
        if token_id in self.stop_token_ids and self.num_completion_tokens >= self.sampling.min_tokens:
            return FinishReason.STOP
        if len(self.token_ids) >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None
