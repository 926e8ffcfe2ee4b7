"""Decides what one engine step computes: decode tokens of running sequences plus prefill chunks.

Torch-free. Owns the waiting and running lists, the per-step token budget, chunked prefill,
admission with prefix-cache lookup, and preemption (lowest priority first, newest first within
a priority; the victim is recomputed later). It never touches tensors or text.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from engine.native import speculation
from engine.native.sequence import Sequence, SequenceStatus
from engine.types import FinishReason

EntryT = TypeVar("EntryT")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Prompt tokens allowed in a step that also carries decode tokens: a long prompt is fed in
    # small chunks while streams are running, so their inter-token latency stays flat.
    max_prefill_tokens_while_decoding: int | None = None  # None: only max_num_batched_tokens
    speculative_tokens: int = 0  # draft tokens a lone greedy sequence verifies per step (speculation.py)


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: for each sequence, how many of its uncomputed tokens to compute.

    A sequence whose computed count reaches its length in this step gets a token sampled.
    """

    seqs: tuple[Sequence, ...]
    num_scheduled_tokens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def _order(seq: Sequence) -> tuple[int, int]:
    """Service order: higher priority first, older first; the last one is preempted first."""
    return (-seq.priority, seq.seq_id)


class BlockPool(Protocol[EntryT]):
    """What the scheduler asks of a KV block manager: BlockManager, or HybridBlockManager for a
    model that mixes sliding and global layers. EntryT: one block of a prefix-cache hit, as
    find_cached_prefix returns it and can_allocate / allocate take it back."""

    @property
    def block_size(self) -> int: ...
    def find_cached_prefix(self, seq: Sequence, /) -> list[EntryT]: ...
    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[EntryT] = (), /) -> bool: ...
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: SequenceOf[EntryT] = (), /) -> None: ...
    def cache_full_blocks(self, seq: Sequence, /) -> None: ...
    def free(self, seq: Sequence, /) -> None: ...
    def release_outside_window(self, seq: Sequence, /) -> None: ...


class Scheduler(Generic[EntryT]):
    def __init__(self, config: SchedulerConfig, block_manager: BlockPool[EntryT]):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept in _order
        self.running: list[Sequence] = []  # kept in _order
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # fed by speculation (speculation.py)
        self.num_accepted_draft_tokens = 0  # of those, kept

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=_order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Sequence, int] = {}  # insertion-ordered: the batch's row order
        num_preemptions_before = self.num_preemptions
        # Decodes first, so running streams keep flowing while long prompts prefill in chunks.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes:
            is_running = seq.status is SequenceStatus.RUNNING and self._budget_left(scheduled) > 0
            if is_running and self._make_room(seq, 1, scheduled):
                self.block_manager.allocate(seq, 1)
                scheduled[seq] = 1
        prefill_budget = self._prefill_budget(scheduled)
        for seq in prefills:
            budget = min(self._budget_left(scheduled), prefill_budget)
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._make_room(seq, num_new, scheduled):
                self.block_manager.allocate(seq, num_new)
                scheduled[seq] = num_new
                prefill_budget -= num_new
        # Admitting new work while evicting running work would only thrash.
        if self.num_preemptions == num_preemptions_before:
            self._admit_waiting(scheduled, prefill_budget)
        if self.config.speculative_tokens and len(scheduled) == 1 and len(self.running) == 1 and not self.waiting:
            self._add_drafts(self.running[0], scheduled)
        return ScheduledBatch(tuple(scheduled), tuple(scheduled.values()))

    def _add_drafts(self, seq: Sequence, scheduled: dict[Sequence, int]) -> None:
        """A lone decoding sequence also feeds draft tokens this step, if it has some and they fit."""
        if scheduled.get(seq) != 1 or seq.num_uncomputed_tokens != 1 or not speculation.eligible(seq):
            return
        room = min(
            self.config.speculative_tokens,
            seq.max_num_tokens - seq.num_tokens - 1,  # the step also adds one token of the model's own
            self._budget_left(scheduled),
        )
        drafts = speculation.propose(seq.token_ids, room)
        if not drafts or not self.block_manager.can_allocate(seq, 1 + len(drafts)):
            return
        self.block_manager.allocate(seq, 1 + len(drafts))
        seq.token_ids.extend(drafts)
        seq.num_draft_tokens = len(drafts)
        scheduled[seq] = 1 + len(drafts)

    def discard_drafts(self, batch: ScheduledBatch) -> None:
        """Take back the drafts of a step that failed before postprocess (they are not tokens)."""
        for seq in batch.seqs:
            if seq.num_draft_tokens:
                del seq.token_ids[-seq.num_draft_tokens :]
                seq.num_draft_tokens = 0

    def postprocess(
        self, batch: ScheduledBatch, sampled_token_ids: SequenceOf[int | list[int] | None]
    ) -> list[Sequence]:
        """Advance the batch's sequences; returns those that received tokens (maybe finishing).
        A sequence with drafts gets, instead of one token, the argmax after each of its rows."""
        updated: list[Sequence] = []
        for seq, num_tokens, sampled in zip(batch.seqs, batch.num_scheduled_tokens, sampled_token_ids, strict=True):
            if seq.num_draft_tokens:
                assert isinstance(sampled, list)
                self._advance_verified(seq, sampled)
                updated.append(seq)
                continue
            seq.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.release_outside_window(seq)
            if sampled is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            assert isinstance(sampled, int)
            seq.num_new_tokens = 1
            reason = seq.append_token(sampled)
            if reason is not None:
                self.finish(seq, reason)
            updated.append(seq)
        return updated

    def _advance_verified(self, seq: Sequence, argmax: list[int]) -> None:
        """The drafts come off; the verified tokens go on, one at a time (each may finish the
        sequence). The fed token and the kept drafts have their K/V written; the rejected
        drafts' slots lie past the computed count and are written over later."""
        drafts = seq.token_ids[-seq.num_draft_tokens :]
        del seq.token_ids[-seq.num_draft_tokens :]
        seq.num_draft_tokens = 0
        new_tokens = speculation.verify(drafts, argmax)
        seq.num_drafted += len(drafts)
        seq.num_kept += len(new_tokens) - 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_draft_tokens += len(new_tokens) - 1
        computed = seq.num_computed_tokens + len(new_tokens)  # the fed token and the kept drafts
        reason = None
        seq.num_new_tokens = 0
        for token in new_tokens:
            seq.num_new_tokens += 1
            reason = seq.append_token(token)
            if reason is not None:
                break
        seq.num_computed_tokens = min(computed, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.release_outside_window(seq)
        if reason is not None:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence (done or aborted) wherever it is; frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _budget_left(self, scheduled: dict[Sequence, int]) -> int:
        return self.config.max_num_batched_tokens - sum(scheduled.values())

    def _prefill_budget(self, scheduled: dict[Sequence, int]) -> int:
        """Prompt tokens this step may take: capped when it already carries decode tokens.

        The cap grows with the decodes (twice their number, if that is more): a step's decode
        part costs more the more streams it carries, so the same relative delay to those
        streams allows a larger prompt chunk, and prompts are not throttled at high load.
        """
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is None or not scheduled:  # everything scheduled so far is a decode
            return self.config.max_num_batched_tokens
        return max(cap, 2 * len(scheduled))

    def _make_room(self, seq: Sequence, num_new: int, scheduled: dict[Sequence, int]) -> bool:
        """Preempt from the back of `running` until `seq` fits; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim, scheduled)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, scheduled: dict[Sequence, int], prefill_budget: int) -> None:
        bm = self.block_manager
        while self.waiting and (budget := min(self._budget_left(scheduled), prefill_budget)) > 0:
            seq = self.waiting[0]
            prefix_block_ids = bm.find_cached_prefix(seq) if seq.prompt_logprobs is None else []
            num_new = min(seq.num_tokens - len(prefix_block_ids) * bm.block_size, budget)
            fits = len(self.running) < self.config.max_num_seqs and bm.can_allocate(seq, num_new, prefix_block_ids)
            if not fits:
                if self._preempt_lower_than(seq, scheduled):
                    continue  # a lower-priority sequence made way; try again
                return
            self.waiting.pop(0)
            bm.allocate(seq, num_new, prefix_block_ids)
            if seq.num_cached_tokens is None:  # usage reports the first admission's hit
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=_order)
            scheduled[seq] = num_new
            prefill_budget -= num_new

    def _preempt_lower_than(self, seq: Sequence, scheduled: dict[Sequence, int]) -> bool:
        if not self.running or self.running[-1].priority >= seq.priority:
            return False
        self._preempt(self.running[-1], scheduled)
        return True

    def _preempt(self, victim: Sequence, scheduled: dict[Sequence, int]) -> None:
        """Release the victim's blocks and requeue it to recompute from its tokens later."""
        scheduled.pop(victim, None)
        self.running.remove(victim)
        self.block_manager.free(victim)
        self.num_preemptions += 1
        self.add(victim)
