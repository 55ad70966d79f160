"""The folder scan (reconcile.py): the index rebuilt from headers, other instances' files
and hits seen at once, vanished files dropped, stray temp files cleaned only when their writer
is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disk_fixtures import (
    VALIDATE,
    files,
    open_cache,
    put,
    toks,
)
from snapshot_fixtures import (
    NAMESPACE,
    OTHER_NAMESPACE,
)

from keepwarm.engine.cache import disk_cache as disk_cache_module


def test_index_is_rebuilt_from_headers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    c.close()
    path = c.path_for(k)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # corrupt the payload only
    path.write_bytes(bytes(data))

    def no_payload_reads(*a: object, **kw: object) -> None:
        raise AssertionError("start-up must not read payloads")

    for db in tmp_path.glob("index.sqlite3*"):
        db.unlink()  # no index: rebuilt from the headers
    monkeypatch.setattr(disk_cache_module, "read_snapshot", no_payload_reads)
    c2 = open_cache(tmp_path)
    monkeypatch.undo()
    [info] = c2.entries()
    assert (info.key, info.tokens, info.position, info.bytes) == (k, 10, 8, len(data))
    assert c2.load(k, toks(1), VALIDATE) is None
    assert c2.stats().rejected_by_reason == {"checksum": 1} and c2.stats().num_entries == 0
    c2.close()


def test_other_instances_files_and_hits_are_seen_at_once_and_refresh_drops_vanished_files(
    tmp_path: Path,
) -> None:
    c1 = open_cache(tmp_path, refresh_s=0.02)
    c2 = open_cache(tmp_path)
    k = put(c2, 0)
    for _ in range(5):
        c2.load(k, toks(0), VALIDATE)
    [info] = c1.entries()  # no rescan: the index is shared
    assert (info.key, info.hits) == (k, 5) and c1.contains(k) and c1.known_lengths() == {10}
    gone = put(c2, 1)
    c2.path_for(gone).unlink()  # removed by hand: the idle refresh drops its row
    deadline = time.monotonic() + 30
    while c1.stats().num_entries != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {e.key for e in c1.entries()} == {k} and not c1.contains(gone)
    c1.load(k, toks(0), VALIDATE)
    c1.close()
    c2.close()
    c3 = open_cache(tmp_path)
    assert {e.key: e.hits for e in c3.entries()} == {k: 6}
    c3.close()


def test_stray_temp_files_are_cleaned_only_when_their_writer_is_gone(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shard = tmp_path / NAMESPACE / "ab"
    shard.mkdir(parents=True)
    other_shard = tmp_path / OTHER_NAMESPACE / "cd"
    other_shard.mkdir(parents=True)
    final = f"{'ab' * 16}.safetensors"
    dead_tmp = shard / f"{final}.{dead.pid}.00000000.tmp"
    live_tmp = shard / f"{final}.{os.getpid()}.11111111.tmp"
    stale_tmp = shard / f"{final}.{os.getpid()}.22222222.tmp"
    junk_tmp = shard / "junk.tmp"
    other_dead = other_shard / f"{'cd' * 16}.safetensors.{dead.pid}.33333333.tmp"
    for f in (dead_tmp, live_tmp, stale_tmp, junk_tmp, other_dead):
        f.write_bytes(b"partial")
    os.utime(stale_tmp, (time.time() - 3600, time.time() - 3600))
    c = open_cache(tmp_path)
    # a live writer's fresh temp file is left alone; junk.tmp is not a name the cache writes
    assert files(tmp_path, "*.tmp") == sorted([live_tmp, junk_tmp])
    assert c.stats().num_bytes == 0 and c.stats().foreign_by_kind == {"foreign_file": 1}
    c.close()
