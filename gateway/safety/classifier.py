"""The classifier layer: a light trained head over MiniLM token states, per category.

The head pools the token states of the latest user turns with a few learned attention
queries plus a mean, then a one-hidden-layer MLP gives softmax probabilities over
`benign` and the categories. Each turn's pooled summaries (one per encoder window) are cached,
keyed by a digest of its text, so a conversation only pays the encoder for its new turn.
Numpy only; blocking.
"""

from __future__ import annotations

import enum
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

HEAD_FORMAT = "safety-head/2"  # /2 added the encoder adapter; /1 files (no adapter) still load
_READABLE_FORMATS = ("safety-head/1", HEAD_FORMAT)


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
    adapter: dict[str, np.ndarray]  # encoder weight name -> delta [out, in] to add (may be empty)
    encoder_layers: int = 0  # the encoder's first layers the head reads the output of (0: all)

    @property
    def categories(self) -> tuple[str, ...]:
        return self.classes[1:]

    @classmethod
    def load(cls, path: Path) -> SafetyHead:
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) not in _READABLE_FORMATS:
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
                adapter=_adapter_deltas(z),
                encoder_layers=int(z["encoder_layers"]) if "encoder_layers" in z else 0,
            )
        num_queries, dim = head.queries.shape
        shapes_ok = head.w1.shape[0] == (num_queries + 1) * dim and head.w2.shape[1] == len(head.classes)
        if head.classes[0] != BENIGN or not shapes_ok:
            raise ValueError(f"{path}: inconsistent head shapes or classes")
        return head

    def probabilities(self, pooled: np.ndarray) -> np.ndarray:
        """[batch, (num_queries + 1) * dim] pooled features -> [batch, num_classes]."""
        logits = gelu_tanh(pooled @ self.w1 + self.b1) @ self.w2 + self.b2
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)


def _adapter_deltas(z) -> dict[str, np.ndarray]:
    """Low-rank factors `adapter.<weight>.A` [rank, in] and `.B` [out, rank] -> B @ A."""
    names = sorted(k[len("adapter.") : -len(".A")] for k in z.files if k.startswith("adapter.") and k.endswith(".A"))
    return {n: z[f"adapter.{n}.B"].astype(np.float32) @ z[f"adapter.{n}.A"].astype(np.float32) for n in names}


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


def merge(parts: Sequence[TurnSummary], bonus: Sequence[np.ndarray | float] | None = None) -> TurnSummary:
    """One summary of several token runs read as one; `bonus` is added to each run's
    attention logits. Exact: attention over the concatenated tokens gives the same."""
    if len(parts) == 1 and bonus is None:
        return parts[0]
    bonus = bonus if bonus is not None else [0.0] * len(parts)
    peaks = np.stack([s.peak + b for s, b in zip(parts, bonus, strict=True)])  # [runs, queries]
    top = peaks.max(axis=0)
    scale = np.exp(peaks - top)  # [runs, queries]
    weight = sum(sc * s.weight for sc, s in zip(scale, parts, strict=True))
    value = sum(sc[:, None] * s.value for sc, s in zip(scale, parts, strict=True))
    state_sum = np.sum(np.stack([s.state_sum for s in parts]), axis=0)  # [dim]
    return TurnSummary(top, weight, value, state_sum, sum(s.num_tokens for s in parts))


def pool(head: SafetyHead, summaries: Sequence[TurnSummary]) -> np.ndarray:
    """[(num_queries + 1) * dim] features of the turns read together; the last one is newest.

    Equal to attention over the concatenated tokens with `last_bias` added to the newest
    turn's logits, which is what the training script computes."""
    bonus = [head.last_bias if i == len(summaries) - 1 else 0.0 for i in range(len(summaries))]
    s = merge(summaries, bonus)
    attended = s.value / s.weight[:, None]  # [queries, dim]
    mean = s.state_sum / max(1, s.num_tokens)
    return np.concatenate([attended.reshape(-1), mean]).astype(np.float32)


Windows = tuple[TurnSummary, ...]  # one text's summaries, one per encoder window


class JobKind(enum.Enum):
    TURNS = "turns"  # a conversation's latest user turns, oldest first (cached per turn)
    TEXT = "text"  # one text read alone: a window of a streamed answer


@dataclass(frozen=True, slots=True)
class ScoreJob:
    texts: tuple[str, ...]
    kind: JobKind

    @property
    def num_chars(self) -> int:
        return sum(len(t) for t in self.texts)


class SafetyClassifier:
    """Scores conversations and answer windows; thread-safe."""

    def __init__(self, embedder, head: SafetyHead, *, max_windows: int, cache_entries: int):
        self.embedder = embedder  # MiniLmEmbedder (or anything with the same `encode`)
        self.head = head
        self._max_windows = max_windows
        self._cache: OrderedDict[bytes, Windows] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    @property
    def categories(self) -> tuple[str, ...]:
        return self.head.categories

    def score_turns(self, turns: Sequence[str]) -> np.ndarray:
        """[num_categories]: per category, the highest score of the views of the newest turn
        (whole, and each of its windows alone when it is long) and of all `turns` read
        together. Callers pass the latest few user turns, oldest first."""
        return self.score([ScoreJob(tuple(turns), JobKind.TURNS)])[0]

    def score_text(self, text: str) -> np.ndarray:
        """[num_categories] for one text read alone (a window of a streamed answer); not cached."""
        return self.score([ScoreJob((text,), JobKind.TEXT)])[0]

    def score(self, jobs: Sequence[ScoreJob]) -> list[np.ndarray]:
        """Per job, its [num_categories] scores; one encoder forward serves every job's
        texts that are not in the turn cache (a turn two jobs share is encoded once). Answer
        windows (TEXT jobs) are not cached: they rarely repeat."""
        keys: list[list[bytes | int]] = [
            [_digest(t) for t in job.texts] if job.kind is JobKind.TURNS else [i] for i, job in enumerate(jobs)
        ]
        found: dict[bytes | int, Windows] = {}
        with self._lock:
            for k in (k for ks in keys for k in ks if isinstance(k, bytes) and k in self._cache):
                found[k] = self._cache[k]
                self._cache.move_to_end(k)
        missing = {
            k: t
            for job, ks in zip(jobs, keys, strict=True)
            for k, t in zip(ks, job.texts, strict=True)
            if k not in found
        }
        if missing:
            states = self.embedder.encode_windows(list(missing.values()), max_windows=self._max_windows)
            new = {k: tuple(summarize(self.head, w) for w in s) for k, s in zip(missing, states, strict=True)}
            found.update(new)
            with self._lock:
                self._cache.update((k, v) for k, v in new.items() if isinstance(k, bytes))
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        return [self._score_windows([found[k] for k in ks]) for ks in keys]

    def _score_windows(self, turns: list[Windows]) -> np.ndarray:
        whole = [merge(w) for w in turns]
        rows = self._views(turns[-1])
        if len(whole) > 1:
            rows.append(pool(self.head, whole))
        return self.head.probabilities(np.stack(rows))[:, 1:].max(axis=0)

    def _views(self, windows: Windows) -> list[np.ndarray]:
        """A text read whole, plus each window alone when there are several: a harmful
        request inside a long harmless message is not averaged away."""
        rows = [pool(self.head, [merge(windows)])]
        if len(windows) > 1:
            rows += [pool(self.head, [w]) for w in windows]
        return rows


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
