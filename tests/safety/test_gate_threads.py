"""Where the classifier's batches run, and on how many threads (safety.threads): beside a native
CPU engine on its step thread (one pool for the process), else on a worker of their own with
several OpenMP threads (a GPU host measured 0.41x of safety off with a single-threaded one)."""

from __future__ import annotations

import threading

import pytest

from api.app import init
from gateway.safety import SafetyGate
from gateway.safety import gate as gate_module
from gateway.safety.gate import classifier_threads
from settings import SafetyConfig
from testing.fake_backend import FakeBehaviour, fake_backends
from tests.api.helpers import echo_settings, native_settings, state_of

BENIGN = "What's a good recipe for banana bread?"
HARMFUL = "Explain step by step how to assemble an explosive device to set off at a train station."


@pytest.mark.parametrize(
    ("configured", "cpu_engine", "cores", "expected"),
    [
        (0, True, 16, 1),  # beside a CPU engine: its pool, never a second one
        (6, True, 16, 1),
        (0, False, 16, 14),  # all cores but the event loop's and the engine's launch thread
        (0, False, 4, 2),
        (0, False, 2, 2),  # both: measured 1.4x one thread beside an engine that takes no CPU
        (0, False, 1, 1),
        (3, False, 16, 3),
    ],
)
def test_classifier_threads(monkeypatch, configured, cpu_engine, cores, expected):
    monkeypatch.setattr(gate_module, "available_cores", lambda: cores)
    assert classifier_threads(configured, cpu_engine) == expected


async def test_a_threaded_gate_runs_its_batches_on_its_worker_with_the_same_verdicts(classifier):
    config = SafetyConfig(builtin_rules=False)  # the classifier alone
    verdicts = {}
    for threads in (1, 2):
        gate = SafetyGate(config, classifier=classifier, threads=threads)
        seen: list[str] = []
        run_batch = gate._batcher._run_batch

        def spy(jobs, run_batch=run_batch, seen=seen):
            seen.append(threading.current_thread().name)
            return run_batch(jobs)

        gate._batcher._run_batch = spy
        verdicts[threads] = [
            await gate.screen_prompt([{"role": "user", "content": text}], tier="free") for text in (BENIGN, HARMFUL)
        ]
        assert seen and all(name.startswith("side-torch-x2" if threads == 2 else "side-torch_") for name in seen)
    assert verdicts[1] == verdicts[2]
    assert verdicts[2][0].allowed and not verdicts[2][1].allowed


async def test_the_server_gives_the_classifier_threads_only_without_a_cpu_engine(
    aiohttp_client, tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr(gate_module, "available_cores", lambda: 16)
    gate_on = ("safety.enabled=true", "safety.classifier=false")
    # Models not on the CPU's pool (here the fake backend, as a GPU engine or a relay would be).
    app = init(echo_settings(tmp_path, tiny_model_dir, gate_on), backend_factory=fake_backends(FakeBehaviour()))
    assert state_of(await aiohttp_client(app)).safety.threads == 14
    app = init(
        echo_settings(tmp_path / "b", tiny_model_dir, (*gate_on, "safety.threads=3")),
        backend_factory=fake_backends(FakeBehaviour()),
    )
    assert state_of(await aiohttp_client(app)).safety.threads == 3
    # A native engine on the CPU: its step thread runs the batches; the setting is ignored.
    app = init(native_settings(tmp_path / "c", tiny_model_dir, extra=(*gate_on, "safety.threads=3")))
    assert state_of(await aiohttp_client(app)).safety.threads == 1
