"""One loaded classifier (MiniLM encoder + the committed head) per test session."""

from __future__ import annotations

import pytest

from gateway.safety import load_classifier
from settings import SafetyConfig


@pytest.fixture(scope="session")
def classifier():
    # float32 so that scores do not depend on whether this CPU has AMX.
    return load_classifier(SafetyConfig(embed_dtype="float32"))
