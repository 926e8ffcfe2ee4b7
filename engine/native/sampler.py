"""Turns one step's logits into next tokens, one row per sequence, honouring SamplingParams.

Order: logit_bias, repetition penalty, presence/frequency penalties, min_tokens (stop ids
masked), the grammar's token mask (structured outputs), a forced token (a spent thinking
budget: every other token masked), then greedy argmax or temperature, top-k, top-p and a draw.
A seeded request draws from a generator seeded by (seed, position), so its output does not
depend on what else shares the batch or on preemption. Logprobs, when asked for, are those of
the distribution sampled from after temperature (and biases, penalties and masks), before
top-k/top-p; greedy rows report the unscaled distribution (a forced token's logprob is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    token_ids: list[int]  # the sequence's prompt and completion so far (shared, not copied)
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    grammar: GrammarMatcher | None = None  # structured output: only its allowed tokens may be drawn
    logprobs_sink: list[TokenLogprob] | None = None  # the sequence's logprobs, appended to when asked
    seen: SeenTokens | None = None  # which ids token_ids holds; needed when repetition_penalty != 1
    forced: int | None = None  # the token this row must take (a spent thinking budget's closing tokens)
    also_allowed: int | None = None  # a token the grammar's mask leaves drawable (thinking's opening tag)
    mask_stop: bool = False  # stop ids masked (thinking that a grammar waits for: the answer must come)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SeenTokens:
    """The set of token ids in one sequence (prompt and output) as a [vocab] bool mask, brought
    up to date with the tokens appended since the last step (token ids never change once there).
    Lives on the sequence, so it goes with it and survives preemption."""

    __slots__ = ("mask", "num_tokens")

    def __init__(self, vocab_size: int, device: torch.device):
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.num_tokens = 0

    def update(self, token_ids: list[int]) -> torch.Tensor:
        if self.num_tokens < len(token_ids):
            new = torch.tensor(token_ids[self.num_tokens :], dtype=torch.long)
            self.mask[new[new < self.mask.shape[0]].to(self.mask.device)] = True
            self.num_tokens = len(token_ids)
        return self.mask


class Sampler:
    def __init__(self, vocab_size: int, *, seed: int | None = None, device: torch.device | None = None):
        self.vocab_size = vocab_size
        # Unseeded draws come from this generator, on the logits' device (a CUDA tensor takes only a CUDA one).
        self._generator = torch.Generator(device=device or torch.device("cpu"))
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits: [num_rows, vocab] fp32 (any device) -> one token id per row.

        Rows that need nothing beyond greedy argmax stay on that plain path; only the others
        (penalties, grammar, sampling, logprobs) are copied out and processed, so one such row
        costs its own work and not a pass over every row of the batch."""
        logits = logits[:, : self.vocab_size]
        processed = [i for i, r in enumerate(rows) if _needs_processing(r)]
        if not processed:
            return _argmax(logits).tolist()
        if len(processed) == len(rows):
            return self._process(logits.float().clone(), rows)
        tokens = _argmax(logits).tolist()
        idx = torch.tensor(processed, device=logits.device)
        chosen = self._process(logits.index_select(0, idx).float(), [rows[i] for i in processed])
        for i, token in zip(processed, chosen, strict=True):
            tokens[i] = token
        return tokens

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Biases, penalties, min_tokens, grammar masks, then argmax or a draw; on logits that this owns."""
        _apply_logit_bias(logits, rows)
        _apply_repetition_penalty(logits, rows)
        _apply_penalties(logits, rows)
        _mask_stop_tokens_before_min(logits, rows)
        constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            from engine.grammar import apply_bitmasks

            kept = [(i, r.also_allowed, logits[i, r.also_allowed].clone()) for i, r in _also_allowed(rows)]
            apply_bitmasks(logits, [i for i, _ in constrained], [g for _, g in constrained])
            for i, token, logit in kept:
                logits[i, token] = logit
        _force_tokens(logits, rows)
        greedy = _argmax(logits)
        sampled_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=logits.device)
            # index_copy_, not greedy[idx] = ...: a tensor-indexed assignment runs a slow path on CPU
            greedy.index_copy_(0, idx, self._sample(logits.index_select(0, idx), [rows[i] for i in sampled_rows]))
        tokens = greedy.tolist()
        _record_logprobs(logits, rows, tokens)
        return tokens

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        if any(r.params.top_k is not None for r in rows) or any(r.params.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race (Gumbel-max in another guise): argmax(p / E) ~ Categorical(p).
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            if r.params.seed is None:
                noise[i].exponential_(generator=self._generator)
            else:
                g = torch.Generator(device=probs.device)
                g.manual_seed((r.params.seed * 1_000_003 + r.num_completion_tokens) % (2**63))
                noise[i].exponential_(generator=g)
        return _argmax(probs / noise)


def _record_logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> None:
    """Append each asking row's chosen-token logprob and its top-k alternatives to its sink."""
    asking = [
        (i, r.params.logprobs, r.logprobs_sink)
        for i, r in enumerate(rows)
        if r.params.logprobs is not None and r.logprobs_sink is not None
    ]
    if not asking:
        return
    idx = torch.tensor([i for i, _, _ in asking], device=logits.device)
    temps = torch.tensor([rows[i].params.temperature or 1.0 for i, _, _ in asking], device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, idx) / temps[:, None], dim=-1)  # [num_asking, vocab]
    k = max(n for _, n, _ in asking)
    top_values, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i, _, _ in asking], device=logits.device))
    chosen_l, top_v, top_i = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    for j, (i, n, sink) in enumerate(asking):
        top = tuple(zip(top_i[j][:n], top_v[j][:n], strict=True))
        sink.append(TokenLogprob(tokens[i], chosen_l[j], top))


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Each row's logprob of the prompt token that follows it, and the top k, of the model's own
    distribution (no temperature): `logits` [n, vocab] for positions p..p+n-1, `targets` the tokens at p+1..p+n."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0].tolist()
    top_values, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(target, value, tuple(zip(top_i[j], top_v[j], strict=True)))
        for j, (target, value) in enumerate(zip(targets, chosen, strict=True))
    ]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first largest value, as torch.argmax. On CPU through numpy, whose
    vectorised argmax is ~10x faster than torch's max(dim)/argmax for a step's rows (2-core AMD
    EPYC Zen 4: 8 rows of 32k logits 18 us vs 206 us; measured in bench/RESULTS.md #17)."""
    if x.device.type == "cpu" and x.dtype.is_floating_point:
        return torch.from_numpy(x.float().numpy().argmax(axis=1))
    return x.max(dim=-1).indices


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return (
        not p.is_greedy
        or bool(p.logit_bias)
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or (p.min_tokens > row.num_completion_tokens and bool(row.stop_token_ids))
        or row.grammar is not None
        or p.logprobs is not None
        or row.forced is not None
        or row.mask_stop
    )


def _also_allowed(rows: list[SamplingRow]) -> list[tuple[int, SamplingRow]]:
    return [(i, r) for i, r in enumerate(rows) if r.grammar is not None and r.also_allowed is not None]


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's logit_bias: each listed token's bias added to its logit (ids the engine checked
    are below the vocabulary; one beyond the logits, as a backstop, is skipped)."""
    for i, r in enumerate(rows):
        pairs = [(t, b) for t, b in r.params.logit_bias if t < logits.shape[1]]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor([b for _, b in pairs], device=logits.device))


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """transformers' semantics, batched: a seen token's logit is divided by the row's penalty
    when positive and multiplied by it when negative."""
    penalized = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not penalized:
        return
    idx = torch.tensor(penalized, device=logits.device)
    vocab, device = logits.shape[1], logits.device
    # [num_penalized, vocab]; a row built without its sequence's record gets a one-off one
    seen = torch.stack([(rows[i].seen or SeenTokens(vocab, device)).update(rows[i].token_ids) for i in penalized])
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in penalized], device=logits.device)[:, None]
    sub = logits.index_select(0, idx)
    penalized_logits = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits.index_copy_(0, idx, torch.where(seen, penalized_logits, sub))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI semantics: subtract frequency * count and presence * (count > 0) per token."""
    for i, r in enumerate(rows):
        p = r.params
        if (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0) or r.num_completion_tokens == 0:
            continue
        ids = torch.tensor(r.token_ids[r.num_prompt_tokens :], device=logits.device)
        counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float)
        )
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _mask_stop_tokens_before_min(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        if (r.params.min_tokens > r.num_completion_tokens or r.mask_stop) and r.stop_token_ids:
            ids = [t for t in r.stop_token_ids if t < logits.shape[1]]
            logits[i, ids] = float("-inf")


def _force_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """A forced row keeps one finite logit: greedy and a draw both take it (its logprob is 0)."""
    for i, r in enumerate(rows):
        if r.forced is not None:
            kept = logits[i, r.forced].clone()
            logits[i] = float("-inf")
            logits[i, r.forced] = kept


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep each row's top-k tokens, then the smallest set whose probability reaches top_p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(r.params.top_k or vocab, vocab) for r in rows], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    top_ps = torch.tensor([r.params.top_p for r in rows], device=logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
