"""Fixtures of the backend contract suite: each backend, started on the tiny model.

`backend_under_test` is parametrized over every backend: the native engine for real, and
the TensorRT-LLM adapter driving the stand-in `tensorrt_llm` (tests/contract/standin_tensorrt_llm).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

from contract_harness import BackendUnderTest, load_standin
from engine.tokenizer import Tokenizer
from settings import EngineConfig, TrtllmConfig

BACKENDS = ("native", "trtllm-standin")


@pytest.fixture
def standin_trtllm(monkeypatch) -> ModuleType:
    """Make `import tensorrt_llm` find the stand-in, for this test only."""
    package, llmapi = load_standin()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    return package


@pytest.fixture
def trtllm_config() -> TrtllmConfig:
    return TrtllmConfig(max_batch_size=8, max_num_tokens=256, stats_interval_s=0.05)


async def _native(model_dir: Path, tokenizer: Tokenizer) -> BackendUnderTest:
    from engine.native.backend import NativeBackend  # an import error fails the test, never skips it

    config = EngineConfig(
        device="cpu",
        dtype="float32",
        num_threads=1,
        kv_cache_bytes=4 * 1024 * 1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    backend = NativeBackend(model_dir, config, tokenizer, max_model_len=512)
    await backend.start()

    def inject_failure() -> None:
        """The next forward pass raises, as a device error would (then the runner is itself again)."""
        runner = backend.engine.runner
        original = runner.execute

        def fail_once(batch):
            runner.execute = original
            raise RuntimeError("injected device failure")

        runner.execute = fail_once

    return BackendUnderTest("native", backend, tokenizer, inject_failure)


async def _trtllm(model_dir: Path, tokenizer: Tokenizer, config: TrtllmConfig) -> BackendUnderTest:
    from engine.trtllm.backend import TrtllmBackend

    backend = TrtllmBackend(model_dir, config, tokenizer, max_model_len=512)
    await backend.start()
    return BackendUnderTest("trtllm-standin", backend, tokenizer, backend._llm.standin.fail_next_request)


@pytest.fixture(params=BACKENDS)
async def backend_under_test(request, tiny_model_dir, trtllm_config) -> AsyncIterator[BackendUnderTest]:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    if request.param == "native":
        under_test = await _native(tiny_model_dir, tokenizer)
    else:
        request.getfixturevalue("standin_trtllm")
        under_test = await _trtllm(tiny_model_dir, tokenizer, trtllm_config)
    try:
        yield under_test
    finally:
        await under_test.backend.shutdown()
