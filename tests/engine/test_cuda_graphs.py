"""Decode steps padded to fixed shapes and replayed from CUDA graphs (engine/native/cuda_graphs.py).

On the CPU the padded steps run without capture (engine.cuda_graphs = "eager"): the same
buffers, buckets, padding rows and scratch block as a captured graph, so greedy equality with
transformers here checks the padding. On a GPU (ENGINE_TEST_DEVICE=cuda, scripts/cuda_check.sh)
the same tests also run with the graphs captured and replayed ("auto"); the test id names the mode.
"""

from __future__ import annotations

import pytest
import torch

from engine.native.batch_inputs import DecodeShape
from engine.native.cuda_graphs import length_buckets, row_buckets
from engine.native.loader import load_model_args
from engine.native.scheduler import ScheduledBatch
from engine.types import EngineError
from native_harness import TEST_DEVICE, make_request
from test_families import family_workload
from test_greedy_equality import engine_for, mixed_workload, run_with_arrivals

# "eager": padded, not captured (any device); "auto" on CUDA: captured and replayed.
MODES = ["eager", *(["auto"] if TEST_DEVICE == "cuda" else [])]


def graphs_engine(model_dir, mode: str, **overrides):
    engine = engine_for(model_dir, native_kernels=False, cuda_graphs=mode, **overrides)
    assert engine.runner.decode_graphs is not None
    assert engine.runner.decode_graphs.capture == (mode == "auto")
    return engine


def check_graphs_ran(engine, mode: str) -> None:
    graphs = engine.runner.decode_graphs
    assert graphs.num_padded_steps > 0, "no decode step ran padded"
    assert graphs.graphs, "no padded shape was prepared"
    assert all((g.graph is not None) == (mode == "auto") for g in graphs.graphs.values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["tied-gqa-parameters", "untied-mha-parameters", "qwen2-qkv-bias"])
def test_padded_decode_steps_match_transformers_greedy(tiny_models, variant, mode):
    # Preemption, prefix hits, chunked prefill and late arrivals: batches of 1-6 sequences,
    # padded to 1, 2, 4 or 6 rows, contexts to 64, 128 or 256 positions.
    model_dir = tiny_models.path(variant)
    engine = graphs_engine(model_dir, mode, num_blocks=24)
    arrivals, expected = mixed_workload(tiny_models, variant, load_model_args(model_dir).vocab_size)
    assert run_with_arrivals(engine, arrivals) == expected
    check_graphs_ran(engine, mode)
    graphs = engine.runner.decode_graphs
    assert graphs.num_padding_rows > 0, "no step was padded with rows"
    assert len({s.rows for s in graphs.graphs}) >= 3 and len({s.length for s in graphs.graphs}) >= 2, graphs.graphs
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["gemma3", "gemma2", "mistral-sliding", "phi3", "smollm3", "granite"])
def test_padded_decode_steps_of_every_attention_kind_match_transformers(tiny_models, variant, mode):
    # Sliding windows (a window mask; Gemma's two KV groups, each with its own scratch block),
    # soft-caps, partial rotary, layers without RoPE, multipliers.
    model_dir = tiny_models.path(variant)
    args = load_model_args(model_dir)
    all_sliding = all(layer.sliding_window for layer in args.layers)
    engine = graphs_engine(model_dir, mode, num_blocks=6 if all_sliding else 10)
    arrivals, expected = family_workload(tiny_models, variant, args.vocab_size, 0)
    assert run_with_arrivals(engine, arrivals) == expected
    check_graphs_ran(engine, mode)


def test_padding_rows_write_and_read_only_the_scratch_block(tiny_models):
    engine = graphs_engine(tiny_models.path("gemma3"), "eager", num_blocks=10)
    runner = engine.runner
    assert runner.is_hybrid and runner.decode_graphs is not None
    inputs = runner.batch_inputs.build(ScheduledBatch((), ()), DecodeShape(rows=4, length=64))
    bs = runner.block_size
    metas = (inputs.meta, inputs.meta.window_group)
    for group, meta in enumerate(metas):
        scratch = runner.group_num_blocks[group]  # one past every block the block manager hands out
        assert engine.block_manager.groups[group].num_blocks == scratch
        assert runner.kv_caches[args_layer(runner, group)][0].shape[0] == scratch + 1
        assert meta.slot_mapping.tolist() == [scratch * bs] * 4
        assert meta.decode_slots.shape == (4, 64) and set(meta.decode_slots.flatten().tolist()) == {scratch * bs}
        mask = meta.decode_mask.reshape(4, 64)
        assert mask[:, 0].all() and not mask[:, 1:].any()
    assert inputs.input_ids.tolist() == [0] * 4 and inputs.positions.tolist() == [0] * 4


def args_layer(runner, group: int) -> int:
    """A layer of this KV group."""
    return runner.layer_groups.index(group)


def test_buckets_and_which_steps_are_padded(tiny_models):
    assert row_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(1) == (1,)
    assert length_buckets(300) == (64, 128, 256, 300)
    assert length_buckets(64) == (64,)
    engine = graphs_engine(tiny_models.path("tied-gqa-parameters"), "eager", num_blocks=24, max_num_seqs=6)
    graphs = engine.runner.decode_graphs
    assert graphs.length_buckets[-1] == engine.runner.max_model_len

    for i in range(5):
        engine.add_request(make_request(f"r{i}", [5 + i] * (3 + 40 * i), max_tokens=4))
    batch = engine.scheduler.schedule()
    assert graphs.shape_for(batch) is None  # prefill chunks: not padded
    engine.scheduler.postprocess(batch, engine.runner.execute(batch))
    while True:
        batch = engine.scheduler.schedule()
        if all(n == 1 for n in batch.num_scheduled_tokens):
            break
        engine.scheduler.postprocess(batch, engine.runner.execute(batch))
    longest = max(seq.num_computed_tokens for seq in batch.seqs) + 1
    shape = graphs.shape_for(batch)
    assert shape == DecodeShape(rows=next(r for r in graphs.row_buckets if r >= len(batch.seqs)), length=256)
    assert 128 < longest <= 256


def test_bad_modes_are_refused_naming_the_setting(tiny_models):
    model_dir = tiny_models.path("tied-gqa-parameters")
    with pytest.raises(EngineError, match=r"engine\.cuda_graphs 'sometimes'"):
        engine_for(model_dir, num_blocks=24, native_kernels=False, cuda_graphs="sometimes")
    if TEST_DEVICE == "cpu":
        with pytest.raises(EngineError, match='kernel_isa = "torch"'):
            engine_for(model_dir, num_blocks=24, kernel_isa="avx2", cuda_graphs="eager")
        # auto is off on the CPU: no padding, no scratch block
        engine = engine_for(model_dir, num_blocks=24, native_kernels=False)
        assert engine.runner.decode_graphs is None
        assert engine.runner.kv_caches[0][0].shape[0] == 24
    else:
        engine = engine_for(model_dir, num_blocks=24)
        assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.capture
        assert torch.cuda.is_available()


def test_an_engine_with_padded_decode_steps_is_freed_without_the_cycle_collector(tiny_models):
    # Its KV pool (GPU memory on CUDA) goes when the engine does, not at some later collection
    # (which, during another engine's capture, would also break that capture).
    import gc
    import weakref

    engine = graphs_engine(tiny_models.path("tied-gqa-parameters"), "eager", num_blocks=24)
    engine.add_request(make_request("r", [5, 6, 7], max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.decode_graphs.graphs
    pool = weakref.ref(engine.runner.kv_pool)
    gc.disable()
    try:
        del engine
        assert pool() is None
    finally:
        gc.enable()
