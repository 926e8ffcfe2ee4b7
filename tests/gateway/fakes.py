"""A settable clock for the gateway tests (the fake backend is testing/fake_backend.py)."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start_s: float = 1000.0):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
