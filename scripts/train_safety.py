"""Train the safety classifier on safety/train.jsonl and write safety/classifier.npz.

Two stages, both in torch with the same math the gate runs:
1. a low-rank adapter (LoRA) on the top encoder layers of all-MiniLM-L6-v2, trained with
   the pooling head on single texts, so that the encoder separates intent ("how do I make
   a pipe bomb") from topic ("how do bomb squads work"); the shipped weights stay frozen;
2. the pooling head alone, on conversations (several user turns read together; a harmful
   conversation's opening turns are benign examples, since its benign twin starts the same).
Each stage ends with the mean of its weights over its second half (weight averaging), which
made scores steadier across data changes. The file holds the adapter's factors (the gate adds
them to the encoder once, at load) and the head, as plain arrays. `--cv K` first reports
K-fold cross-validated rates on the train split, scored the way the gate screens a chat,
and suggests per-category thresholds; the held-out split is never read here.
Usage: python -m scripts.train_safety [--cv 5] [--out PATH] [--adapter-layers 3] ...
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gateway.safety.classifier import HEAD_FORMAT
from gateway.safety.dataset import CLASSES, DATA_DIR, Example, Record, load_split, training_examples
from gateway.safety.embedder import (
    ADAPTABLE,
    attention_mask,
    bert_layer,
    default_model_dir,
    embed_tokens,
    load_bert,
)
from gateway.safety.rules import RuleSet

MAX_TOKENS = 128  # encoder window the head is trained with (the gate reads it from the file)
CONTEXT_TURNS = 4
DIM = 384


class TorchHead(torch.nn.Module):
    """Mirror of gateway.safety.classifier: attention pooling + mean, then an MLP."""

    def __init__(self, num_queries: int, hidden: int, dropout: float):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(num_queries, DIM) * 0.05)
        self.last_bias = torch.nn.Parameter(torch.zeros(num_queries))
        self.drop = torch.nn.Dropout(dropout)
        self.fc1 = torch.nn.Linear((num_queries + 1) * DIM, hidden)
        self.fc2 = torch.nn.Linear(hidden, len(CLASSES))

    def forward(self, states: torch.Tensor, is_last: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # states [B, N, D]; is_last (float) and mask (bool) [B, N] -> logits [B, num_classes]
        logits = states @ self.queries.T / DIM**0.5 + is_last[..., None] * self.last_bias
        attn = logits.masked_fill(~mask[..., None], float("-inf")).softmax(dim=1)  # [B, N, Q]
        attended = torch.einsum("bnq,bnd->bqd", attn, states).flatten(1)
        mean = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        x = self.drop(torch.cat([attended, mean], dim=1))
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x), approximate="tanh")))


class Encoder:
    """The frozen encoder split in two: lower layers run once per text (cached); the top
    `num_adapted` layers run with the adapter, with gradients while training."""

    def __init__(self, num_adapted: int, rank: int, alpha: float, num_layers: int = 0):
        from tokenizers import Tokenizer

        model_dir = default_model_dir()
        self.shape, self.base = load_bert(model_dir, num_layers)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.top = list(range(self.shape.num_layers - num_adapted, self.shape.num_layers))
        self.scale = alpha / rank
        self.rank = rank
        self.lora: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}

    def reset_adapter(self, seed: int) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        self.lora = {}
        for i in self.top:
            for name in ADAPTABLE:
                key = f"encoder.layer.{i}.{name}.weight"
                out_dim, in_dim = self.base[key].shape
                a = torch.nn.Parameter(torch.randn(self.rank, in_dim, generator=gen) / in_dim**0.5)
                b = torch.nn.Parameter(torch.zeros(out_dim, self.rank))  # starts as the identity change
                self.lora[key] = (a, b)
        return [p for pair in self.lora.values() for p in pair]

    def deltas(self) -> dict[str, torch.Tensor]:
        return {key: (b @ a) * self.scale for key, (a, b) in self.lora.items()}

    def lower_states(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """text -> [num_tokens, D] input of the first adapted layer (no gradients)."""
        out = {}
        with torch.no_grad():
            for i in range(0, len(texts), 32):
                batch = texts[i : i + 32]
                ids, mask = self.pad([self.tokenizer.encode(t).ids for t in batch])
                x = embed_tokens(ids, self.base, self.shape)
                amask = attention_mask(mask, torch.float32)
                for layer in range(self.top[0] if self.top else self.shape.num_layers):
                    x = bert_layer(x, amask, self.base, f"encoder.layer.{layer}.", self.shape, torch.float32)
                for t, row, m in zip(batch, x, mask, strict=True):
                    out[t] = row[: int(m.sum())].clone()
        return out

    def upper(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, N, D] lower states -> final states, through the adapted top layers."""
        w = {**self.base, **{k: self.base[k] + d for k, d in self.deltas().items()}}
        amask = attention_mask(mask.long(), torch.float32)
        for layer in self.top:
            x = bert_layer(x, amask, w, f"encoder.layer.{layer}.", self.shape, torch.float32)
        return x

    @staticmethod
    def pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return ids, mask


def stage1_texts(records: list[Record]) -> list[tuple[str, int]]:
    """Single texts with labels: prompts and answers as they are; a conversation's turns
    joined (its label), and a benign conversation's turns one by one (benign)."""
    out = []
    for r in records:
        label = CLASSES.index(r.label)
        out.append((" ".join(r.turns), label))
        if r.is_multi_turn and not r.is_harmful:
            out.extend((t, label) for t in r.turns)
    return out


def padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), width, DIM)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
        mask[i, : len(s)] = True
    return x, mask


class WeightAverage:
    """Mean of the parameters taken at the end of each epoch in the second half of training
    (stochastic weight averaging): a flatter solution, whose scores move less when the data
    or the seed change than those of the last step."""

    def __init__(self, params, num_epochs: int, enabled: bool):
        self.params = list(params)
        self.first_epoch = num_epochs // 2 if enabled else num_epochs  # disabled: never takes one
        self.sums: list[torch.Tensor] = []
        self.count = 0

    @torch.no_grad()
    def epoch_done(self, epoch: int) -> None:
        if epoch < self.first_epoch:
            return
        if not self.sums:
            self.sums = [p.detach().clone() for p in self.params]
        else:
            for total, p in zip(self.sums, self.params, strict=True):
                total += p
        self.count += 1

    @torch.no_grad()
    def apply(self) -> None:
        for total, p in zip(self.sums, self.params, strict=True):
            p.copy_(total / self.count)


def train_adapter(enc: Encoder, head: TorchHead, texts, lower, args) -> None:
    """Stage 1: adapter and head together, on single texts."""
    params = enc.reset_adapter(args.seed)
    opt = torch.optim.AdamW(
        [{"params": params, "lr": args.adapter_lr}, {"params": head.parameters(), "lr": args.lr}],
        weight_decay=args.weight_decay,
    )
    order = sorted(range(len(texts)), key=lambda i: len(lower[texts[i][0]]))
    batches = [order[i : i + 16] for i in range(0, len(order), 16)]
    rng = random.Random(args.seed)
    average = WeightAverage([*params, *head.parameters()], args.adapter_epochs, bool(args.average))
    head.train()
    for epoch in range(args.adapter_epochs):
        rng.shuffle(batches)
        for batch in batches:
            x, mask = padded([lower[texts[i][0]] for i in batch])
            y = torch.tensor([texts[i][1] for i in batch])
            logits = head(enc.upper(x, mask), mask.float(), mask)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        average.epoch_done(epoch)
    average.apply()


def final_states(enc: Encoder, lower: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    texts = sorted(lower, key=lambda t: len(lower[t]))
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            batch = texts[i : i + 64]
            x, mask = padded([lower[t] for t in batch])
            for t, row, m in zip(batch, enc.upper(x, mask), mask, strict=True):
                out[t] = row[: int(m.sum())].clone()
    return out


def conversation_batches(examples: list[Example], states, batch_size: int):
    """Padded (states, is_last, mask, labels), built once; similar lengths share a batch."""

    def parts(ex: Example) -> list[torch.Tensor]:
        return [states[t] for t in ex.turns[-CONTEXT_TURNS:]]

    ordered = sorted(examples, key=lambda ex: sum(len(p) for p in parts(ex)))
    batches = []
    for i in range(0, len(ordered), batch_size):
        chunk = ordered[i : i + batch_size]
        seqs = [torch.cat(parts(ex)) for ex in chunk]
        x, mask = padded(seqs)
        last = torch.zeros(mask.shape)
        for row, ex in enumerate(chunk):
            n, newest = len(seqs[row]), len(parts(ex)[-1])
            last[row, n - newest : n] = 1.0
        batches.append((x, last, mask, torch.tensor([ex.label for ex in chunk])))
    return batches


def train_context(head: TorchHead, examples: list[Example], states, args) -> None:
    """Stage 2: the head alone, on conversations; the adapter is fixed."""
    params = list(head.parameters()) if args.context_params == "all" else [head.queries, head.last_bias]
    opt = torch.optim.AdamW(params, lr=args.context_lr, weight_decay=args.weight_decay)
    batches = conversation_batches(examples, states, 32)
    rng = random.Random(args.seed)
    average = WeightAverage(params, args.epochs, bool(args.average))
    head.train()
    for epoch in range(args.epochs):
        rng.shuffle(batches)
        for x, last, mask, y in batches:
            loss = torch.nn.functional.cross_entropy(head(x, last, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        average.epoch_done(epoch)
    average.apply()
    head.eval()


def fit(enc: Encoder, records: list[Record], lower, args) -> tuple[TorchHead, dict]:
    """Both stages on `records`; returns the head and the final states of every text."""
    torch.manual_seed(args.seed)
    head = TorchHead(args.queries, args.hidden, args.dropout)
    train_adapter(enc, head, stage1_texts(records), lower, args)
    states = final_states(enc, lower)
    examples = training_examples(
        records, seed=args.seed, num_prefixed=args.prefixed, benign_openings=bool(args.benign_openings)
    )
    train_context(head, examples, states, args)
    return head, states


def conversation_scores(head: TorchHead, records: list[Record], states) -> np.ndarray:
    """[len(records), num_categories], as the gate and the eval score a conversation: it is
    screened after each user turn, each time max(newest turn alone, latest turns together),
    and a conversation counts as blocked when any of those screens blocks."""
    out = []
    with torch.no_grad():
        for r in records:
            views = []
            for n in range(1, len(r.turns) + 1):
                views.append(Example(r.turns[n - 1 : n], 0))
                if n > 1:
                    views.append(Example(r.turns[max(0, n - CONTEXT_TURNS) : n], 0))
            probs = [head(*conversation_batches([v], states, 1)[0][:3]).softmax(-1)[0, 1:] for v in views]
            out.append(torch.stack(probs).max(0).values.numpy())
    return np.array(out)


def cross_validate(enc: Encoder, records: list[Record], lower, args) -> np.ndarray:
    """[len(records), num_categories] out-of-fold scores (each record scored by a head that
    never saw it)."""
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    folds = [order[i :: args.cv] for i in range(args.cv)]
    scores = np.zeros((len(records), len(CLASSES) - 1))
    for fold in folds:
        held = set(fold)
        head, states = fit(enc, [records[i] for i in order if i not in held], lower, args)
        scores[fold] = conversation_scores(head, [records[i] for i in fold], states)
    return scores


CV_GROUPS = {
    "harmful": lambda r: r.is_harmful and r.kind == "prompt",
    "sensitive": lambda r: not r.is_harmful and r.kind == "prompt" and r.topic != "chitchat",
    "chitchat": lambda r: r.kind == "prompt" and r.topic == "chitchat",
    "mt harmful": lambda r: r.is_harmful and r.is_multi_turn,
    "mt benign": lambda r: not r.is_harmful and r.is_multi_turn,
    "answers harmful": lambda r: r.is_harmful and r.kind == "response",
    "answers benign": lambda r: not r.is_harmful and r.kind == "response",
}


def report_cv(records: list[Record], scores: np.ndarray, min_recall: float) -> None:
    """Rates at several global thresholds, then per-category thresholds: for each category
    the highest one (of a coarse grid) that still blocks `min_recall` of its harmful prompts
    (rules included); these go into config.toml `[safety] thresholds`."""
    rules = RuleSet.merged({}, {}, builtin=True)  # the gate's other layer, for the combined rate
    by_rules = np.array([r.kind == "prompt" and rules.first_match("\n\n".join(r.turns)) is not None for r in records])

    def line(thresholds: np.ndarray) -> str:
        blocked = (scores >= thresholds).any(1) | by_rules
        return "  ".join(
            f"{name} {np.mean(blocked[[pick(r) for r in records]]):6.1%}" for name, pick in CV_GROUPS.items()
        )

    for t in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        print(f"cv blocked (rules or classifier >= {t:.1f}): {line(np.full(scores.shape[1], t))}", flush=True)
    chosen = []
    for c, category in enumerate(CLASSES[1:]):
        mine = np.array([r.label == category and r.kind == "prompt" for r in records])
        ok = [t for t in np.arange(0.3, 0.96, 0.05) if np.mean((scores[mine, c] >= t) | by_rules[mine]) >= min_recall]
        chosen.append(round(float(ok[-1]), 2) if ok else 0.3)
    print(
        f"cv per-category thresholds (recall >= {min_recall:.0%} each): "
        + ", ".join(f"{c} = {t}" for c, t in zip(CLASSES[1:], chosen, strict=True))
    )
    print(f"cv blocked with those thresholds: {line(np.array(chosen))}", flush=True)


def training_settings(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The arguments that shape the trained file (not where it goes or what is reported)."""
    return sorted((k, v) for k, v in vars(args).items() if k not in ("out", "cv", "cv_scores", "min_recall", "threads"))


def save(enc: Encoder, head: TorchHead, path: Path, data_sha256: str, args) -> None:
    p = {k: v.detach().numpy().astype(np.float32) for k, v in head.state_dict().items()}
    adapter = {}
    for key, (a, b) in enc.lora.items():  # the scale is folded into B
        adapter[f"adapter.{key}.A"] = a.detach().numpy().astype(np.float32)
        adapter[f"adapter.{key}.B"] = (b.detach() * enc.scale).numpy().astype(np.float32)
    np.savez_compressed(
        path,
        format=np.array(HEAD_FORMAT),
        classes=np.array(CLASSES),
        queries=p["queries"],
        last_bias=p["last_bias"],
        w1=p["fc1.weight"].T.copy(),
        b1=p["fc1.bias"],
        w2=p["fc2.weight"].T.copy(),
        b2=p["fc2.bias"],
        max_tokens=np.array(MAX_TOKENS),
        encoder_layers=np.array(enc.shape.num_layers),
        context_turns=np.array(CONTEXT_TURNS),
        train_sha256=np.array(data_sha256),
        hyperparameters=np.array(repr(training_settings(args))),
        **adapter,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR / "classifier.npz")
    ap.add_argument("--adapter-layers", type=int, default=3, help="top encoder layers given an adapter (0: none)")
    ap.add_argument(
        "--encoder-layers", type=int, default=0, help="read the output of the encoder's first N layers (0: all 6)"
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--adapter-epochs", type=int, default=8)
    ap.add_argument("--adapter-lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20, help="stage 2 (context head) epochs")
    ap.add_argument("--context-lr", type=float, default=1e-3)
    ap.add_argument(
        "--context-params",
        choices=("all", "pooling"),
        default="all",
        help="stage 2 trains the whole head, or only its pooling queries",
    )
    ap.add_argument(
        "--prefixed",
        type=int,
        default=0,
        help="copies of each single prompt after 1-3 benign prompts, as a conversation",
    )
    ap.add_argument("--queries", type=int, default=4, help="attention-pooling queries (0: mean only)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--average", type=int, default=1, help="1: average the weights over the last half of each stage")
    ap.add_argument(
        "--benign-openings",
        type=int,
        default=1,
        help="1: a harmful conversation's turns before its last one are a benign example",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=5e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cv", type=int, default=0, help="report K-fold cross-validation on train first")
    ap.add_argument("--cv-scores", type=Path, default=None, help="also save the out-of-fold scores (.npy)")
    ap.add_argument("--min-recall", type=float, default=0.97, help="per-category recall the suggested thresholds keep")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started_s = time.perf_counter()
    records = load_split("train")
    data_sha256 = hashlib.sha256((DATA_DIR / "train.jsonl").read_bytes()).hexdigest()
    enc = Encoder(args.adapter_layers, args.rank, args.alpha, args.encoder_layers)
    texts = {t for r in records for t in r.turns} | {text for text, _ in stage1_texts(records)}
    lower = enc.lower_states(sorted(texts))
    print(f"encoded {len(lower)} texts from {len(records)} records in {time.perf_counter() - started_s:.0f} s")
    if args.cv:
        scores = cross_validate(enc, records, lower, args)
        if args.cv_scores:
            np.save(args.cv_scores, scores)
        report_cv(records, scores, args.min_recall)
    head, _ = fit(enc, records, lower, args)
    save(enc, head, args.out, data_sha256, args)
    print(f"wrote {args.out} in {time.perf_counter() - started_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
