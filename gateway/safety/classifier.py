"""The classifier layer: a light trained head over MiniLM token states, per category.

The head pools the token states of the latest user turns with a few learned attention
queries plus a mean, then a one-hidden-layer MLP gives softmax probabilities over
`benign` and the categories. Each turn's pooled summary is cached (keyed by a digest of its
text), so a conversation only pays the encoder for its new turn. Numpy only; blocking.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from gateway.safety.types import BENIGN

log = structlog.get_logger(__name__)

HEAD_FORMAT = "safety-head/1"


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (the training script uses the same one)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


@dataclass(frozen=True, slots=True)
class SafetyHead:
    """Trained parameters, loaded from a .npz file written by scripts/train_safety.py."""

    classes: tuple[str, ...]  # classes[0] == "benign"; the rest are the categories
    queries: np.ndarray  # [num_queries, dim] attention-pooling queries
    last_bias: np.ndarray  # [num_queries] logit bonus for tokens of the newest turn
    w1: np.ndarray  # [(num_queries + 1) * dim, hidden]
    b1: np.ndarray  # [hidden]
    w2: np.ndarray  # [hidden, num_classes]
    b2: np.ndarray  # [num_classes]
    max_tokens: int  # window size the head was trained with
    context_turns: int  # user turns the head was trained to read together

    @property
    def categories(self) -> tuple[str, ...]:
        return self.classes[1:]

    @classmethod
    def load(cls, path: Path) -> SafetyHead:
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) != HEAD_FORMAT:
                raise ValueError(f"{path}: not a {HEAD_FORMAT} file")
            head = cls(
                classes=tuple(str(c) for c in z["classes"]),
                queries=z["queries"].astype(np.float32),
                last_bias=z["last_bias"].astype(np.float32),
                w1=z["w1"].astype(np.float32),
                b1=z["b1"].astype(np.float32),
                w2=z["w2"].astype(np.float32),
                b2=z["b2"].astype(np.float32),
                max_tokens=int(z["max_tokens"]),
                context_turns=int(z["context_turns"]),
            )
        num_queries, dim = head.queries.shape
        if head.classes[0] != BENIGN or head.w1.shape[0] != (num_queries + 1) * dim or head.w2.shape[1] != len(head.classes):
            raise ValueError(f"{path}: inconsistent head shapes or classes")
        return head

    def probabilities(self, pooled: np.ndarray) -> np.ndarray:
        """[batch, (num_queries + 1) * dim] pooled features -> [batch, num_classes]."""
        logits = gelu_tanh(pooled @ self.w1 + self.b1) @ self.w2 + self.b2
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """Mergeable attention-pooling state of one turn's tokens (a streaming log-sum-exp)."""

    peak: np.ndarray  # [num_queries] max attention logit
    weight: np.ndarray  # [num_queries] sum of exp(logit - peak)
    value: np.ndarray  # [num_queries, dim] sum of exp(logit - peak) * state
    state_sum: np.ndarray  # [dim] for the mean
    num_tokens: int


def summarize(head: SafetyHead, states: np.ndarray) -> TurnSummary:
    """states: [num_tokens, dim] -> the turn's summary under this head's queries."""
    logits = states @ head.queries.T / np.sqrt(states.shape[1])  # [num_tokens, num_queries]
    peak = logits.max(axis=0)
    e = np.exp(logits - peak)
    return TurnSummary(peak, e.sum(axis=0), e.T @ states, states.sum(axis=0), len(states))


def pool(head: SafetyHead, summaries: Sequence[TurnSummary]) -> np.ndarray:
    """[(num_queries + 1) * dim] features of the turns read together; the last one is newest.

    Equal to attention over the concatenated tokens with `last_bias` added to the newest
    turn's logits, which is what the training script computes."""
    bonus = [head.last_bias if i == len(summaries) - 1 else 0.0 for i in range(len(summaries))]
    peaks = np.stack([s.peak + b for s, b in zip(summaries, bonus)])  # [turns, queries]
    top = peaks.max(axis=0)
    scale = np.exp(peaks - top)  # [turns, queries]
    weight = sum(sc * s.weight for sc, s in zip(scale, summaries))
    value = sum(sc[:, None] * s.value for sc, s in zip(scale, summaries))
    attended = value / weight[:, None]  # [queries, dim]
    mean = sum(s.state_sum for s in summaries) / max(1, sum(s.num_tokens for s in summaries))
    return np.concatenate([attended.reshape(-1), mean]).astype(np.float32)


class SafetyClassifier:
    """Scores conversations and answer windows; thread-safe."""

    def __init__(self, embedder, head: SafetyHead, *, max_windows: int, cache_entries: int):
        self._embedder = embedder  # MiniLmEmbedder (or anything with the same `encode`)
        self.head = head
        self._max_windows = max_windows
        self._cache: OrderedDict[bytes, TurnSummary] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    @property
    def categories(self) -> tuple[str, ...]:
        return self.head.categories

    def score_turns(self, turns: Sequence[str]) -> np.ndarray:
        """[num_categories]: per category, the higher of (the newest turn alone, all `turns`
        read together). Callers pass the latest few user turns, oldest first."""
        summaries = self._summaries(turns)
        rows = [pool(self.head, summaries[-1:])]
        if len(summaries) > 1:
            rows.append(pool(self.head, summaries))
        return self.head.probabilities(np.stack(rows))[:, 1:].max(axis=0)

    def score_text(self, text: str) -> np.ndarray:
        """[num_categories] for one text read alone (a window of a streamed answer); not cached."""
        states = self._embedder.encode([text], max_windows=self._max_windows)[0]
        return self.head.probabilities(pool(self.head, [summarize(self.head, states)])[None])[0, 1:]

    def _summaries(self, turns: Sequence[str]) -> list[TurnSummary]:
        keys = [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in turns]
        with self._lock:
            found = {k: self._cache[k] for k in keys if k in self._cache}
            for k in found:
                self._cache.move_to_end(k)
        missing = [(k, t) for k, t in zip(keys, turns) if k not in found]
        if missing:
            states = self._embedder.encode([t for _, t in missing], max_windows=self._max_windows)
            new = {k: summarize(self.head, s) for (k, _), s in zip(missing, states)}
            found.update(new)
            with self._lock:
                self._cache.update(new)
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        return [found[k] for k in keys]
