"""The background writer (writer.py): pending keys, the queue's entry and byte bounds, its
nice value and settings, surviving any error, and a kill mid-write leaving nothing adoptable."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from disk_cache_worker import LOOP_DIM, LOOP_HEADS, LOOP_POSITION, loop_tokens
from disk_fixtures import (
    VALIDATE,
    files,
    key_of,
    open_cache,
    run_worker,
    toks,
)
from snapshot_fixtures import (
    NAMESPACE,
    geometry,
    make_snapshot,
    same_bytes,
    validator,
)

from keepwarm.engine.cache import disk_cache as disk_cache_module
from keepwarm.engine.cache import writer as writer_module
from keepwarm.engine.cache.disk_cache import DiskCache


class StalledWriter:
    """A `disk_free` probe that, once armed, holds the writer before it publishes its
    current job (waiting is set) until the gate opens."""

    def __init__(self) -> None:
        self.gate, self.armed, self.waiting = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, root: Path) -> int:
        if self.armed.is_set():
            self.waiting.set()
            assert self.gate.wait(30)
        return 1 << 50


def test_pending_keys_and_full_queue(tmp_path: Path) -> None:
    stall = StalledWriter()
    c = open_cache(tmp_path, min_free_bytes=1, queue_size=1, disk_free=stall)
    stall.armed.set()
    ka, kb, kc = (key_of(toks(i)) for i in range(3))
    assert c.save(ka, toks(0), make_snapshot(8, seed=0))
    assert stall.waiting.wait(30)  # the writer holds A, stuck before publishing it
    assert c.contains(ka) and c.stats().pending == 1
    assert c.load(ka, toks(0), VALIDATE) is None  # pending: a miss, never a half-written file
    assert not c.save(ka, toks(0), make_snapshot(8, seed=0))  # no second copy queued
    assert c.save(kb, toks(1), make_snapshot(8, seed=1))  # fills the queue (size 1)
    assert not c.save(kc, toks(2), make_snapshot(8, seed=2))  # dropped
    stall.armed.clear()
    stall.gate.set()
    c.flush()
    s = c.stats()
    assert (s.saves, s.dropped_saves, s.pending, s.misses) == (2, 1, 0, 1)
    assert c.load(ka, toks(0), VALIDATE) is not None and not c.contains(kc)
    c.close()
    assert not c.save(kc, toks(2), make_snapshot(8, seed=2))  # closed: dropped
    assert c.stats().dropped_saves == 2


def test_queue_bound_in_bytes(tmp_path: Path) -> None:
    """Queued snapshot bytes (the one being written included) stay within queue_bytes; an
    empty queue takes a snapshot larger than the bound; written jobs give their bytes back."""
    stall = StalledWriter()
    one = make_snapshot(8).num_bytes
    c = open_cache(tmp_path, min_free_bytes=1, queue_size=8, queue_bytes=2 * one + 1, disk_free=stall)
    stall.armed.set()
    keys = [key_of(toks(i)) for i in range(4)]
    assert c.save(keys[0], toks(0), make_snapshot(8, seed=0))
    assert stall.waiting.wait(30)  # the writer holds it: its bytes still count
    assert c.save(keys[1], toks(1), make_snapshot(8, seed=1))
    assert not c.save(keys[2], toks(2), make_snapshot(8, seed=2))  # 3 x one > 2 x one + 1
    assert c.stats().dropped_saves == 1
    stall.armed.clear()
    stall.gate.set()
    c.flush()
    assert c.save(keys[2], toks(2), make_snapshot(8, seed=2))  # written ones gave their bytes back
    c.flush()
    assert [c.contains(k) for k in keys] == [True, True, True, False]
    assert c.stats().saves == 3
    c.close()
    big = open_cache(tmp_path / "big", queue_bytes=1)
    assert big.save(keys[3], toks(3), make_snapshot(8, seed=3))  # alone: larger than the bound
    big.close()
    again = open_cache(tmp_path / "big")
    assert again.contains(keys[3])
    again.close()


def _thread_nice(name_prefix: str) -> list[int]:
    """The nice values (field 19 of /proc/self/task/TID/stat) of this process's Python
    threads whose name starts with `name_prefix`."""
    out = []
    for t in threading.enumerate():
        if t.name.startswith(name_prefix) and t.native_id is not None:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            out.append(int(stat[stat.rindex(")") + 2 :].split()[16]))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 7, 19])
def test_writer_runs_at_its_nice_value(tmp_path: Path, nice: int) -> None:
    """The writer thread lowers its own CPU priority (not the process's: the caller's
    threads keep theirs) before it writes anything."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    c = open_cache(tmp_path, writer_nice=nice)
    assert c.save(key_of(toks(0)), toks(0), make_snapshot(8))
    c.flush()
    assert _thread_nice("disk-cache-") == [max(before, nice)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    c.close()


def test_bad_writer_settings_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="writer_nice must be in 0..19"):
        DiskCache(tmp_path, NAMESPACE, budget_bytes=1, writer_nice=20)
    with pytest.raises(ValueError, match="queue_bytes must be >= 1"):
        DiskCache(tmp_path, NAMESPACE, budget_bytes=1, queue_bytes=0)
    monkeypatch.setattr(disk_cache_module.sys, "platform", "darwin")
    with pytest.raises(ValueError, match="writer_nice needs Linux .* leave it 0 on darwin"):
        DiskCache(tmp_path, NAMESPACE, budget_bytes=1, writer_nice=5)
    DiskCache(tmp_path, NAMESPACE, budget_bytes=1, writer_nice=0)  # the default is fine anywhere


def test_sigkill_mid_write_leaves_nothing_adoptable(tmp_path: Path) -> None:
    p = run_worker("loop", str(tmp_path), NAMESPACE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"  # "" if it died
        deadline = time.monotonic() + 60
        while not files(tmp_path, "*.tmp") and time.monotonic() < deadline:
            time.sleep(0.001)
        assert files(tmp_path, "*.tmp"), "the worker never had a write in flight"
        os.kill(p.pid, signal.SIGKILL)  # while a temp file exists: a write in flight
        p.wait(timeout=30)
        assert p.returncode == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

    c = open_cache(tmp_path)
    assert files(tmp_path, "*.tmp") == []  # the dead writer's temp files are gone
    published = files(tmp_path, "*.safetensors")
    assert len(published) == c.stats().num_entries >= 1
    expected = make_snapshot(LOOP_POSITION, heads=LOOP_HEADS, dim=LOOP_DIM)
    validate = validator(geometry(heads=LOOP_HEADS, dim=LOOP_DIM))
    for i in range(len(published)):
        snap = c.load(key_of(loop_tokens(i)), loop_tokens(i), validate)
        assert snap is not None and same_bytes(snap, expected)
    s = c.stats()
    assert (s.hits, s.rejected_by_reason) == (len(published), {})
    c.close()


def _flush_or_fail(c: DiskCache) -> None:
    t = threading.Thread(target=c.flush, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the writer thread died: saves are never written"


def test_the_writer_thread_survives_any_error_logged_once_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    c = open_cache(tmp_path, refresh_s=0.01)
    real_publish = writer_module.publish

    def broken_publish(*a: object, **kw: object) -> int | None:
        raise OSError(5, "Input/output error")

    def broken_scan() -> None:
        raise RuntimeError("scan failed")

    with caplog.at_level("WARNING", logger="keepwarm.engine.cache.disk_cache"):
        monkeypatch.setattr(writer_module, "publish", broken_publish)
        monkeypatch.setattr(c, "_scan", broken_scan)  # the idle upkeep fails too
        for i in range(3):
            assert c.save(key_of(toks(i)), toks(i), make_snapshot(8, seed=i))
            _flush_or_fail(c)
        time.sleep(0.1)  # several idle upkeeps, each failing
        monkeypatch.setattr(writer_module, "publish", real_publish)
        assert c.save(key_of(toks(7)), toks(7), make_snapshot(8, seed=7))
        _flush_or_fail(c)
        k = key_of(toks(7))
    assert c.load(k, toks(7), VALIDATE) is not None  # the tier keeps working
    s = c.stats()
    assert (s.write_errors, s.errors_by_kind["write:OSError"], s.saves) == (3, 3, 1)
    assert s.errors_by_kind["reconcile:RuntimeError"] >= 2
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 2  # one per kind of error, not one per failure
    assert not any(c.contains(key_of(toks(i))) for i in range(3))  # failed writes hold no reservation
    c.close()
