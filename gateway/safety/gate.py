"""The safety gate: screens a conversation before the engine and hands out output filters.

Layers run cheapest first: rules, then the classifier. Both run off the event loop (on the
native CPU engine's step thread between its steps where one runs, else on a worker thread),
batched across requests (batcher.py: one encoder forward for every prompt and answer window
waiting), and a conversation's verdict is cached by its text. Every decision is counted and logged without any text. The
gate never sees the engine; the server decides what a block means for the request. `assess` gives
one text's findings in full (every rule's category, every score) for POST /v1/moderations.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
import structlog

from engine.torch_threads import (
    PoolOwnerExecutor,
    available_cores,
    side_executor,
    threaded_executor,
)
from gateway.safety.batcher import MicroBatcher
from gateway.safety.classifier import JobKind, SafetyClassifier, SafetyHead, ScoreJob
from gateway.safety.output import OutputFilter, OutputPolicy
from gateway.safety.rules import ALL_CATEGORIES, RuleSet
from gateway.safety.types import Assessment, SafetyLayer, Stage, Verdict
from settings import ConfigError, SafetyConfig

# The classifier's batches run on the native CPU engine's step thread, between its steps, on
# its OpenMP pool (engine/torch_threads.PoolOwner): all the cores, taking turns with the engine.
# On 2 cores a worker thread of its own made a third runnable thread, which stalled the
# engine's parallel regions whenever it shared a core with one of them (bench/RESULTS.md #22).
# Without a native CPU engine (the engine on a GPU, another backend) the batches run on a worker
# of their own with `safety.threads` OpenMP threads (classifier_threads): on a 16-core H100 host a
# single-threaded worker held the default configuration to 0.41x of safety off. Loading, and
# gates built without `threads` (tests), use the single-threaded side workers.


def classifier_threads(configured: int, cpu_engine: bool) -> int:
    """How many CPU threads the classifier's batches get: 1 beside a native CPU engine (its step
    thread runs them on its own pool, between steps: a second pool would slow the engine), else
    `safety.threads`, or when 0 all cores but two (the event loop, the engine's launch thread),
    at least two where there are two: on 2 cores beside a fake engine that takes no CPU, two
    threads gave the gate 1.34x the throughput of one although the event loop shares them."""
    if cpu_engine:
        return 1
    if configured > 0:
        return configured
    cores = available_cores()
    return max(min(cores, 2), cores - 2)


async def _off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(side_executor(), fn, *args)


log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
_NONE = "none"  # metric label for "no layer / no category" (allowed)
_OUTPUT_WINDOW_CHARS = 400  # about one 128-token classifier window of English text
# Text one classifier batch reads at most (about 1,000 tokens): enough rows for the matmuls to
# run at full speed, few enough that a check arriving behind a batch does not wait long.
_MAX_BATCH_CHARS = 4000
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0)


def user_turns(messages: Sequence[dict]) -> list[str]:
    """The text of every user message, oldest first (content strings or text parts)."""
    turns = []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            turns.append(content)
        elif isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            turns.append("\n".join(t for t in parts if isinstance(t, str)))
    return turns


@dataclass(frozen=True, slots=True)
class _Job:
    """One entry of a batch: what the classifier reads, and whether it is assessed in full (every
    deny rule's category, and the classifier's scores even after a rule matched: POST
    /v1/moderations) or screened (the first rule match decides, without the classifier)."""

    score: ScoreJob
    in_full: bool = False

    @property
    def num_chars(self) -> int:
        return self.score.num_chars


def _digest(turns: Sequence[str]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for turn in turns:
        data = turn.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))  # so ("ab", "c") and ("a", "bc") differ
        h.update(data)
    return h.digest()


def resolve_path(path: str) -> Path:
    """Relative paths are relative to the repository root, not the working directory."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


class SafetyGate:
    def __init__(
        self,
        config: SafetyConfig,
        *,
        registry: prometheus_client.CollectorRegistry | None = None,
        classifier: SafetyClassifier | None = None,
        kernel_isa: str = "auto",
        threads: int = 1,
    ):
        """`classifier`: an already loaded one to share (tests, several gates); else start() loads it.
        `kernel_isa`: the engine's `engine.kernel_isa`, so the classifier runs the same compiled
        kernel path as the engine (one decision, kernels.resolve_mode). `threads`: the CPU threads
        of its batches when no native CPU engine takes them (classifier_threads)."""
        self.config = config
        self._kernel_isa = kernel_isa
        self.threads = threads
        allow = {**config.allow_categories, ALL_CATEGORIES: list(config.allow)}
        self._prompt_rules = RuleSet.merged(config.deny, allow, builtin=config.builtin_rules)
        # The built-in patterns are phrased as requests; answers get the operator's rules only.
        self._output_rules = RuleSet.merged(config.deny, allow, builtin=False)
        self._classifier = classifier if config.classifier else None
        self._batcher: MicroBatcher[_Job, Assessment] = MicroBatcher(
            self._run_batch,
            lambda: PoolOwnerExecutor(lambda: threaded_executor(threads)),  # one thread: the side workers
            weight=lambda job: job.num_chars,
            max_batch_weight=_MAX_BATCH_CHARS,
            # Prompts and answer windows before moderation inputs: POST /v1/moderations (32 inputs
            # of 1,000 characters a request, from any tier) must not stall every tier's chats.
            urgent=lambda job: not job.in_full,
        )
        # digest of the screened turns -> their verdict
        self._screened: OrderedDict[bytes, Verdict] = OrderedDict()
        registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._decisions = prometheus_client.Counter(
            "chat_safety_gate_decisions",
            "Safety gate decisions (prompt screening and output filtering).",
            ("stage", "layer", "category", "tier", "action"),
            registry=registry,
        )
        self._screen_seconds = prometheus_client.Histogram(
            "chat_safety_prompt_screen_seconds",
            "Time to screen a prompt (rules and classifier).",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )

    @property
    def has_classifier(self) -> bool:
        return self._classifier is not None

    @property
    def categories(self) -> tuple[str, ...]:
        """Every category a prompt can be blocked under: the classifier's, then the deny rules'
        others (operators' own names), in declaration order."""
        scored = self._classifier.categories if self._classifier is not None else ()
        return scored + tuple(c for c in self._prompt_rules.categories if c not in scored)

    async def start(self) -> None:
        """Load the embedder and the head, off the event loop. Until then only rules apply."""
        if self.config.classifier and self._classifier is None:
            self._classifier = await _off_loop(load_classifier, self.config, self._kernel_isa)

    async def screen_prompt(self, messages: Sequence[dict], *, tier: str) -> Verdict:
        started_s = time.perf_counter()
        recent = tuple(user_turns(messages)[-self.config.context_turns :])
        verdict = Verdict.allow()
        if recent:
            key = _digest(recent)
            cached = self._screened.get(key)
            if cached is None:
                verdict = (await self._batcher.submit(_Job(ScoreJob(recent, JobKind.TURNS)))).verdict
                if self._classifier is not None or not self.config.classifier:  # not before start() loaded it
                    self._remember(key, verdict)
            else:
                self._screened.move_to_end(key)
                verdict = cached
        self._screen_seconds.observe(time.perf_counter() - started_s)
        self._record(Stage.PROMPT, verdict, tier)
        return verdict

    async def assess(self, text: str, *, tier: str) -> Assessment:
        """`text` read as a conversation's only user turn, every layer in full (POST
        /v1/moderations): its verdict is the one screen_prompt gives that conversation. Batched
        with the prompts and answer windows waiting (which go first); its turn joins the
        classifier's turn cache (a text moderated and then sent is encoded once); counted under
        the stage "moderation"."""
        assessment = await self._batcher.submit(_Job(ScoreJob((text,), JobKind.TURNS), in_full=True))
        self._record(Stage.MODERATION, assessment.verdict, tier)
        return assessment

    def _remember(self, key: bytes, verdict: Verdict) -> None:
        self._screened[key] = verdict
        while len(self._screened) > self.config.embed_cache_entries:
            self._screened.popitem(last=False)

    def output_filter(self, *, tier: str, prefix: str = "") -> OutputFilter:
        cfg = self.config
        policy = OutputPolicy(
            holdback_chars=cfg.holdback_chars,
            check_every_chars=cfg.output_check_chars,
            min_check_chars=max(1, cfg.output_check_chars // 4),
            window_chars=_OUTPUT_WINDOW_CHARS,
            first_unchecked_chars=cfg.output_first_unchecked_chars,
        )
        classify = self._classify_output if (cfg.output_classifier and self._classifier is not None) else None
        return OutputFilter(
            self._output_rules,
            policy,
            classify=classify,
            on_done=lambda v: self._record(Stage.OUTPUT, v, tier),
            prefix=prefix,
        )

    def refusal_text(self, verdict: Verdict) -> str:
        """The refusal answer for a blocked prompt (per-category text where configured)."""
        return self.config.refusal_messages.get(verdict.category or "", self.config.refusal_message)

    def threshold(self, category: str) -> float:
        return self.config.thresholds.get(category, self.config.threshold)

    def _run_batch(self, jobs: list[_Job]) -> list[Assessment]:
        """Blocking (a worker thread): per job, rules first for prompts (answers' rules run in
        the output filter), then one classifier pass for every job the rules let through and
        every job assessed in full."""
        matched = [self._rule_categories(job) for job in jobs]
        todo = [i for i, job in enumerate(jobs) if job.in_full or not matched[i]]
        scored: dict[int, dict[str, float]] = {}
        if todo and self._classifier is not None:  # TEXT jobs come only with a classifier
            categories = self._classifier.categories
            scores = self._classifier.score([jobs[i].score for i in todo])
            scored = {i: dict(zip(categories, s.tolist(), strict=True)) for i, s in zip(todo, scores, strict=True)}
        return [self._assessment(job, matched[i], scored.get(i)) for i, job in enumerate(jobs)]

    def _rule_categories(self, job: _Job) -> tuple[str, ...]:
        """The prompt rules' categories that match a conversation's turns: the first only unless
        the job is assessed in full; none for answer windows."""
        if job.score.kind is not JobKind.TURNS:
            return ()
        text = "\n\n".join(job.score.texts)
        if job.in_full:
            return self._prompt_rules.matched_categories(text)
        match = self._prompt_rules.first_match(text)
        return () if match is None else (match.category,)

    def _assessment(self, job: _Job, rules: tuple[str, ...], scores: dict[str, float] | None) -> Assessment:
        threshold = self._threshold_for(job.score.kind)
        over = tuple(c for c, score in (scores or {}).items() if score >= threshold(c) and c not in rules)
        verdict = Verdict.block(SafetyLayer.RULES, rules[0]) if rules else self._judge(scores or {}, threshold)
        return Assessment(verdict, rules, scores, rules + over)

    def _threshold_for(self, kind: JobKind) -> Callable[[str], float]:
        if kind is JobKind.TURNS:
            return self.threshold
        return lambda _category: self.config.output_threshold

    async def _classify_output(self, text: str) -> Verdict:
        return (await self._batcher.submit(_Job(ScoreJob((text,), JobKind.TEXT)))).verdict

    def _judge(self, scores: Mapping[str, float], threshold: Callable[[str], float]) -> Verdict:
        best: tuple[float, str] | None = None
        for category, score in scores.items():
            if score >= threshold(category) and (best is None or score > best[0]):
                best = (score, category)
        return Verdict.allow() if best is None else Verdict.block(SafetyLayer.CLASSIFIER, best[1], best[0])

    def _record(self, stage: Stage, verdict: Verdict, tier: str) -> None:
        action = "allow" if verdict.allowed else "block"
        layer = verdict.layer.value if verdict.layer is not None else _NONE
        category = verdict.category or _NONE
        self._decisions.labels(stage.value, layer, category, tier, action).inc()
        if verdict.allowed:
            log.debug("safety_allowed", stage=stage.value, tier=tier)
        else:
            log.info(
                "safety_blocked", stage=stage.value, layer=layer, category=category, tier=tier, score=verdict.score
            )


def load_classifier(config: SafetyConfig, kernel_isa: str = "auto") -> SafetyClassifier:
    """Embedder + head from disk; blocking. Raises ConfigError naming the setting at fault.
    `kernel_isa` as `engine.kernel_isa` (auto, avx512, avx2, torch)."""
    from gateway.safety.embedder import MiniLmEmbedder, resolve_dtype

    path = resolve_path(config.classifier_path)
    if not path.is_file():
        raise ConfigError(
            f"safety.classifier_path: {path} not found (run `make train-safety`, or set safety.classifier = false)"
        )
    try:
        head = SafetyHead.load(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"safety.classifier_path: {exc}") from None
    unknown = sorted(set(config.thresholds) - set(head.categories))
    if unknown:
        raise ConfigError(f"safety.thresholds: unknown category {unknown[0]!r}; the head knows {list(head.categories)}")
    try:
        dtype = resolve_dtype(config.embed_dtype, kernel_isa)
    except ValueError as exc:
        raise ConfigError(f"safety.embed_dtype: {exc}") from None
    embedder = MiniLmEmbedder(
        dtype=dtype,
        max_tokens=head.max_tokens,
        adapter=head.adapter,
        num_layers=head.encoder_layers,
        kernel_isa=kernel_isa,
    )
    log.info("safety_classifier_loaded", path=str(path), categories=list(head.categories))
    return SafetyClassifier(embedder, head, max_windows=config.max_windows, cache_entries=config.embed_cache_entries)
