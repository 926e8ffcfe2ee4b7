"""The prefix cache kept across restarts (engine/native/prefix_store.py): blocks written by one
engine are read back by a fresh one over the same model and setup, hit by the same prompt (per
tenant salt), and give transformers' greedy output; anything else (another setup, changed model
files, a broken file, a model with two KV groups) starts cold instead of failing."""

from __future__ import annotations

import os

import pytest

from engine.native import prefix_store
from engine.native.loader import load_model_args
from engine.types import GenerationRequest, SamplingParams
from test_greedy_equality import BLOCK_SIZE, engine_for, run_with_arrivals

VARIANT = "tied-gqa-parameters"


def prompt_for(model_dir, n: int = 70) -> list[int]:
    vocab = load_model_args(model_dir).vocab_size
    return [(11 * i + 5) % vocab for i in range(n)]


def ask(engine, prompt: list[int], salt: str | None = "org-a", request_id: str = "r") -> list[int]:
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return run_with_arrivals(engine, [(0, GenerationRequest(request_id, tuple(prompt), sampling, cache_salt=salt))])[
        request_id
    ]


def test_a_fresh_engine_reads_the_saved_blocks_back_and_the_same_prompt_hits_them(tiny_models, tmp_path):
    model_dir = tiny_models.path(VARIANT)
    prompt = prompt_for(model_dir)
    first = engine_for(model_dir, num_blocks=24)
    assert ask(first, prompt) == tiny_models.greedy(VARIANT, prompt, 6, None)
    path = tmp_path / "cache.safetensors"
    num_saved = prefix_store.save(first, model_dir, path, 1 << 30)
    assert path.stat().st_mode & 0o777 == 0o600
    assert num_saved == (len(prompt) + 6 - 1) // BLOCK_SIZE  # every full computed block

    second = engine_for(model_dir, num_blocks=24)  # its pool starts as NaN: a block not restored would show
    assert prefix_store.restore(second, model_dir, path) == num_saved
    assert ask(second, prompt) == tiny_models.greedy(VARIANT, prompt, 6, None)
    stats = second.stats()
    assert stats.prefix_cache_hits == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the prompt's full blocks
    # Another tenant's identical prompt misses: the restored hashes carry the salt.
    hits = stats.prefix_cache_hits
    ask(second, prompt, salt="org-b", request_id="b")
    assert second.stats().prefix_cache_hits == hits


def test_the_byte_cap_keeps_the_most_recently_used_blocks(tiny_models, tmp_path):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    old, recent = prompt_for(model_dir, 40), list(reversed(prompt_for(model_dir, 40)))
    ask(engine, old, request_id="old")
    ask(engine, recent, request_id="recent")
    args = load_model_args(model_dir)
    block_bytes = args.num_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4
    path = tmp_path / "cache.safetensors"
    assert prefix_store.save(engine, model_dir, path, 2 * block_bytes + 1) == 2

    fresh = engine_for(model_dir, num_blocks=24)
    assert prefix_store.restore(fresh, model_dir, path) == 2
    ask(fresh, recent, request_id="again")
    assert fresh.stats().prefix_cache_hits == 2 * BLOCK_SIZE  # the recent prompt's two blocks


def test_a_file_from_other_model_files_or_a_broken_one_is_not_used(tiny_models, tmp_path):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    ask(engine, prompt_for(model_dir))
    path = tmp_path / "cache.safetensors"
    assert prefix_store.save(engine, model_dir, path, 1 << 30) > 0
    config = model_dir / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the model changed
    try:
        assert prefix_store.restore(engine_for(model_dir, num_blocks=24), model_dir, path) == 0
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prefix_store.restore(engine_for(model_dir, num_blocks=24), model_dir, path) > 0
    whole = path.read_bytes()
    garbled = bytearray(whole)
    garbled[-64:] = bytes(b ^ 0xFF for b in garbled[-64:])  # the header still valid, values changed
    path.write_bytes(bytes(garbled))
    fresh = engine_for(model_dir, num_blocks=24)
    assert prefix_store.restore(fresh, model_dir, path) == 0 and not fresh.block_manager.hash_to_block_id
    path.write_bytes(whole[:100])  # cut short
    fresh = engine_for(model_dir, num_blocks=24)
    assert prefix_store.restore(fresh, model_dir, path) == 0
    assert fresh.block_manager.num_free_blocks == 24 and not fresh.block_manager.hash_to_block_id


def test_a_smaller_pool_takes_the_most_recent_blocks_it_can_hold(tiny_models, tmp_path):
    model_dir = tiny_models.path(VARIANT)
    engine = engine_for(model_dir, num_blocks=24)
    prompt = prompt_for(model_dir, 100)
    ask(engine, prompt)  # 6 full blocks
    path = tmp_path / "cache.safetensors"
    assert prefix_store.save(engine, model_dir, path, 1 << 30) == 6
    small = engine_for(model_dir, num_blocks=5)
    ask(small, prompt_for(model_dir, 20)[::-1], request_id="busy")  # one cached block of its own
    assert prefix_store.restore(small, model_dir, path) == 4  # into the blocks that hold no prefix
    assert small.block_manager.num_free_blocks == 5  # restored blocks stay free (evictable)
    # A prompt frees its tail first, so its head is the most recently used: the head chain came back.
    hits = small.stats().prefix_cache_hits
    ask(small, prompt[:40], request_id="again")
    assert small.stats().prefix_cache_hits - hits == 2 * BLOCK_SIZE


@pytest.mark.parametrize("variant", ["gemma3", "mistral-sliding"])
def test_sliding_window_models_keep_their_blocks_too(tiny_models, tmp_path, variant):
    # Gemma 3 mixes sliding and global layers (two KV groups, both kept); Mistral slides on every layer.
    model_dir = tiny_models.path(variant)
    prompt = prompt_for(model_dir, 70)
    expected = tiny_models.greedy(variant, prompt, 6, None)
    first = engine_for(model_dir, num_blocks=24)
    assert ask(first, prompt) == expected
    path = tmp_path / "cache.safetensors"
    assert prefix_store.save(first, model_dir, path, 1 << 30) > 0
    second = engine_for(model_dir, num_blocks=24)
    assert prefix_store.restore(second, model_dir, path) > 0
    assert ask(second, prompt) == expected
    assert second.stats().prefix_cache_hits > 0


def test_a_dangling_link_in_the_model_folder_does_not_stop_the_cache(tiny_models, tmp_path):
    """A Hugging Face cache snapshot whose unused blob was deleted: saving failed with a trace
    (FileNotFoundError on the link) and the cache was never kept."""
    import shutil

    model_dir = tmp_path / "snapshot"
    shutil.copytree(tiny_models.path(VARIANT), model_dir)
    (model_dir / "pytorch_model.bin").symlink_to(tmp_path / "blobs" / "deleted")
    prompt = prompt_for(model_dir)
    first = engine_for(model_dir, num_blocks=24)
    ask(first, prompt)
    path = tmp_path / "cache.safetensors"
    num_saved = prefix_store.save(first, model_dir, path, 1 << 30)
    assert num_saved > 0 and prefix_store.restore(engine_for(model_dir, num_blocks=24), model_dir, path) == num_saved
