"""single_threaded_torch: the calling thread runs torch ops alone, the others keep their count."""

from __future__ import annotations

import threading

import torch

from engine.torch_threads import single_threaded_torch


def test_limits_only_the_calling_thread():
    before = torch.get_num_threads()
    seen = {}

    def worker():
        seen["ok"] = single_threaded_torch()
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        seen["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["ok"] and seen["threads"] == 1
    assert torch.get_num_threads() == before
