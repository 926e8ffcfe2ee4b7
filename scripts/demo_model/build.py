"""One entry point that rebuilds the demo models from scratch: data from the Debian packages,
the shared tokenizer, both models, their held-out evaluation and model cards.
    python -m scripts.demo_model.build --out models
Generated data and logs go under --build-dir (gitignored); only --out holds committed files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import structlog
import torch
from tokenizers import Tokenizer

from scripts.demo_model import card, dataset, evaluate, sources, train
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
NUM_REPO_KNOWN = 40  # known words (with their first sense) committed as models/known_words.jsonl
NUM_UNFAMILIAR_PROBES = 100  # held-out words of each unfamiliar band asked after training
_FREQUENCY_LIST_LENGTH = 60_000  # read this far down wordfreq's list (rare words lie beyond)


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, default=Path("models"), help="where model folders go")
    parser.add_argument("--build-dir", type=Path, default=Path("build/demo_model"), help="data, logs")
    parser.add_argument("--models", nargs="+", default=list(train.SPECS), choices=list(train.SPECS))
    parser.add_argument("--max-steps", type=int, default=None, help="override, for trial runs only")
    parser.add_argument("--cards-only", action="store_true", help="re-evaluate and rewrite cards")
    parser.add_argument(
        "--fresh", action="store_true", help="ignore checkpoints in the build dir (default: resume from them)"
    )
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
            jobs = [pool.submit(train_one, spec, args.out, args.build_dir, args.fresh) for spec in specs]
            for future in jobs:
                future.result()
    card.write_cards(args.out, args.build_dir, dataset.read_jsonl(data_dir / "heldout.jsonl"))


def build_data(data_dir: Path, out: Path) -> None:
    """train/heldout JSON lines and the tokenizer under the build dir; models/heldout.jsonl."""
    senses, fortunes = sources.read_senses(), sources.read_fortunes()
    frequent = sources.read_frequent_words(_FREQUENCY_LIST_LENGTH)
    splits = dataset.build_conversations(senses, fortunes, frequent, SEED)
    known, _ = dataset.choose_words(senses, frequent, random.Random(SEED))
    probes = dataset.unfamiliar_probes(dataset.first_senses(senses), frequent, NUM_UNFAMILIAR_PROBES, SEED)
    (data_dir / "unfamiliar_probes.json").parent.mkdir(parents=True, exist_ok=True)
    (data_dir / "unfamiliar_probes.json").write_text(json.dumps(probes, indent=1) + "\n", encoding="utf-8")
    rows = [{"lemma": s.lemma, "pos": s.pos.value, "definition": s.definition} for s in known]
    (data_dir / "known_words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    repo_known = random.Random(SEED + 1).sample(rows, NUM_REPO_KNOWN)  # not the carded sample
    (out / "known_words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in repo_known), encoding="utf-8")
    dataset.write_jsonl(data_dir / "train.jsonl", splits[dataset.Split.TRAIN])
    dataset.write_jsonl(data_dir / "heldout.jsonl", splits[dataset.Split.HELDOUT])
    dataset.write_jsonl(out / "heldout.jsonl", repo_heldout(splits[dataset.Split.HELDOUT]))
    stats = {
        "num_words": len(known),
        "num_definitions": sum(dataset.count_definitions(c) for c in splits.values()),
        "num_fortunes": min(len(fortunes), dataset.NUM_FORTUNES),
        **{f"num_{split.value}_conversations": len(c) for split, c in splits.items()},
    }
    (data_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    log.info("data", **stats)
    tokenizer = train_tokenizer(conversation_texts(splits[dataset.Split.TRAIN]), VOCAB_SIZE)
    save_tokenizer_files(tokenizer, data_dir.parent / "tokenizer", train.MINI.seq_len, served=False)


def repo_heldout(heldout: list[dataset.Conversation]) -> list[dataset.Conversation]:
    """Single-turn held-out chats without system prompt, mostly questions about words the
    models were not taught: small enough for a fast test."""
    single = [c for c in heldout if len(c.messages) == 2]
    picked = [c for c in single if c.source == "unknown_word"][: NUM_REPO_HELDOUT * 3 // 4]
    others = [c for c in single if c.source != "unknown_word"]
    return picked + random.Random(SEED).sample(others, NUM_REPO_HELDOUT - len(picked))


def train_one(spec: train.ModelSpec, out: Path, build_dir: Path, fresh: bool = False) -> None:
    """Train one model from the files build_data wrote (resuming from its checkpoint unless
    fresh), then score the words it claims to know; runs in a worker process."""
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)  # deterministic reductions, and one core per model
    tokenizer_path = build_dir / "tokenizer" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = train.SpecialIds(tokenizer.token_to_id(IM_END), tokenizer.token_to_id(PAD))
    config = train.llama_config(spec, tokenizer.get_vocab_size(), ids)
    train_path = build_dir / "data" / "train.jsonl"
    train_set = dataset.read_jsonl(train_path)
    eval_set = dataset.read_jsonl(build_dir / "data" / "heldout.jsonl")[:NUM_IN_TRAINING_EVAL]
    encoded_train = [encode_conversation(tokenizer, c) for c in train_set]
    encoded_eval = [encode_conversation(tokenizer, c) for c in eval_set]
    run_dir = build_dir / spec.name
    fingerprint = hashlib.sha256(train_path.read_bytes() + tokenizer_path.read_bytes()).hexdigest()
    checkpoint = train.Checkpointing(run_dir / "checkpoint.pt", fingerprint)
    if fresh:
        checkpoint.path.unlink(missing_ok=True)
    model, result = train.train(spec, config, (encoded_train, encoded_eval), SEED, checkpoint)
    model_dir = out / spec.name
    train.save_model(model, ids, model_dir)
    save_tokenizer_files(tokenizer, model_dir, spec.seq_len)
    train.write_log(run_dir / "train_log.jsonl", result)
    summary = {k: v for k, v in dataclasses.asdict(result).items() if k != "log_rows"}
    summary["spec"] = dataclasses.asdict(spec)
    summary["cpu"] = describe_cpu()
    summary |= score_words(model_dir, build_dir / "data")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log.info("trained", model=spec.name, **{k: v for k, v in summary.items() if k != "spec"})


def describe_cpu() -> str:
    """The CPU model and whether it trained with bfloat16 autocast (what the weights depend on)."""
    model_name = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model_name = line.split(":", 1)[1].strip()
            break
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"{model_name}, {'bfloat16 autocast' if bf16 else 'fp32, no bfloat16 support'}"


def score_words(model_dir: Path, data_dir: Path) -> dict:
    """Greedy answers (from the saved 16-bit weights) to "What does X mean?": for a seeded
    sample of the known words, how many carry the first sense; for held-out words of each
    unfamiliar band (dataset.unfamiliar_probes), how many get "I don't know the word". Printed
    and carded."""
    known = evaluate.read_known_words(data_dir / "known_words.jsonl")
    probes = json.loads((data_dir / "unfamiliar_probes.json").read_text(encoding="utf-8"))
    model, hf_tokenizer = evaluate.load_for_eval(model_dir)
    score = evaluate.known_word_score(model, hf_tokenizer, evaluate.scored_sample(known, SEED))
    print(
        f"{model_dir.name}: {score.num_right}/{score.num_words} known words answered with their "
        f"first sense ({score.share:.1%}; {len(known)} known words)",
        flush=True,
    )
    result = {"known_words": {"num_known": len(known), **_score_row(score)}, "unfamiliar_words": {}}
    for band, words in probes.items():
        score = evaluate.unknown_word_score(model, hf_tokenizer, words)
        print(f"{model_dir.name}: {score.num_right}/{score.num_words} {band} words (never taught) admitted", flush=True)
        result["unfamiliar_words"][band] = _score_row(score)
    return result


def _score_row(score: evaluate.WordScore) -> dict:
    return {"num_scored": score.num_words, "num_right": score.num_right, "misses": [list(m) for m in score.misses[:20]]}


if __name__ == "__main__":
    main()
