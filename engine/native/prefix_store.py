"""The prefix cache kept across restarts (engine.prefix_cache_dir).

At a clean stop the engine writes the most recently used blocks of its prefix cache (each
one's chained hash, its token ids and the K/V of every layer, up to
engine.prefix_cache_save_bytes) to one safetensors file per model folder; the next start reads
them back into free blocks of the pool as cached, evictable blocks, so a conversation or a long
system prompt is warm again after a restart or an upgrade of the server. The hashes carry the
per-organisation salt (sequence.root_hash), so a restored block serves only the tenant that
computed it, as before the restart.

The file records what made its K/V: the model's files (names, sizes, modification times),
dtype, quantization, block size and KV layout. A file written by anything else is ignored (and
replaced at the next stop); so is a file that cannot be read. A crash writes nothing: the cache
is only warmth, never state. Not kept: models that mix sliding and global layers (two KV
groups), and blocks that hold image tokens. Called from the step thread.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from engine.native.block_manager import BlockManager

if TYPE_CHECKING:
    from engine.native.llm_engine import LLMEngine

log = structlog.get_logger(__name__)

FORMAT = "1"
_HASH_BYTES = 16


def file_for(directory: str | Path, engine: LLMEngine, model_dir: Path) -> Path:
    """The file of one model folder served one way (its resolved path and the fingerprint's
    settings name it; changed model files replace it)."""
    setup = {k: v for k, v in fingerprint(engine, model_dir).items() if k != "model_files"}
    name = hashlib.blake2b(f"{model_dir.resolve()}\n{sorted(setup.items())}".encode(), digest_size=8).hexdigest()
    return Path(directory) / f"{name}.safetensors"


def fingerprint(engine: LLMEngine, model_dir: Path) -> dict[str, str]:
    """What the K/V depend on; a file with any other fingerprint is not read."""
    files = hashlib.blake2b(digest_size=16)
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".safetensors", ".json", ".bin"):
            stat = path.stat()
            files.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    runner, args = engine.runner, engine.runner.args
    return {
        "format": FORMAT,
        "model_files": files.hexdigest(),
        "dtype": str(runner.dtype),
        "quantization": runner.quantization.value,
        "block_size": str(engine.block_manager.block_size),
        "kv_layout": f"{args.num_layers}x{args.num_kv_heads}x{args.head_dim}",
    }


def _pool_blocks(engine: LLMEngine) -> torch.Tensor:
    """The KV pool as [layers, 2 (K, V), blocks, block elements] (a scratch block included)."""
    args, bm = engine.runner.args, engine.block_manager
    block_numel = bm.block_size * args.num_kv_heads * args.head_dim
    pool = engine.runner.kv_pool
    return pool.view(args.num_layers, 2, pool.numel() // (args.num_layers * 2 * block_numel), block_numel)


def _keepable(engine: LLMEngine) -> BlockManager | None:
    bm = engine.block_manager
    if not isinstance(bm, BlockManager) or not bm.enable_prefix_caching:
        return None  # a model with two KV groups (hybrid_blocks.py), or no prefix cache at all
    return bm


def save(engine: LLMEngine, model_dir: Path, path: Path, max_bytes: int) -> int:
    """Write the most recently used cached blocks that fit in `max_bytes`; returns how many.
    Written to a temporary file and renamed, so a stop cut short leaves the old file whole."""
    bm = _keepable(engine)
    if bm is None:
        return 0
    pool = _pool_blocks(engine)
    block_bytes = pool.shape[0] * 2 * pool.shape[3] * pool.element_size()
    blocks = [b for b in bm.recent_cached_blocks() if all(isinstance(t, int) for t in b.token_ids or ())]
    blocks = blocks[: max(max_bytes, 0) // block_bytes][::-1]  # oldest first: restored in this order
    if not blocks:
        return 0
    from safetensors.torch import save_file

    ids = torch.tensor([b.block_id for b in blocks], device=pool.device)
    tensors = {
        "kv": pool.index_select(2, ids).cpu().contiguous(),
        "hashes": torch.frombuffer(bytearray(b"".join(b.hash or b"" for b in blocks)), dtype=torch.uint8).view(
            len(blocks), _HASH_BYTES
        ),
        "token_ids": torch.tensor([list(b.token_ids or ()) for b in blocks], dtype=torch.int64),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=fingerprint(engine, model_dir))
    os.chmod(tmp, 0o600)  # it holds what the prompts held: the server's user only
    os.replace(tmp, path)
    return len(blocks)


def restore(engine: LLMEngine, model_dir: Path, path: Path) -> int:
    """Read a saved file back into free blocks; returns how many blocks were restored (0 when
    there is no file, or it is another model's or configuration's, or it cannot be read)."""
    bm = _keepable(engine)
    if bm is None or not path.is_file():
        return 0
    from safetensors import safe_open

    expected = fingerprint(engine, model_dir)
    try:
        with safe_open(str(path), framework="pt") as f:
            if f.metadata() != expected:
                log.info("prefix_cache_file_not_used", path=str(path), reason="written for another model or setup")
                return 0
            kv, hashes, token_ids = f.get_tensor("kv"), f.get_tensor("hashes"), f.get_tensor("token_ids")
    except Exception as exc:  # a truncated or foreign file: start cold, never fail the start
        log.warning("prefix_cache_file_unreadable", path=str(path), error=str(exc))
        return 0
    pool = _pool_blocks(engine)
    num = kv.shape[2] if kv.dim() == 4 else -1
    if (
        num < 0
        or kv.shape[:2] != pool.shape[:2]
        or kv.shape[3] != pool.shape[3]
        or kv.dtype != pool.dtype
        or tuple(hashes.shape) != (num, _HASH_BYTES)
        or tuple(token_ids.shape) != (num, bm.block_size)
    ):
        log.warning("prefix_cache_file_unreadable", path=str(path), error="tensor shapes do not match the pool")
        return 0
    rows, block_ids = [], []
    num_fresh = sum(1 for b in bm.free_block_ids if bm.blocks[b].hash is None)  # all of them at a start
    for i in range(max(0, num - num_fresh), num):  # the most recent ones, if not all fit
        block_id = bm.restore_cached_block(bytes(hashes[i].tolist()), tuple(token_ids[i].tolist()))
        if block_id is not None:
            rows.append(i)
            block_ids.append(block_id)
    if block_ids:
        source = kv.index_select(2, torch.tensor(rows)).to(pool.device)
        pool.index_copy_(2, torch.tensor(block_ids, device=pool.device), source)
    return len(block_ids)
