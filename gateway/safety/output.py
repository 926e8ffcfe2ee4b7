"""Incremental filtering of a streamed answer, with a hold-back window.

Text is released only once the deny rules can no longer match over it (it lies more than
`holdback_chars` behind the newest text, and no partial match starts earlier; with no output
rules there is nothing to hold back for) and, when the classifier is on, once a classifier
check has covered it. A blocked span is therefore never released; after a block the filter
releases nothing more. The answer's first text is checked at once, so the first token is not
held back for long; then checks come early while the answer is short (at a word end once
`min_check_chars` arrived, then each time the unchecked text is as long as the checked), so a
short answer still appears progressively instead of in one piece at the end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.safety.rules import RuleSet
from gateway.safety.types import SafetyLayer, Verdict

ClassifyText = Callable[[str], Awaitable[Verdict]]
_SENTENCE_ENDS = frozenset(".!?\n")
_WORD_ENDS = frozenset(" \t\n.,;:!?")


@dataclass(frozen=True, slots=True)
class OutputPolicy:
    holdback_chars: int  # text newer than this is never released before finish()
    check_every_chars: int  # the classifier runs at least this often (in new characters)
    min_check_chars: int  # ...and at a sentence end once this many new characters arrived
    window_chars: int  # how much recent text one classifier check reads
    rescan_chars: int = 256  # released text the rules scan again, for matches longer than the hold-back
    first_unchecked_chars: int = 0  # the answer's first characters released before a classifier check


class OutputFilter:
    """One per streamed answer. `feed` and `finish` return (text safe to send now, verdict);
    a verdict that is not None blocked the answer, and the stream must end."""

    def __init__(
        self,
        rules: RuleSet,
        policy: OutputPolicy,
        *,
        classify: ClassifyText | None,
        on_done: Callable[[Verdict], None],
        prefix: str = "",
    ):
        """`prefix`: text the answer continues (an assistant's prefill), never released, which
        the rules and the classifier read as part of the answer."""
        self._rules = rules
        self._policy = policy
        self._classify = classify
        self._on_done = on_done  # called once, with the final verdict (for metrics and logs)
        self._buf = prefix  # the stream's text from absolute offset `_base` on (the answer starts at 0)
        self._base = -len(prefix)
        self._emitted = 0  # absolute offset: everything before it was released
        self._checked = 0  # absolute offset: the classifier has passed everything before it
        self._scheduled = 0  # absolute offset of the last check the schedule made (see _check_due)
        self._blocked: Verdict | None = None
        self._finished = False
        # The hold-back exists for the deny rules: with none for answers, text waits only for
        # the classifier's check.
        self._holdback_chars = 0 if rules.is_empty else policy.holdback_chars

    @property
    def num_held_chars(self) -> int:
        return self._base + len(self._buf) - self._emitted

    async def feed(self, text: str) -> tuple[str, Verdict | None]:
        if self._blocked is not None or self._finished:
            return "", self._blocked
        self._buf += text
        end = self._base + len(self._buf)
        scan = self._rules.scan(self._buf, self._scan_from(), final=False)
        if scan.match is not None:
            return "", self._block(Verdict.block(SafetyLayer.RULES, scan.match.category))
        scheduled = self._check_due(text, end)
        # Without an unchecked start, the answer's first text is checked at once (a few tokens:
        # a cheap check), so the first token is not held for the next 40 characters. That
        # check is an extra: the schedule keeps counting from its own checks.
        first = self._checked == 0 and end > 0 and self._policy.first_unchecked_chars <= 0
        if self._classify is not None and (scheduled or first):
            verdict = await self._classify(self._window())
            if not verdict.allowed:
                return "", self._block(verdict)
            self._checked = end
            if scheduled:
                self._scheduled = end
        cutoff = end - self._holdback_chars
        if scan.pending_start is not None:
            cutoff = min(cutoff, self._base + scan.pending_start)
        if self._classify is not None:
            cutoff = min(cutoff, max(self._checked, self._policy.first_unchecked_chars))
        return self._release(cutoff), None

    async def finish(self) -> tuple[str, Verdict | None]:
        """Check and release the held-back tail; the stream has no more text."""
        if self._blocked is not None or self._finished:
            return "", self._blocked
        end = self._base + len(self._buf)
        match = self._rules.scan(self._buf, self._scan_from(), final=True).match
        if match is not None:
            return "", self._block(Verdict.block(SafetyLayer.RULES, match.category))
        if self._classify is not None and end > self._checked:
            verdict = await self._classify(self._window())
            if not verdict.allowed:
                return "", self._block(verdict)
        self._finished = True
        tail = self._release(end)
        self._on_done(Verdict.allow())
        return tail, None

    def _check_due(self, new_text: str, end: int) -> bool:
        unchecked = end - self._scheduled
        if unchecked >= self._policy.check_every_chars:
            return True
        if unchecked < self._policy.min_check_chars:
            return False
        if any(c in _SENTENCE_ENDS for c in new_text):
            return True
        # Early in the answer, check at a word end whenever the unchecked text is as long as
        # the checked: at about 40, 80, 160 characters, then every check_every_chars.
        return unchecked >= self._scheduled and any(c in _WORD_ENDS for c in new_text)

    def _scan_from(self) -> int:
        # Matches that start up to `rescan_chars` before the release point are still found, so
        # a match longer than the hold-back ends the stream (part of it was released already).
        return max(0, self._emitted - self._policy.rescan_chars - self._base)

    def _window(self) -> str:
        return self._buf[-self._policy.window_chars :]

    def _release(self, cutoff: int) -> str:
        if cutoff <= self._emitted:
            return ""
        out = self._buf[self._emitted - self._base : cutoff - self._base]
        self._emitted = cutoff
        # Keep enough released text for the rescan margin, \b context and the classifier window.
        keep_from = self._emitted - max(self._policy.rescan_chars + 32, self._policy.window_chars)
        if keep_from > self._base:
            self._buf = self._buf[keep_from - self._base :]
            self._base = keep_from
        return out

    def _block(self, verdict: Verdict) -> Verdict:
        self._blocked = verdict
        self._on_done(verdict)
        return verdict
