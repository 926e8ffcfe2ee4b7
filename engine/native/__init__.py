"""The native PyTorch engine: paged KV cache, continuous batching, chunked prefill, prefix caching.

Torch-free bookkeeping (sequence, block_manager, scheduler, engine) over a runner/model layer
that is the only code touching tensors; backend.py adapts it to engine.types.Backend.
"""
