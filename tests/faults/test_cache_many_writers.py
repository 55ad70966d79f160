"""Several writer processes on one cache folder (issue 17 item 1): each publishes
atomically and never rewrites another's entry, they share hit statistics and one byte
budget, and no two of them evict the same file: every file published is either on disk
at the end or counted as evicted by exactly one process. With either index backend: SQLite
in the folder, or Valkey (--cache-index redis, the multi-host one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from cache_fault_worker import VALIDATE, entry_key, entry_snapshot, loop_tokens
from cache_faults import open_cache, same_bytes

WORKER = Path(__file__).with_name("cache_fault_worker.py")
ENTRY = 256 << 10
BUDGET = 10 * ENTRY + ENTRY // 2
RANGES = [(0, 40), (20, 60), (40, 80)]  # overlapping keys: the same entry wanted by two processes


def _usage(root: Path) -> int:
    """Bytes of snapshot and temp files, each inode once (a publish links the temp file into
    place, so for a moment one file has two names)."""
    sizes: dict[int, int] = {}
    for p in root.rglob("*"):
        if p.name.endswith((".safetensors", ".tmp")):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def test_writers_share_one_budget_and_evict_each_file_once(
    tmp_path: Path, cache_index_url: str | None
) -> None:
    root, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "CACHE_FAULT_INDEX_URL": cache_index_url or ""}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "share", str(root), str(BUDGET), str(lo), str(hi), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for lo, hi in RANGES
    ]
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the folder's size, sampled while they write
        while not stop.is_set():
            peak[0] = max(peak[0], _usage(root))
            time.sleep(0.002)

    sampler = threading.Thread(target=watch, daemon=True)
    try:
        deadline = time.monotonic() + 120
        while not all(go.with_name(f"go.ready.{lo}").exists() for lo, _ in RANGES):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "workers did not start"
            )
            time.sleep(0.01)
        sampler.start()
        go.touch()
        stats = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            stats.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    sampler.join()

    files = {p.name.removesuffix(".safetensors") for p in root.rglob("*.safetensors")}
    saves = sum(s["saves"] for s in stats)
    evictions = sum(s["evictions"] for s in stats)
    assert saves - evictions == len(files)  # each eviction counted by exactly one process
    # One budget, reservations included. The sampler's folder walk is not atomic: it can count
    # a file that an eviction removes mid-walk and the file that replaces it, one entry at most;
    # three writers without a shared budget would overshoot by several entries.
    assert peak[0] <= BUDGET + ENTRY
    assert _usage(root) <= BUDGET  # at rest: exact
    for s in stats:
        assert (s["rejected_by_reason"], s["errors_by_kind"], s["write_errors"], s["garbage_rows"]) == (
            {},
            {},
            0,
            0,
        )

    c = open_cache(root, budget=BUDGET, index_url=cache_index_url)
    info = {e.key: e for e in c.entries()}
    assert set(info) == files
    hits = sum(s["hits"] for s in stats)
    assert hits > 0 and sum(e.hits for e in info.values()) <= hits  # shared statistics, none invented
    for i in range(80):
        if entry_key(i) in files:
            snap = c.load(entry_key(i), loop_tokens(i), VALIDATE)
            assert snap is not None and same_bytes(snap, entry_snapshot(i)), i
    assert c.stats().rejected_by_reason == {}
    c.close()
