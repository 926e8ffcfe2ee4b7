"""Fixtures for the bundled demo models in models/: their folders, the committed held-out
sample, and each model loaded once per session with transformers on CPU (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="session")
def heldout_sample():
    from scripts.demo_model.dataset import read_jsonl

    return read_jsonl(MODELS_DIR / "heldout.jsonl")


@pytest.fixture(scope="session")
def loaded_models():
    """name -> (model, hf tokenizer), loaded lazily and kept for the session."""
    from scripts.demo_model.evaluate import load_for_eval

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_for_eval(MODELS_DIR / name)
        return cache[name]

    return get
