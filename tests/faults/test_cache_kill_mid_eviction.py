"""Three processes on one cache folder and one index (SQLite in the folder, or one Valkey: the
multi-host setup, --cache-index redis), one of them SIGKILLed in the middle of an eviction it
claimed: its first victim's file deleted, the others' not, every victim's row still EVICTING.
The two others finish their work; once the folder is reconciled, the index lists exactly the
files on disk (none listed is missing, none on disk is unknown), every one verifies, the dead
process's evictions are completed and the byte budget holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cache_fault_worker import VALIDATE, entry_key, entry_snapshot, loop_tokens
from cache_faults import NAMESPACE, open_cache, same_bytes

from keepwarm.engine.cache.index import EVICTING, LIVE, CacheIndex
from keepwarm.engine.cache.index_protocol import Index
from keepwarm.engine.cache.valkey_index import ValkeyIndex

WORKER = Path(__file__).with_name("cache_fault_worker.py")
ENTRY = 256 << 10
BUDGET = 10 * ENTRY + ENTRY // 2
RANGES = [(0, 40), (20, 60), (40, 80)]  # overlapping keys; the first process is the one killed


def _index(root: Path, url: str | None) -> Index:
    """A handle on the folder's index, as one more process would open it."""
    if url is None:
        return CacheIndex(root, owner="test")
    return ValkeyIndex(root, owner="test", url=url)


def _files(root: Path) -> dict[str, int]:
    return {p.name.removesuffix(".safetensors"): p.stat().st_size for p in root.rglob("*.safetensors")}


def test_a_process_killed_mid_eviction_loses_nothing_the_index_lists(
    tmp_path: Path, cache_index_url: str | None
) -> None:
    root, go, marker = tmp_path / "cache", tmp_path / "go", tmp_path / "claimed.json"
    env = {**os.environ, "CACHE_FAULT_INDEX_URL": cache_index_url or ""}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "share", str(root), str(BUDGET), str(lo), str(hi), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "CACHE_FAULT_HANG_MID_EVICTION": str(marker)} if n == 0 else env,
        )
        for n, (lo, hi) in enumerate(RANGES)
    ]
    doomed = procs[0]
    try:
        deadline = time.monotonic() + 120
        while not all(go.with_name(f"go.ready.{lo}").exists() for lo, _ in RANGES):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "workers did not start"
            )
            time.sleep(0.01)
        go.touch()
        while not marker.exists():  # the doomed process claims its first eviction and hangs
            assert doomed.poll() is None and time.monotonic() < deadline + 120, (
                doomed.stderr.read() if doomed.stderr and doomed.poll() is not None else "no eviction claimed"
            )
            time.sleep(0.01)
        claimed = [tuple(v) for v in json.loads(marker.read_text())]
        assert claimed and all(ns == NAMESPACE for ns, _ in claimed)
        idx = _index(root, cache_index_url)
        try:
            rows = {r.key: r for r in idx.all_rows()[0]}
        finally:
            idx.close()
        assert all(rows[key].state == EVICTING for _, key in claimed)  # mid-eviction, in the index
        assert not (root / NAMESPACE / claimed[0][1][:2] / f"{claimed[0][1]}.safetensors").exists()
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=30)
        assert doomed.returncode == -signal.SIGKILL
        stats = []
        for p in procs[1:]:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            stats.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for s in stats:
        assert (s["rejected_by_reason"], s["errors_by_kind"], s["write_errors"]) == ({}, {}, 0)

    c = open_cache(root, budget=BUDGET, index_url=cache_index_url)  # its start reconciles the folder
    try:
        rows, bad = c._ridx().all_rows()
        assert bad == 0 and {r.state for r in rows} <= {LIVE}  # the dead process's claims are settled
        listed = {r.key: r.bytes for r in rows}
        files = _files(root)
        assert listed == files and files  # nothing listed is missing, nothing on disk is unknown
        # its evictions were completed: a victim no survivor stores is gone; one a survivor's
        # range covers may have been stored again after the kill (then it verifies below)
        again = {entry_key(i) for lo, hi in RANGES[1:] for i in range(lo, hi)}
        assert not ({key for _, key in claimed} - again) & set(files)
        assert sum(files.values()) <= BUDGET
        s = c.stats()
        assert s.num_bytes == sum(files.values()) and s.num_entries == len(files)
        by_key = {entry_key(i): i for i in range(80)}
        for key in files:
            snap = c.load(key, loop_tokens(by_key[key]), VALIDATE)
            assert snap is not None and same_bytes(snap, entry_snapshot(by_key[key])), key
        assert c.stats().rejected_by_reason == {}
    finally:
        c.close()
