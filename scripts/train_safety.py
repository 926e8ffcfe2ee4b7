"""Train the safety classifier head on safety/train.jsonl and write safety/classifier.npz.

The encoder (all-MiniLM-L6-v2) stays frozen; only the head is trained, in torch, with the
same math the gate runs in numpy (attention pooling with a newest-turn bonus, mean, MLP).
`--cv K` first reports K-fold cross-validated rates on the train split. The held-out split
is never read here. Usage: python -m scripts.train_safety [--epochs N] [--cv 5] [--out PATH]
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
from gateway.safety.embedder import MiniLmEmbedder

MAX_TOKENS = 128  # encoder window the head is trained with (the gate reads it from the file)
MAX_WINDOWS = 4
CONTEXT_TURNS = 4


class TorchHead(torch.nn.Module):
    """Mirror of gateway.safety.classifier: pooling over [batch, tokens, dim] states."""

    def __init__(self, dim: int, num_queries: int, hidden: int, dropout: float):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(num_queries, dim) * 0.05)
        self.last_bias = torch.nn.Parameter(torch.zeros(num_queries))
        self.drop = torch.nn.Dropout(dropout)
        self.fc1 = torch.nn.Linear((num_queries + 1) * dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, len(CLASSES))

    def forward(self, states: torch.Tensor, is_last: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # states [B, N, D]; is_last, mask [B, N]
        logits = states @ self.queries.T / states.shape[-1] ** 0.5 + is_last[..., None] * self.last_bias
        attn = logits.masked_fill(~mask[..., None], float("-inf")).softmax(dim=1)  # [B, N, Q]
        attended = torch.einsum("bnq,bnd->bqd", attn, states).flatten(1)
        mean = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        x = self.drop(torch.cat([attended, mean], dim=1))
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x), approximate="tanh")))


def encode_all(embedder: MiniLmEmbedder, texts: list[str]) -> dict[str, np.ndarray]:
    states: dict[str, np.ndarray] = {}
    for i in range(0, len(texts), 32):
        batch = texts[i : i + 32]
        for text, s in zip(batch, embedder.encode(batch, max_windows=MAX_WINDOWS)):
            states[text] = s
    return states


def make_batches(examples: list[Example], states: dict[str, np.ndarray], batch_size: int):
    """Padded tensors, built once; examples of similar length share a batch."""
    def tokens(ex: Example) -> list[np.ndarray]:
        return [states[t] for t in ex.turns[-CONTEXT_TURNS:]]

    ordered = sorted(examples, key=lambda ex: sum(len(s) for s in tokens(ex)))
    batches = []
    for i in range(0, len(ordered), batch_size):
        chunk = ordered[i : i + batch_size]
        width = max(sum(len(s) for s in tokens(ex)) for ex in chunk)
        x = np.zeros((len(chunk), width, 384), np.float32)
        last = np.zeros((len(chunk), width), np.float32)
        mask = np.zeros((len(chunk), width), bool)
        for row, ex in enumerate(chunk):
            parts = tokens(ex)
            seq = np.concatenate(parts)
            x[row, : len(seq)] = seq
            last[row, len(seq) - len(parts[-1]) : len(seq)] = 1.0
            mask[row, : len(seq)] = True
        y = torch.tensor([ex.label for ex in chunk])
        batches.append((torch.from_numpy(x), torch.from_numpy(last), torch.from_numpy(mask), y))
    return batches


def fit(examples: list[Example], states: dict[str, np.ndarray], args: argparse.Namespace) -> TorchHead:
    torch.manual_seed(args.seed)
    head = TorchHead(384, args.queries, args.hidden, args.dropout)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    batches = make_batches(examples, states, batch_size=32)
    rng = random.Random(args.seed)
    head.train()
    for _ in range(args.epochs):
        rng.shuffle(batches)
        for x, last, mask, y in batches:
            loss = torch.nn.functional.cross_entropy(head(x, last, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval()


def conversation_scores(head: TorchHead, records: list[Record], states: dict[str, np.ndarray]) -> np.ndarray:
    """[len(records), num_categories], as the gate scores: max(newest turn alone, context)."""
    out = []
    with torch.no_grad():
        for r in records:
            views = [Example(r.turns[-1:], 0)]
            if r.is_multi_turn:
                views.append(Example(r.turns[-CONTEXT_TURNS:], 0))
            probs = [head(*make_batches([v], states, 1)[0][:3]).softmax(-1)[0, 1:] for v in views]
            out.append(torch.stack(probs).max(0).values.numpy())
    return np.array(out)


def cross_validate(records: list[Record], states: dict[str, np.ndarray], args: argparse.Namespace) -> None:
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    folds = [order[i :: args.cv] for i in range(args.cv)]
    scores = np.zeros((len(records), len(CLASSES) - 1))
    for fold in folds:
        held = set(fold)
        train = [records[i] for i in order if i not in held]
        head = fit(training_examples(train, seed=args.seed), states, args)
        scores[fold] = conversation_scores(head, [records[i] for i in fold], states)
    harmful = np.array([r.is_harmful for r in records])
    prompt = np.array([r.kind == "prompt" for r in records])
    multi = np.array([r.is_multi_turn for r in records])
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):
        blocked = scores.max(1) >= threshold
        print(
            f"cv threshold {threshold:.1f}: harmful blocked {blocked[harmful & prompt].mean():6.1%}"
            f"  benign refused {blocked[~harmful & prompt].mean():6.1%}"
            f"  multi-turn blocked {blocked[harmful & multi].mean():6.1%} refused {blocked[~harmful & multi].mean():6.1%}"
            f"  answers blocked {blocked[harmful & ~prompt].mean():6.1%} refused {blocked[~harmful & ~prompt].mean():6.1%}"
        )


def save(head: TorchHead, path: Path, data_sha256: str, args: argparse.Namespace) -> None:
    p = {k: v.detach().numpy().astype(np.float32) for k, v in head.state_dict().items()}
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
        context_turns=np.array(CONTEXT_TURNS),
        train_sha256=np.array(data_sha256),
        hyperparameters=np.array(repr(sorted(vars(args).items()))),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR / "classifier.npz")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--queries", type=int, default=4, help="attention-pooling queries (0: mean only)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cv", type=int, default=0, help="report K-fold cross-validation on train first")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    started_s = time.perf_counter()
    records = load_split("train")
    data_sha256 = hashlib.sha256((DATA_DIR / "train.jsonl").read_bytes()).hexdigest()
    embedder = MiniLmEmbedder(dtype="float32", max_tokens=MAX_TOKENS)
    states = encode_all(embedder, sorted({t for r in records for t in r.turns}))
    print(f"encoded {len(states)} texts from {len(records)} train records in {time.perf_counter() - started_s:.0f} s")
    if args.cv:
        cross_validate(records, states, args)
    head = fit(training_examples(records, seed=args.seed), states, args)
    save(head, args.out, data_sha256, args)
    print(f"wrote {args.out} in {time.perf_counter() - started_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
