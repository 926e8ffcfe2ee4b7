"""Prompt-lookup speculation (engine.speculative_tokens): draft tokens copied from the sequence itself.

When one sequence runs alone its decode step reads every weight for one token; reading them
for a few more costs little. So the step feeds the sequence's next token plus up to k draft
tokens: the ones that followed the latest earlier occurrence of its last 3 (else 2) tokens, in
its prompt or its answer (answers that quote the prompt, code being edited, repeated
structure). The model's greedy choice at every position verifies them: the drafts it agrees
with are kept, and its choice after the last kept one is the step's extra token. The output is
the greedy output without speculation; a step produces 1 to k + 1 tokens.

Torch-free: the scheduler proposes, the runner returns each row's argmax, and `verify` keeps
what the model agreed with. Only plain greedy requests speculate (no sampling, penalties, logit_bias,
logprobs, grammar, stop strings, pending min_tokens or thinking budget), only while their
sequence is the only one running and none waits (with more, the step is no longer bound by
reading weights), and only while at least a quarter of their drafts were kept (after 16).
"""

from __future__ import annotations

from array import array

from engine.native.sequence import Sequence

_NGRAMS = (3, 2)  # suffix lengths tried, longest first
# A sequence whose drafts are mostly wrong stops drafting: a step with drafts costs more than a
# decode step (on the CPU it leaves the one-call decode kernel), so rejected drafts are a loss.
_TRIAL_DRAFTS = 16
_MIN_KEPT_SHARE = 0.25
_LOOKBACK = 4096  # tokens searched: the most recent ones


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the sequence's last n tokens (n = 3,
    else 2): the latest one followed by k tokens, else the earliest.

    Runs every step of a speculating sequence, so it searches bytes (C) rather than tokens in
    Python: a few microseconds for thousands of tokens."""
    if k <= 0:
        return []
    tokens = token_ids[-_LOOKBACK:]
    data = array("i", tokens).tobytes()
    for n in _NGRAMS:
        if len(tokens) <= n:
            continue
        suffix = data[-4 * n :]
        # Occurrences that end before the last token; first those followed by k tokens.
        start = _find(data, suffix, 4 * (len(tokens) - k), latest=True)
        if start is None:
            start = _find(data, suffix, 4 * (len(tokens) - 1), latest=False)
        if start is not None:
            return tokens[start + n : start + n + k]
    return []


def _find(data: bytes, sub: bytes, end: int, *, latest: bool) -> int | None:
    """The token index of the latest (or earliest) occurrence of `sub` ending by byte `end`,
    at a token boundary; None if there is none."""
    lo, hi = 0, end
    while True:
        pos = data.rfind(sub, lo, hi) if latest else data.find(sub, lo, hi)
        if pos < 0:
            return None
        if pos % 4 == 0:
            return pos // 4
        if latest:  # a match across token boundaries: look further back
            hi = pos + len(sub) - 1
        else:
            lo = pos + 1


def eligible(seq: Sequence) -> bool:
    """Whether the step's argmax alone picks this sequence's next token (what `verify` uses)."""
    s = seq.sampling
    return (
        s.is_greedy
        and not s.stop
        and s.logprobs is None
        and s.structured is None
        and seq.grammar is None
        and not s.logit_bias
        and s.repetition_penalty == 1.0
        and s.presence_penalty == 0.0
        and s.frequency_penalty == 0.0
        and seq.num_completion_tokens >= s.min_tokens
        and seq.prompt_logprobs is None
        and not seq.images
        and seq.thinking is None
        and (seq.num_drafted < _TRIAL_DRAFTS or seq.num_kept >= _MIN_KEPT_SHARE * seq.num_drafted)
    )


def verify(drafts: list[int], argmax: list[int]) -> list[int]:
    """The step's new tokens: the drafts the model agreed with, then its own next choice.
    argmax[i] is the model's choice after the step's i-th token (the fed token, then the drafts)."""
    kept = 0
    while kept < len(drafts) and argmax[kept] == drafts[kept]:
        kept += 1
    return [*drafts[:kept], argmax[kept]]
