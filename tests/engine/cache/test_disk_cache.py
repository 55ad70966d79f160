"""The disk prefix cache: verification, guard, budget/eviction, hit ledger, processes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from disk_cache_worker import LOOP_DIM, LOOP_HEADS, LOOP_POSITION, entry_tokens, loop_tokens
from snapshot_fixtures import (
    NAMESPACE,
    OTHER_NAMESPACE,
    forge_header,
    geometry,
    make_snapshot,
    same_bytes,
    validator,
)

from keepwarm.engine.cache import disk_cache as disk_cache_module
from keepwarm.engine.cache import writer as writer_module
from keepwarm.engine.cache.disk_cache import HALF_LIFE_S, DiskCache, DiskCacheStats
from keepwarm.engine.cache.prefix_key import prefix_key
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import encode_snapshot, write_snapshot

WORKER = Path(__file__).with_name("disk_cache_worker.py")
VALIDATE = validator()
HL = HALF_LIFE_S


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def toks(i: int, n: int = 10) -> list[int]:
    return [100 * i + j for j in range(n)]


def key_of(tokens: list[int], salt: str = "", ns: str = NAMESPACE) -> str:
    return prefix_key(ns, salt, tokens)


def file_size(position: int = 8, n_tokens: int = 10, created: float = Clock().t) -> int:
    """The exact size of one test entry's file (the header holds `created`)."""
    snap = make_snapshot(position)
    return encode_snapshot(
        namespace=NAMESPACE, key="0" * 32, tokens=list(range(n_tokens)), snapshot=snap, created=created
    ).size


def open_cache(
    root: Path, *, ns: str = NAMESPACE, budget: int = 1 << 30, clock: Clock | None = None, **kw: object
) -> DiskCache:
    return DiskCache(
        root,
        ns,
        budget_bytes=budget,
        min_free_bytes=int(kw.pop("min_free_bytes", 0)),  # type: ignore[call-overload]
        fsync=bool(kw.pop("fsync", False)),
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    ).start()


def put(cache: DiskCache, i: int, *, position: int = 8, n: int = 10, salt: str = "") -> str:
    tokens = toks(i, n)
    key = key_of(tokens, salt, cache.namespace)
    assert cache.save(key, tokens, make_snapshot(position, seed=i))
    cache.flush()
    return key


def keys_on_disk(cache: DiskCache) -> set[str]:
    return {e.key for e in cache.entries() if e.namespace == cache.namespace}


def files(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


# ---- round trip, keys -------------------------------------------------------------------


def test_round_trip_layout_and_stats(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    path = tmp_path / NAMESPACE / k[:2] / f"{k}.safetensors"
    assert path.is_file() and c.path_for(k) == path and c.contains(k)
    snap = c.load(k, toks(1), VALIDATE)
    assert snap is not None and same_bytes(snap, make_snapshot(8, seed=1))
    size = path.stat().st_size
    s = c.stats()
    assert s == DiskCacheStats(
        num_entries=1,
        num_bytes=size,
        bytes_by_namespace={NAMESPACE: size},
        saves=1,
        dropped_saves=0,
        refused_saves=0,
        refused_for_space=0,
        write_errors=0,
        enospc=0,
        evictions=0,
        hits=1,
        misses=0,
        rejected_by_reason={},
        foreign_by_kind={},
        garbage_rows=0,
        errors_by_kind={},
        bytes_read=size,
        read_seconds=s.read_seconds,
        pending=0,
        budget_bytes=1 << 30,
        min_free_bytes=0,
    )
    assert s.read_seconds > 0
    assert not c.save(k, toks(1), make_snapshot(8, seed=99))  # an existing key is never rewritten
    c.flush()
    again = c.load(k, toks(1), VALIDATE)
    assert again is not None and same_bytes(again, make_snapshot(8, seed=1))
    assert c.load(key_of(toks(2)), toks(2), VALIDATE) is None
    assert (c.stats().hits, c.stats().misses, c.stats().saves) == (2, 1, 1)
    c.close()
    assert files(tmp_path, "*.tmp") == []


def test_identity_and_tenant_salts_give_separate_entries(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    tokens = toks(3)
    keys = [put(c, 3, salt=s) for s in ("", "tenant-a", "tenant-b")]
    assert len(set(keys)) == 3 and len(files(tmp_path, "*.safetensors")) == 3
    assert len({key_of(tokens, "", ns) for ns in (NAMESPACE, OTHER_NAMESPACE)}) == 2
    for k in keys:
        assert c.load(k, tokens, VALIDATE) is not None
    c.close()


# ---- rejection of bad files ---------------------------------------------------------------


def test_flipped_payload_byte_is_rejected_deleted_and_counted(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    path = c.path_for(k)
    data = bytearray(path.read_bytes())
    data[-50] ^= 0x80
    path.write_bytes(bytes(data))
    assert c.load(k, toks(1), VALIDATE) is None
    assert not path.exists()
    s = c.stats()
    assert (s.rejected_by_reason, s.misses, s.hits, s.num_entries, s.num_bytes) == (
        {"checksum": 1},
        1,
        0,
        0,
        0,
    )
    c.close()


def test_truncated_file_is_rejected_at_load_and_at_start(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k1, k2 = put(c, 1), put(c, 2)
    p1, p2 = c.path_for(k1), c.path_for(k2)
    p1.write_bytes(p1.read_bytes()[:-7])
    assert c.load(k1, toks(1), VALIDATE) is None and not p1.exists()
    assert c.stats().rejected_by_reason == {"truncated": 1}
    c.close()
    p2.write_bytes(p2.read_bytes()[:-7])
    c2 = open_cache(tmp_path)  # the header promises more bytes than the stat size: caught at start
    assert not p2.exists()
    assert (c2.stats().rejected_by_reason, c2.stats().num_entries) == ({"truncated": 1}, 0)
    c2.close()


def test_foreign_namespace_file_is_never_adopted(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    tokens = toks(4)
    k = key_of(tokens)
    write_snapshot(
        c.path_for(k), namespace=OTHER_NAMESPACE, key=k, tokens=tokens, snapshot=make_snapshot(8, seed=4)
    )
    assert c.load(k, tokens, VALIDATE) is None and not c.path_for(k).exists()
    assert c.stats().rejected_by_reason == {"foreign_namespace": 1}
    c.close()


def test_geometry_callback_failure_deletes_the_file(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    assert c.load(k, toks(1), validator(geometry(heads=4))) is None
    assert not c.path_for(k).exists()
    assert c.stats().rejected_by_reason == {"geometry": 1}
    k = put(c, 1)  # a fresh save of the same key is stored and hits
    assert c.load(k, toks(1), VALIDATE) is not None
    c.close()


def test_wrong_tokens_under_a_key_are_rejected(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    assert c.load(k, toks(2), VALIDATE) is None and not c.path_for(k).exists()
    assert c.stats().rejected_by_reason == {"tokens_mismatch": 1}
    c.close()


def _forge_past_key(cache: DiskCache, tokens: list[int], claimed: int, *, rechecksum: bool = True) -> Path:
    """A file stored under a short key claiming a longer snapshot (the #716 bug), made by
    rewriting the header's position field in place (and its header checksum, as a forger
    who knows the format would)."""
    path = cache.path_for(key_of(tokens))
    write_snapshot(
        path, namespace=NAMESPACE, key=key_of(tokens), tokens=tokens, snapshot=make_snapshot(len(tokens))
    )
    forge_header(path, position=str(claimed), rechecksum=rechecksum)
    return path


def test_position_past_key_guard_on_save_and_on_read(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    short, full = list(range(28)), list(range(32))
    assert not c.save(key_of(short), short, make_snapshot(32))
    c.flush()
    s = c.stats()
    assert (s.refused_saves, s.saves, s.num_bytes) == (1, 0, 0)
    assert files(tmp_path, "*.safetensors") == []
    assert c.save(key_of(full), full, make_snapshot(32))
    c.flush()
    assert c.load(key_of(short), short, VALIDATE) is None
    hit = c.load(key_of(full), full, VALIDATE)
    assert hit is not None and hit.position == 32

    # Forged while running (not in the index yet): rejected on read.
    live_forged = _forge_past_key(c, list(range(50, 78)), claimed=32)
    assert c.load(key_of(list(range(50, 78))), list(range(50, 78)), VALIDATE) is None
    assert not live_forged.exists()
    assert c.stats().rejected_by_reason == {"position_past_key": 1}

    # Edited without fixing the header checksum: a checksum failure.
    edited = _forge_past_key(c, list(range(80, 108)), claimed=32, rechecksum=False)
    assert c.load(key_of(list(range(80, 108))), list(range(80, 108)), VALIDATE) is None
    assert not edited.exists()
    assert c.stats().rejected_by_reason == {"position_past_key": 1, "checksum": 1}

    # Forged while stopped: rejected and deleted by the restart, the consistent file still hits.
    forged = _forge_past_key(c, short, claimed=32)
    c.close()
    c2 = open_cache(tmp_path)
    assert not forged.exists()
    assert c2.stats().rejected_by_reason == {"position_past_key": 1}
    assert c2.load(key_of(short), short, VALIDATE) is None
    hit = c2.load(key_of(full), full, VALIDATE)
    assert hit is not None and hit.position == 32
    c2.close()


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


# ---- budget and eviction ------------------------------------------------------------------


def test_eviction_order_follows_decayed_hits(tmp_path: Path) -> None:
    size = file_size()
    clock = Clock(0.0)
    c = open_cache(tmp_path, budget=3 * size + size // 2, clock=clock)
    a, b, cc = put(c, 0), put(c, 1), put(c, 2)
    for _ in range(2):
        assert c.load(a, toks(0), VALIDATE) is not None
    clock.t = 1.5 * HL
    assert c.load(b, toks(1), VALIDATE) is not None
    clock.t = 2 * HL
    # scores (hits+1)*tokens/bytes: C 1; A 2*0.25+1 = 1.5; B 2**-0.5+1 = 1.71 (A has more raw hits)
    d = put(c, 3)
    assert keys_on_disk(c) == {a, b, d} and cc not in keys_on_disk(c)
    info = {e.key: e for e in c.entries()}
    assert (info[a].hits, info[b].hits, info[d].hits) == (2, 1, 0)
    assert info[a].decayed_hits == pytest.approx(0.5) and info[b].decayed_hits == pytest.approx(2**-0.5)
    assert info[a].last_used == 0.0 and info[b].last_used == 1.5 * HL and info[d].last_used == 2 * HL
    for _ in range(3):
        c.load(d, toks(3), VALIDATE)
    e = put(c, 4)  # A (1.5) goes: B 1.71, D 4
    assert keys_on_disk(c) == {b, d, e}
    f = put(c, 5)  # E (never hit, 1.0) goes
    assert keys_on_disk(c) == {b, d, f}
    assert (c.stats().evictions, c.stats().saves, c.stats().refused_saves) == (3, 6, 0)
    c.close()


def test_protected_entries_are_never_evicted(tmp_path: Path) -> None:
    size = file_size()
    c = open_cache(tmp_path, budget=2 * size + size // 2)
    a, b = put(c, 0), put(c, 1)
    for _ in range(5):
        c.load(b, toks(1), VALIDATE)
    with c.protect(a):  # e.g. being restored: the lowest score, yet it stays
        cc = put(c, 2)
    assert keys_on_disk(c) == {a, cc}
    with c.protect(a), c.protect(cc):
        assert c.save(key_of(toks(3)), toks(3), make_snapshot(8))  # accepted, then no room
        c.flush()
    assert keys_on_disk(c) == {a, cc}
    s = c.stats()
    assert (s.evictions, s.refused_saves, s.saves) == (1, 1, 3)
    assert not c.save(key_of(toks(9)), toks(9), Snapshot(8, {"x": torch.zeros(1 << 20)}))
    assert c.stats().refused_saves == 2  # larger than the whole budget: refused before any copy
    c.close()


def test_other_namespaces_are_budgeted_and_reaped_first(tmp_path: Path) -> None:
    size = file_size()
    other = open_cache(tmp_path, ns=OTHER_NAMESPACE)
    o1, o2 = put(other, 0), put(other, 1)
    other.close()
    os.utime(other.path_for(o1), (1000, 1000))  # o1 is the older file
    os.utime(other.path_for(o2), (2000, 2000))

    clock = Clock()
    c = open_cache(tmp_path, budget=3 * size + size // 2, clock=clock)
    s = c.stats()
    assert (s.num_entries, s.bytes_by_namespace) == (2, {OTHER_NAMESPACE: 2 * size})
    assert c.load(key_of(toks(0), ns=OTHER_NAMESPACE), toks(0), VALIDATE) is None  # not ours: a miss
    a1 = put(c, 10)
    assert other.path_for(o1).exists() and other.path_for(o2).exists()
    clock.t += 1
    a2 = put(c, 11)
    assert not other.path_for(o1).exists() and other.path_for(o2).exists()
    clock.t += 1
    a3 = put(c, 12)
    assert not other.path_for(o2).exists()
    clock.t += 1
    a4 = put(c, 13)  # only ours left: equal scores, the least recently used (a1) goes
    assert keys_on_disk(c) == {a2, a3, a4} and a1 not in keys_on_disk(c)
    assert c.stats().bytes_by_namespace == {NAMESPACE: 3 * size}
    assert c.stats().evictions == 3
    c.close()


def test_free_disk_floor(tmp_path: Path) -> None:
    size = file_size()
    capacity = 4 * size

    def disk_free(root: Path) -> int:  # a small disk: its capacity minus the real files on it
        return capacity - sum(p.stat().st_size for p in root.rglob("*.safetensors"))

    c = open_cache(
        tmp_path, min_free_bytes=size + size // 2, disk_free=disk_free, block_bytes=1, index_slack=0
    )
    a, b = put(c, 0), put(c, 1)
    assert keys_on_disk(c) == {a, b}
    d = put(c, 2)  # 3 files would leave 1 size free < 1.5: the oldest goes
    assert keys_on_disk(c) == {b, d}
    assert c.stats().evictions == 1
    c.close()


def test_clear(tmp_path: Path) -> None:
    other = open_cache(tmp_path, ns=OTHER_NAMESPACE)
    put(other, 0)
    other.close()
    c = open_cache(tmp_path)
    a = put(c, 1)
    put(c, 2)
    c.load(a, toks(1), VALIDATE)
    assert c.clear() == 2
    assert c.stats().bytes_by_namespace == {OTHER_NAMESPACE: file_size()}
    assert c.clear(all_namespaces=True) == 1
    assert files(tmp_path, "*.safetensors") == []
    c.close()
    c2 = open_cache(tmp_path)
    assert c2.entries() == []
    c2.close()


# ---- writer queue and pending keys ---------------------------------------------------------


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


# ---- persistence and several processes ------------------------------------------------------


def test_hit_counts_survive_restart_and_merge_across_instances(tmp_path: Path) -> None:
    clock = Clock(100.0)
    c1 = open_cache(tmp_path, clock=clock)
    a, b = put(c1, 0), put(c1, 1)
    c2 = open_cache(tmp_path, clock=clock)  # a second process on the same folder
    c1.load(a, toks(0), VALIDATE)
    c1.load(a, toks(0), VALIDATE)
    clock.t = 200.0
    c2.load(a, toks(0), VALIDATE)
    c2.load(b, toks(1), VALIDATE)
    c1.close()
    c2.close()
    c3 = open_cache(tmp_path, clock=Clock(200.0))
    info = {e.key: e for e in c3.entries()}
    assert (info[a].hits, info[a].last_used, info[b].hits, info[b].last_used) == (3, 200.0, 1, 200.0)
    assert info[a].decayed_hits == pytest.approx(2 * 2 ** (-100 / HL) + 1)
    c3.close()
    with sqlite3.connect(tmp_path / "index.sqlite3") as db:  # one shared, transactional index
        rows = sorted(db.execute("SELECT key, hits FROM entries WHERE namespace=?", (NAMESPACE,)))
    assert rows == sorted([(a, 3), (b, 1)])
    assert not (tmp_path / NAMESPACE / "hits.log").exists()


def test_eviction_sees_another_instances_hits(tmp_path: Path) -> None:
    size = file_size()
    c1 = open_cache(tmp_path, budget=2 * size + size // 2)
    a, b = put(c1, 0), put(c1, 1)
    c2 = open_cache(tmp_path)
    for _ in range(3):
        c2.load(a, toks(0), VALIDATE)  # only c2 saw A's hits; c1 reads them from the index
    put(c1, 2)
    assert keys_on_disk(c1) == {a, key_of(toks(2))} and not c1.path_for(b).exists()
    c1.close()
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


def _run_worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_processes_saving_overlapping_keys_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    go = tmp_path / "go"
    root = tmp_path / "cache"
    procs = [
        _run_worker("save", str(root), NAMESPACE, "0", "20", str(go)),
        _run_worker("save", str(root), NAMESPACE, "10", "30", str(go)),
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"go.ready.{lo}").exists() for lo in (0, 10)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "workers did not start"
            )
            time.sleep(0.01)
        go.touch()  # both started: now they save at the same time
        stats = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            stats.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for s in stats:
        assert (s["hits"], s["misses"], s["rejected_by_reason"], s["write_errors"]) == (20, 0, {}, 0)
    assert stats[0]["saves"] + stats[1]["saves"] == 30  # each key published exactly once

    c = open_cache(root)
    assert files(root, "*.tmp") == []
    info = {e.key: e for e in c.entries()}
    assert len(info) == 30
    for i in range(30):
        tokens = entry_tokens(i)
        k = key_of(tokens)
        assert info[k].hits == (2 if 10 <= i < 20 else 1)
        snap = c.load(k, tokens, VALIDATE)
        assert snap is not None and same_bytes(snap, make_snapshot(len(tokens)))
    assert c.stats().rejected_by_reason == {}
    c.close()


def test_sigkill_mid_write_leaves_nothing_adoptable(tmp_path: Path) -> None:
    p = _run_worker("loop", str(tmp_path), NAMESPACE)
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


def test_bad_config_messages(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        DiskCache(tmp_path, NAMESPACE, budget_bytes=0, min_free_bytes=0)
    with pytest.raises(ValueError, match="namespace"):
        DiskCache(tmp_path, "../x", budget_bytes=1, min_free_bytes=0)
    with pytest.raises(ValueError, match="queue_size"):
        DiskCache(tmp_path, NAMESPACE, budget_bytes=1, min_free_bytes=0, queue_size=0)
    c = open_cache(tmp_path)
    with pytest.raises(ValueError, match="key"):
        c.load("../../etc", [1], VALIDATE)
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
