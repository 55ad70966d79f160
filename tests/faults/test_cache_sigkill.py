"""Repeated SIGKILL of a writer process during writes, evictions and index transactions,
with a restart on the same folder each time (issue 16): nothing corrupt or partial is
ever adopted, every indexed entry is a complete verified file, the dead writer's
reservations, evictions and temp files are settled at the next start."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from cache_fault_worker import VALIDATE, entry_key, entry_snapshot, loop_tokens
from cache_faults import open_cache, same_bytes

from keepwarm.engine.cache.index import DB_NAME

WORKER = Path(__file__).with_name("cache_fault_worker.py")
ENTRY = 256 << 10
BUDGET = 12 * ENTRY + ENTRY // 2  # small: the writer evicts while it is killed


def _kill_worker(root: Path, seed: int, delay: float) -> None:
    p = subprocess.Popen(
        [sys.executable, str(WORKER), "loop", str(root), str(BUDGET), str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        assert line == "ready", p.stderr.read() if p.stderr else line
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert p.returncode == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_repeated_sigkill_during_writes_never_leaves_anything_adoptable(tmp_path: Path) -> None:
    rng = random.Random(16)
    expected: dict[str, int] = {}
    for seed in range(3):
        expected.update({entry_key(i): i for i in range(seed * 10000, seed * 10000 + 3000)})
        _kill_worker(tmp_path, seed, rng.uniform(0.05, 0.6))
        c = open_cache(tmp_path, budget=BUDGET)
        assert list(tmp_path.rglob("*.tmp")) == []  # the dead writer's temp files are gone
        with sqlite3.connect(tmp_path / DB_NAME) as db:
            states = db.execute("SELECT state, COUNT(*) FROM entries GROUP BY state").fetchall()
        assert [s for s, _ in states] in ([0], [])  # no reservation or eviction left unsettled
        files = {p.name.removesuffix(".safetensors") for p in tmp_path.rglob("*.safetensors")}
        entries = {e.key for e in c.entries()}
        assert entries == files and len(files) >= 1
        for key in files:
            i = expected[key]
            snap = c.load(key, loop_tokens(i), VALIDATE)
            assert snap is not None and same_bytes(snap, entry_snapshot(i)), i
        s = c.stats()
        assert (s.rejected_by_reason, s.garbage_rows, s.errors_by_kind) == ({}, 0, {})
        assert s.num_bytes <= BUDGET
        c.close()
