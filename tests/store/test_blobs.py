"""The blob folder's sweep: temp files a crash left beside blobs (a cached text being written)
go once stale, fresh ones (a write in progress) and live files stay."""

from __future__ import annotations

import os
import time

from store.blobs import Blobs, new_file_id


def test_sweep_removes_stale_temp_files_and_keeps_fresh_ones_and_live_files(tmp_path):
    blobs = Blobs(tmp_path)
    live = new_file_id()
    blobs.path(live).write_bytes(b"data")
    blobs.text_path(live).write_text("{}")
    stale = [tmp_path / f"{live}.txt.0123abcd.tmp", tmp_path / f"{live}.tmp"]  # today's name, and the old fixed one
    fresh = tmp_path / f"{live}.txt.89abcdef.tmp"
    for path in [*stale, fresh]:
        path.write_text("{")
    hour_ago = time.time() - 7200
    for path in [*stale, blobs.path(live), blobs.text_path(live)]:
        os.utime(path, (hour_ago, hour_ago))
    assert blobs.sweep_orphans({live}) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".partial", live, f"{live}.txt", fresh.name])
