"""Trains one demo model: the two architectures, packing encoded conversations into fixed-length
rows, the seeded AdamW loop on CPU (bf16 autocast where the CPU has it), and saving the result
in Hugging Face layout with 16-bit safetensors. A fixed step count, never a time budget, so
the same seed gives the same weights on the same machine however busy it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from scripts.demo_model.evaluate import heldout_loss
from scripts.demo_model.tokenizer import IGNORE_INDEX, EncodedConversation

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_steps: int
    learning_rate: float
    decay_steps: int  # cosine decay horizon; steps past it stay at a tenth of the peak
    batch_size: int = 8
    seq_len: int = 512  # packed row length, also the context window written to config.json
    warmup_steps: int = 50


# The learning rate depends on the step alone (never on max_steps), so raising max_steps and
# resuming from the last checkpoint gives the same weights as a fresh run that long.
MINI = ModelSpec("demo-mini", 128, 4, 2, 1, 384, max_steps=1600, learning_rate=3e-3, decay_steps=1600)
FLAGSHIP = ModelSpec("demo-flagship", 192, 4, 3, 1, 512, max_steps=1600, learning_rate=3e-3, decay_steps=1600)
CHECKPOINT_EVERY = 50  # steps between checkpoints (model, optimizer, log) in the build dir
EVAL_EVERY = 100  # steps between held-out loss evaluations (the loss curve)
SPECS = {spec.name: spec for spec in (MINI, FLAGSHIP)}


@dataclass(frozen=True, slots=True)
class SpecialIds:
    eos_token_id: int
    pad_token_id: int


@dataclass(frozen=True, slots=True)
class TrainResult:
    num_parameters: int
    wall_time_s: float
    num_tokens_seen: int
    log_rows: tuple[dict, ...]  # {"step", "train_loss"} and {"step", "heldout_loss"} rows


def llama_config(spec: ModelSpec, vocab_size: int, ids: SpecialIds) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=ids.eos_token_id,
        pad_token_id=ids.pad_token_id,
    )


Row = tuple[list[int], list[int]]  # (input_ids, labels), both seq_len long


def pack_rows(encoded: list[EncodedConversation], seq_len: int, pad_id: int, rng: random.Random) -> list[Row]:
    """Shuffle, then fill rows of seq_len with whole conversations (next-fit), padding the end.
    Conversations in one row attend to each other; that teaches the model to ignore unrelated
    earlier turns, which a chat history needs anyway."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    rows: list[Row] = []
    ids: list[int] = []
    labels: list[int] = []
    for index in order:
        conversation = encoded[index]
        if len(ids) + len(conversation.input_ids) > seq_len:
            rows.append(_pad(ids, labels, seq_len, pad_id))
            ids, labels = [], []
        ids += conversation.input_ids
        labels += conversation.labels
    if ids:
        rows.append(_pad(ids, labels, seq_len, pad_id))
    return rows


def _pad(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> Row:
    num_pad = seq_len - len(ids)
    return ids + [pad_id] * num_pad, labels + [IGNORE_INDEX] * num_pad


def batches(
    encoded: list[EncodedConversation], spec: ModelSpec, pad_id: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless [batch_size, seq_len] (input_ids, labels) batches; a fresh packing every epoch."""
    rng = random.Random(seed)
    while True:
        rows = pack_rows(encoded, spec.seq_len, pad_id, rng)
        for start in range(0, len(rows) - spec.batch_size + 1, spec.batch_size):
            chunk = rows[start : start + spec.batch_size]
            yield torch.tensor([r[0] for r in chunk]), torch.tensor([r[1] for r in chunk])


def learning_rate_at(step: int, spec: ModelSpec) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.decay_steps - spec.warmup_steps))
    return spec.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _autocast() -> contextlib.AbstractContextManager:
    # bf16 matmuls roughly double CPU throughput where the CPU does bf16 natively; master
    # weights, optimizer state and the loss stay fp32.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(
    spec: ModelSpec,
    config: LlamaConfig,
    data: tuple[list[EncodedConversation], list[EncodedConversation]],
    seed: int,
    checkpoint: Checkpointing | None = None,
) -> tuple[LlamaForCausalLM, TrainResult]:
    """Train on data[0]; evaluate held-out loss on data[1] every EVAL_EVERY steps. With
    checkpoint, resume from its file when it was written for the same spec (max_steps aside)
    and data, and write it every CHECKPOINT_EVERY steps: the result is the same bit for bit."""
    train_set, heldout_set = data
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    start_step, rows, elapsed_s = 0, [], 0.0
    if checkpoint is not None:
        start_step, rows, elapsed_s = checkpoint.restore(spec, model, optimizer)
    batch_iter = batches(train_set, spec, config.pad_token_id, seed)
    for _ in range(start_step):  # the same batches as an uninterrupted run
        next(batch_iter)
    started = time.monotonic() - elapsed_s
    progress = tqdm(range(start_step, spec.max_steps), desc=spec.name, mininterval=5.0, ascii=True)
    for step in progress:
        loss = _train_step(model, optimizer, next(batch_iter), learning_rate_at(step, spec))
        rows.append({"step": step + 1, "train_loss": loss})
        progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == spec.max_steps:
            rows.append({"step": step + 1, "heldout_loss": heldout_loss(model, heldout_set)})
            log.info("heldout", model=spec.name, step=step + 1, loss=round(rows[-1]["heldout_loss"], 4))
        if checkpoint is not None and ((step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == spec.max_steps):
            checkpoint.save(spec, step + 1, model, optimizer, rows, time.monotonic() - started)
    num_params = sum(p.numel() for p in model.parameters())
    num_tokens = spec.max_steps * spec.batch_size * spec.seq_len
    return model, TrainResult(num_params, time.monotonic() - started, num_tokens, tuple(rows))


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """A training run's resumable state in one file. fingerprint names the data and tokenizer;
    a checkpoint of another spec (max_steps aside) or other data is ignored, never loaded."""

    path: Path
    fingerprint: str

    def _key(self, spec: ModelSpec) -> dict:
        return {**dataclasses.asdict(spec), "max_steps": None, "data": self.fingerprint}

    def restore(
        self, spec: ModelSpec, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer
    ) -> tuple[int, list[dict], float]:
        """(steps done, log rows, wall time so far); (0, [], 0.0) when there is nothing to resume."""
        if not self.path.is_file():
            return 0, [], 0.0
        state = torch.load(self.path, weights_only=False)
        if state["key"] != self._key(spec) or state["step"] > spec.max_steps:
            log.warning("checkpoint_ignored", path=str(self.path), reason="other spec, data or a longer run")
            return 0, [], 0.0
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        log.info("resumed", model=spec.name, step=state["step"])
        return state["step"], list(state["rows"]), state["elapsed_s"]

    def save(
        self,
        spec: ModelSpec,
        step: int,
        model: LlamaForCausalLM,
        optimizer: torch.optim.Optimizer,
        rows: list[dict],
        elapsed_s: float,
    ) -> None:
        state = {
            "key": self._key(spec),
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rows": rows,
            "elapsed_s": elapsed_s,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        torch.save(state, partial)
        partial.replace(self.path)  # a crash mid-write leaves the previous checkpoint


def _train_step(
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    lr: float,
) -> float:
    input_ids, labels = batch  # [batch_size, seq_len] each
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    with _autocast():
        loss = _loss(model, input_ids, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _loss(model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the labelled positions, as the model's own loss, but
    projecting to the vocabulary only where a label is (the output layer is the costliest
    part of these small models, and about 40% of positions carry no label)."""
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [batch, seq - 1, hidden]
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logits = model.lm_head(hidden[keep])  # [num_labelled, vocab]
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


# The sampling a request gets when it sets none (the server applies generation_config.json's
# defaults, as vLLM does; the UI sends none). At OpenAI's default, temperature 1, these small
# models misspell words and blend replies (measured: the cards, "Sampling defaults").
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.9}


def save_model(model: LlamaForCausalLM, ids: SpecialIds, model_dir: Path) -> None:
    """config.json, generation_config.json and bf16 model.safetensors (the engine upcasts)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids.eos_token_id],
        pad_token_id=ids.pad_token_id,
        bos_token_id=None,
        do_sample=True,
        **SAMPLING_DEFAULTS,
    )
    model.save_pretrained(model_dir, safe_serialization=True)


def write_log(path: Path, result: TrainResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in result.log_rows), encoding="utf-8")
