"""One entry point that rebuilds the demo models from scratch: data from the Debian packages,
the shared tokenizer, both models, their held-out evaluation and model cards.
    python -m scripts.demo_model.build --out models
Generated data and logs go under --build-dir (gitignored); only --out holds committed files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import structlog
import torch
from tokenizers import Tokenizer

from scripts.demo_model import card, dataset, sources, train
from scripts.demo_model.tokenizer import (
    IM_END,
    PAD,
    conversation_texts,
    encode_conversation,
    save_tokenizer_files,
    train_tokenizer,
)

log = structlog.get_logger(__name__)

SEED = 1234
VOCAB_SIZE = 4096
NUM_IN_TRAINING_EVAL = 256  # held-out conversations scored during training (the curve)
NUM_REPO_HELDOUT = 40  # small held-out sample committed as models/heldout.jsonl for tests


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, default=Path("models"), help="where model folders go")
    parser.add_argument("--build-dir", type=Path, default=Path("build/demo_model"), help="data, logs")
    parser.add_argument("--models", nargs="+", default=list(train.SPECS), choices=list(train.SPECS))
    parser.add_argument("--max-steps", type=int, default=None, help="override, for trial runs only")
    parser.add_argument("--cards-only", action="store_true", help="re-evaluate and rewrite cards")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="train this many models at once, one process and one thread each (same weights as one at a time)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)  # reproducible reductions; a shared 2-core machine
    data_dir = args.build_dir / "data"
    if not args.cards_only:
        build_data(data_dir, args.out)
        specs = [train.SPECS[name] for name in args.models]
        if args.max_steps is not None:
            specs = [dataclasses.replace(spec, max_steps=args.max_steps) for spec in specs]
        context = multiprocessing.get_context("spawn")  # a fresh torch per worker, no forked state
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
            for future in [pool.submit(train_one, spec, args.out, args.build_dir) for spec in specs]:
                future.result()
    card.write_cards(args.out, args.build_dir, dataset.read_jsonl(data_dir / "heldout.jsonl"))


def build_data(data_dir: Path, out: Path) -> None:
    """train/heldout JSON lines and the tokenizer under the build dir; models/heldout.jsonl."""
    senses, fortunes = sources.read_senses(), sources.read_fortunes()
    splits = dataset.build_conversations(senses, fortunes, SEED)
    dataset.write_jsonl(data_dir / "train.jsonl", splits[dataset.Split.TRAIN])
    dataset.write_jsonl(data_dir / "heldout.jsonl", splits[dataset.Split.HELDOUT])
    dataset.write_jsonl(out / "heldout.jsonl", repo_heldout(splits[dataset.Split.HELDOUT]))
    stats = {
        "num_words": sum(dataset.count_definitions(c) for c in splits.values()),
        "num_fortunes": len(fortunes),
        **{f"num_{split.value}_conversations": len(c) for split, c in splits.items()},
    }
    (data_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    log.info("data", **stats)
    tokenizer = train_tokenizer(conversation_texts(splits[dataset.Split.TRAIN]), VOCAB_SIZE)
    save_tokenizer_files(tokenizer, data_dir.parent / "tokenizer", train.MINI.seq_len)


def repo_heldout(heldout: list[dataset.Conversation]) -> list[dataset.Conversation]:
    """Single-turn held-out chats without system prompt, mostly definitions: small enough for
    a fast test, and the questions a newcomer would try first."""
    single = [c for c in heldout if len(c.messages) == 2]
    picked = [c for c in single if c.source == "definition"][: NUM_REPO_HELDOUT * 3 // 4]
    others = [c for c in single if c.source != "definition"]
    return picked + random.Random(SEED).sample(others, NUM_REPO_HELDOUT - len(picked))


def train_one(spec: train.ModelSpec, out: Path, build_dir: Path) -> None:
    """Train one model from the files build_data wrote; runs in a worker process."""
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)  # deterministic reductions, and one core per model
    tokenizer = Tokenizer.from_file(str(build_dir / "tokenizer" / "tokenizer.json"))
    ids = train.SpecialIds(tokenizer.token_to_id(IM_END), tokenizer.token_to_id(PAD))
    config = train.llama_config(spec, tokenizer.get_vocab_size(), ids)
    train_set = dataset.read_jsonl(build_dir / "data" / "train.jsonl")
    eval_set = dataset.read_jsonl(build_dir / "data" / "heldout.jsonl")[:NUM_IN_TRAINING_EVAL]
    encoded_train = [encode_conversation(tokenizer, c) for c in train_set]
    encoded_eval = [encode_conversation(tokenizer, c) for c in eval_set]
    model, result = train.train(spec, config, (encoded_train, encoded_eval), SEED)
    model_dir = out / spec.name
    train.save_model(model, ids, model_dir)
    save_tokenizer_files(tokenizer, model_dir, spec.seq_len)
    run_dir = build_dir / spec.name
    train.write_log(run_dir / "train_log.jsonl", result)
    summary = {k: v for k, v in dataclasses.asdict(result).items() if k != "log_rows"}
    summary["spec"] = dataclasses.asdict(spec)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log.info("trained", model=spec.name, **{k: v for k, v in summary.items() if k != "spec"})


if __name__ == "__main__":
    main()
