"""Decode-only steps replayed from CUDA graphs (engine.cuda_graphs).

On a GPU a small model's decode step is bound by the host, not the GPU: each layer is some
25 PyTorch ops, each a kernel launch with Python in front of it (a 32-stream step of the 30M
reference took 4.5 ms on an H200 for a few microseconds of GPU work; bench/RESULTS.md, "On a
GPU"). A CUDA graph records one forward pass of a fixed shape and replays all its kernels
with one launch.

Shapes are fixed by padding (batch_inputs.DecodeShape): a decode-only step takes the smallest
row bucket holding its sequences (1, 2, 4, 8, then multiples of 8 up to max_num_seqs) and the
smallest context bucket holding its longest context (powers of two from 64, the last one
max_model_len). Padding rows are token 0 at position 0, whose K/V goes to a scratch block that
no sequence is given and which attend to that slot alone; a real row's context is masked past
its own length, as in an unpadded step. One graph per (rows, length), captured the first time
a step needs it; all share one memory pool and one set of input buffers (one runs at a time,
and a step's output is read before the next replay). Steps with prefill chunks or image
tokens, and shapes past the largest bucket, run as they are.

Mode "eager" pads the same way and runs the forward pass on the same buffers without
capturing: the tests use it on the CPU to check the padding, and on a GPU it separates a
fault of the padding from one of the capture.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from engine.native.attention import AttentionMetadata
from engine.native.batch_inputs import BatchInputBuilder, BatchInputs, DecodeShape
from engine.native.scheduler import ScheduledBatch

log = structlog.get_logger(__name__)

_META_TENSORS = ("slot_mapping", "slot_blocks", "slot_offsets", "decode_slots", "decode_mask", "decode_window_mask")
_MIN_LENGTH = 64


def row_buckets(max_rows: int) -> tuple[int, ...]:
    buckets = [n for n in (1, 2, 4) if n < max_rows] + list(range(8, max_rows, 8))
    return (*buckets, max_rows)


def length_buckets(max_len: int) -> tuple[int, ...]:
    buckets, n = [], _MIN_LENGTH
    while n < max_len:
        buckets.append(n)
        n *= 2
    return (*buckets, max_len)


def _tensors(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """A padded decode step's device inputs by name (a hybrid model's window group under 'window.')."""
    out = {"input_ids": input_ids, "positions": positions}
    group: AttentionMetadata | None = meta
    prefix = ""
    while group is not None:
        out.update({prefix + name: t for name in _META_TENSORS if (t := getattr(group, name)) is not None})
        group, prefix = group.window_group, prefix + "window."
    return out


def _inputs(inputs: BatchInputs) -> dict[str, torch.Tensor]:
    return _tensors(inputs.input_ids, inputs.positions, inputs.meta)


def _with_views(meta: AttentionMetadata, views: dict[str, torch.Tensor], prefix: str = "") -> AttentionMetadata:
    group = meta.window_group
    fields: dict[str, Any] = {name: views[prefix + name] for name in _META_TENSORS if prefix + name in views}
    fields["window_group"] = None if group is None else _with_views(group, views, prefix + "window.")
    return dataclasses.replace(meta, **fields)


@dataclasses.dataclass(slots=True)
class _Graph:
    views: dict[str, torch.Tensor]  # this shape's inputs: views of the shared buffers
    run: Callable[[], torch.Tensor]  # the forward pass on them
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # [rows, hidden], in the graph pool (captured graphs)


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        builder: BatchInputBuilder,
        *,
        max_rows: int,
        max_len: int,
        capture: bool,
    ):
        self.forward_pass = forward  # (input_ids, positions, meta) -> hidden: the model over the KV cache
        self.builder = builder
        self.row_buckets = row_buckets(max_rows)
        self.length_buckets = length_buckets(max_len)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[DecodeShape, _Graph] = {}
        self.buffers: dict[str, torch.Tensor] | None = None
        self.num_padded_steps = 0  # steps run from the padded buffers (replayed, or eager mode)
        self.num_padding_rows = 0  # rows those steps computed for no sequence

    def shape_for(self, batch: ScheduledBatch) -> DecodeShape | None:
        """The padded shape of a decode-only step; None: run it as it is."""
        if not batch.seqs or any(n != 1 for n in batch.num_scheduled_tokens):
            return None
        r = bisect.bisect_left(self.row_buckets, len(batch.seqs))
        longest = max(seq.num_computed_tokens for seq in batch.seqs) + 1
        n = bisect.bisect_left(self.length_buckets, longest)
        if r == len(self.row_buckets) or n == len(self.length_buckets):
            return None
        return DecodeShape(self.row_buckets[r], self.length_buckets[n])

    def forward(
        self,
        shape: DecodeShape,
        num_rows: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[shape.rows, hidden] for a step of num_rows sequences built padded to `shape`: its
        rows first, then the padding's."""
        graph = self.graphs.get(shape) or self._prepare(shape)
        for name, tensor in _tensors(input_ids, positions, meta).items():
            graph.views[name].copy_(tensor, non_blocking=True)
        self.num_padded_steps += 1
        self.num_padding_rows += shape.rows - num_rows
        if graph.graph is None:
            return graph.run()
        graph.graph.replay()
        assert graph.output is not None
        return graph.output

    def _prepare(self, shape: DecodeShape) -> _Graph:
        start = time.perf_counter()
        empty = ScheduledBatch((), ())
        padding = self.builder.build(empty, shape)  # every row a padding row
        if self.buffers is None:  # sized for the largest shape; every graph views their fronts
            largest = self.builder.build(empty, DecodeShape(self.row_buckets[-1], self.length_buckets[-1]))
            self.buffers = {name: torch.empty_like(t).view(-1) for name, t in _inputs(largest).items()}
        views = {name: self.buffers[name][: t.numel()].view(t.shape) for name, t in _inputs(padding).items()}
        for name, tensor in _inputs(padding).items():  # the capture runs on padding: it writes only the scratch block
            views[name].copy_(tensor)
        meta = _with_views(padding.meta, views)
        forward = self.forward_pass  # not self: a graph must not keep its owner alive (a cycle)
        graph = _Graph(views, lambda: forward(views["input_ids"], views["positions"], meta))
        if self.capture:
            # Lazy initialisations (cuBLAS workspaces, SDPA's choice of kernel) run outside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.run()
            torch.cuda.current_stream().wait_stream(side)
            graph.graph = torch.cuda.CUDAGraph()
            # No garbage collection during the capture: an unreachable CUDA graph freed then (another
            # engine's, say) makes a CUDA call that invalidates it (seen on an H100).
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph.graph, pool=self.pool, capture_error_mode="thread_local"):
                    graph.output = graph.run()
            finally:
                if collecting:
                    gc.enable()
        self.graphs[shape] = graph
        elapsed = time.perf_counter() - start
        log.info(
            "decode_graph_ready",
            rows=shape.rows,
            length=shape.length,
            captured=self.capture,
            ms=round(elapsed * 1000, 1),
            graphs=len(self.graphs),
        )
        return graph
