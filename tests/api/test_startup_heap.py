"""The server freezes its startup heap once ready (api.startup.freeze_startup_heap): what it
loaded leaves the cyclic collector's generations, so a full collection under load walks only
what requests allocate. Run in a subprocess: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc
import api.app, engine.native.backend, gateway.safety.gate  # what server.py has loaded when ready
from api.startup import freeze_startup_heap
before = len(gc.get_objects())
frozen = freeze_startup_heap()
after = len(gc.get_objects())
print(before, frozen, after)
"""


def test_freezing_takes_the_loaded_modules_out_of_the_collectors_generations():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True)
    before, frozen, after = (int(x) for x in out.stdout.split())
    assert frozen > 50_000  # torch, aiohttp, the server's own modules
    assert frozen >= before * 0.9
    assert after < before / 20  # a collection now walks almost nothing
