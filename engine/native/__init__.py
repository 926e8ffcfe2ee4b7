"""The native PyTorch engine: paged KV cache, continuous batching, chunked prefill, prefix caching.

Torch-free bookkeeping (sequence, block_manager, hybrid_blocks, scheduler, llm_engine) over a
runner/batch_inputs/model layer that is the only code touching tensors; backend.py adapts it
to engine.types.Backend.
"""
