"""Eviction (eviction.py): decayed-hit order, protected entries, other namespaces budgeted and
reaped first, the free-space floor, and hits another instance counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_fixtures import (
    HL,
    VALIDATE,
    Clock,
    file_size,
    key_of,
    keys_on_disk,
    open_cache,
    put,
    toks,
)
from snapshot_fixtures import (
    NAMESPACE,
    OTHER_NAMESPACE,
    make_snapshot,
)

from keepwarm.engine.cache.snapshot import Snapshot


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
