"""Shared fixtures: a tiny random Llama checkpoint built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")
