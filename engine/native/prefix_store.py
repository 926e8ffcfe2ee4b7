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
is only warmth, never state. A model that mixes sliding and global layers keeps both KV
groups' blocks (each group's most recent). Not kept: blocks that hold image tokens. Called from
the step thread.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from engine.native.block_manager import BlockManager
from engine.native.hybrid_blocks import HybridBlockManager
from engine.native.state_slots import StateSlotManager

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
            try:
                stat = path.stat()
            except FileNotFoundError:  # a dangling link (a Hugging Face cache whose blob was deleted)
                files.update(f"{path.name}:missing\n".encode())
                continue
            files.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    runner, args = engine.runner, engine.runner.args
    return {
        "format": FORMAT,
        "model_files": files.hexdigest(),
        "dtype": str(runner.dtype),
        "quantization": runner.quantization.value,
        "block_size": str(_groups(engine)[0].block_size),
        "kv_layout": f"{args.num_layers}x{args.num_kv_heads}x{args.head_dim}",
        "kv_groups": "".join(str(g) for g in runner.layer_groups),
        # Prompts' K/V computed on AMX in bf16 (engine.amx_prefill) are not the fp32 path's.
        **({"amx_prefill": "on"} if runner.amx_prefill else {}),
    }


def _groups(engine: LLMEngine) -> tuple[BlockManager, ...]:
    """The block manager of each KV group (two for a model that mixes sliding and global layers)."""
    bm = engine.block_manager
    return bm.groups if isinstance(bm, (HybridBlockManager, StateSlotManager)) else (bm,)


def save(engine: LLMEngine, model_dir: Path, path: Path, max_bytes: int) -> int:
    """Write the most recently used cached blocks that fit in `max_bytes` (the same number from
    each KV group); returns how many (of the first group). Written to a temporary file and
    renamed, so a stop cut short leaves the old file whole."""
    groups = _groups(engine)
    if not groups[0].enable_prefix_caching:
        return 0
    pools = engine.runner.kv_group_pools
    bytes_per_block = sum(pool.shape[0] * 2 * pool.shape[3] * pool.element_size() for pool in pools)
    num = max(max_bytes, 0) // bytes_per_block
    tensors: dict[str, torch.Tensor] = {}
    for g, (bm, pool) in enumerate(zip(groups, pools, strict=True)):
        blocks = [b for b in bm.recent_cached_blocks() if all(isinstance(t, int) for t in b.token_ids or ())]
        blocks = blocks[:num][::-1]  # oldest first: restored in this order
        if g == 0 and not blocks:
            return 0  # nothing worth a file (an existing one stays)
        ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=pool.device)
        tensors[f"kv.{g}"] = pool.index_select(2, ids).cpu().contiguous()
        hashes = list(b"".join(b.hash or b"" for b in blocks))
        tensors[f"hashes.{g}"] = torch.tensor(hashes, dtype=torch.uint8).view(len(blocks), _HASH_BYTES)
        token_ids = [t for b in blocks for t in b.token_ids or ()]
        tensors[f"token_ids.{g}"] = torch.tensor(token_ids, dtype=torch.int64).view(len(blocks), bm.block_size)
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    metadata = {**fingerprint(engine, model_dir), _DIGEST_KEY: _digest(tensors)}
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o600)  # it holds what the prompts held: the server's user only
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # on disk before the rename: a power cut leaves the old file or the new one
    os.replace(tmp, path)
    return tensors["hashes.0"].shape[0]


_DIGEST_KEY = "blake2b"  # of every tensor's bytes, in name order: a file changed on disk is not restored


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def restore(engine: LLMEngine, model_dir: Path, path: Path) -> int:
    """Read a saved file back into free blocks; returns how many blocks (of the first KV group)
    were restored: 0 when there is no file, or it is another model's or setup's, or it cannot
    be read."""
    groups = _groups(engine)
    if not groups[0].enable_prefix_caching or not path.is_file():
        return 0
    from safetensors import safe_open

    expected = fingerprint(engine, model_dir)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            digest = metadata.pop(_DIGEST_KEY, None)
            if metadata != expected:
                log.info("prefix_cache_file_not_used", path=str(path), reason="written for another model or setup")
                return 0
            names = [f"{kind}.{g}" for g in range(len(groups)) for kind in ("kv", "hashes", "token_ids")]
            loaded = {name: f.get_tensor(name) for name in names}
    except Exception as exc:  # a truncated or foreign file: start cold, never fail the start
        log.warning("prefix_cache_file_unreadable", path=str(path), error=str(exc))
        return 0
    if digest != _digest(loaded):  # changed on disk since it was written (or an older file without one)
        log.warning("prefix_cache_file_unreadable", path=str(path), error="its contents do not match their digest")
        return 0
    saved = [(loaded[f"kv.{g}"], loaded[f"hashes.{g}"], loaded[f"token_ids.{g}"]) for g in range(len(groups))]
    pools = engine.runner.kv_group_pools
    if not all(_fits(*t, pool, bm) for t, pool, bm in zip(saved, pools, groups, strict=True)):
        log.warning("prefix_cache_file_unreadable", path=str(path), error="tensor shapes do not match the pool")
        return 0
    restored = [_restore_group(bm, pool, *t) for bm, pool, t in zip(groups, pools, saved, strict=True)]
    return restored[0]


def _fits(
    kv: torch.Tensor, hashes: torch.Tensor, token_ids: torch.Tensor, pool: torch.Tensor, bm: BlockManager
) -> bool:
    num = kv.shape[2] if kv.dim() == 4 else -1
    return (
        num >= 0
        and kv.shape[:2] == pool.shape[:2]
        and kv.shape[3] == pool.shape[3]
        and kv.dtype == pool.dtype
        and tuple(hashes.shape) == (num, _HASH_BYTES)
        and tuple(token_ids.shape) == (num, bm.block_size)
    )


def _restore_group(
    bm: BlockManager, pool: torch.Tensor, kv: torch.Tensor, hashes: torch.Tensor, token_ids: torch.Tensor
) -> int:
    num = kv.shape[2]
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


def folder_problem(directory: Path) -> str | None:
    """Why a cache file could not be written in `directory` at the stop, or None: checked at start
    (api/startup.py) without creating anything; the folder itself is made at the first save."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):  # EROFS on a read-only mount, even for root
        return f"{existing} is not writable"
    return None
