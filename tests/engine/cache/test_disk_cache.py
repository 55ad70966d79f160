"""The disk tier's API (disk_cache.py): round trip and layout, keys and salts, rejection of
bad files, clearing, settings, and hit counts and saves shared by several processes."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from disk_cache_worker import entry_tokens
from disk_fixtures import (
    HL,
    VALIDATE,
    Clock,
    file_size,
    files,
    key_of,
    open_cache,
    put,
    run_worker,
    toks,
)
from snapshot_fixtures import (
    NAMESPACE,
    OTHER_NAMESPACE,
    forge_header,
    geometry,
    make_snapshot,
    same_bytes,
    validator,
)

from keepwarm.engine.cache.disk_cache import DiskCache, DiskCacheStats
from keepwarm.engine.cache.snapshot_file import write_snapshot


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


def test_two_processes_saving_overlapping_keys_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    go = tmp_path / "go"
    root = tmp_path / "cache"
    procs = [
        run_worker("save", str(root), NAMESPACE, "0", "20", str(go)),
        run_worker("save", str(root), NAMESPACE, "10", "30", str(go)),
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
