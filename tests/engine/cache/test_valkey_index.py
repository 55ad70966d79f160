"""The Valkey index (valkey_index.py) beyond what both backends share (test_index.py): the
folder's id and key namespacing, garbage rows, and a disk cache that serves on while its
Valkey is down. Against a real valkey-server (tests/api/procs.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from snapshot_fixtures import NAMESPACE, make_snapshot, same_bytes, validator

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.index import LIVE, IndexUnusable, Row
from keepwarm.engine.cache.index_protocol import IndexDown
from keepwarm.engine.cache.prefix_key import prefix_key
from keepwarm.engine.cache.valkey_index import ID_NAME, ValkeyIndex, encode_row, folder_id, redacted
from tests.api.procs import Proc, free_port, start_valkey

NS = "ns-valkey-01"
VALIDATE = validator()


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[Proc]:
    proc = start_valkey(tmp_path / "valkey", persist=True)
    yield proc
    proc.stop()


def live(key: str, nbytes: int = 100) -> Row:
    return Row(NS, key, 10, 8, nbytes, 1000.0)


def toks(i: int) -> list[int]:
    return [100 * i + j for j in range(10)]


def save(cache: DiskCache, i: int) -> str:
    key = prefix_key(NAMESPACE, "", toks(i))
    assert cache.save(key, toks(i), make_snapshot(8, seed=i))
    cache.flush()
    return key


def open_cache(root: Path, url: str, budget: int = 1 << 30) -> DiskCache:
    return DiskCache(
        root, NAMESPACE, budget_bytes=budget, min_free_bytes=0, fsync=False, index="redis", index_url=url
    ).start()


def test_each_folder_has_its_own_keys_and_one_id_for_all_its_users(tmp_path: Path, valkey: Proc) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    a = ValkeyIndex(one, owner="a", url=valkey.url)
    b = ValkeyIndex(one, owner="b", url=valkey.url)  # another process (or host) on the same folder
    c = ValkeyIndex(two, owner="c", url=valkey.url)
    try:
        assert a.folder_id == b.folder_id == (one / ID_NAME).read_text().strip()
        assert c.folder_id != a.folder_id
        a.insert([live("key-0001")])
        assert b.get(NS, "key-0001") == live("key-0001")
        assert c.get(NS, "key-0001") is None and c.usage().committed_bytes == 0
        keys = set(redis.Redis.from_url(valkey.url, decode_responses=True).keys("*"))
        assert keys and all(k.startswith(f"keepwarm:cache:{{{a.folder_id}}}:") for k in keys)
        assert [p.name for p in one.iterdir()] == [ID_NAME]  # no temp file left behind
    finally:
        for idx in (a, b, c):
            idx.close()


def test_an_id_file_that_is_a_link_or_garbage_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("0" * 32)
    root = tmp_path / "cache"
    root.mkdir()
    (root / ID_NAME).symlink_to(target)
    with pytest.raises(IndexUnusable, match=ID_NAME):
        folder_id(root)
    (root / ID_NAME).unlink()
    (root / ID_NAME).write_text("not an id\n")
    with pytest.raises(IndexUnusable, match="32 hex digits"):
        folder_id(root)


def test_garbage_rows_are_skipped_counted_and_dropped(tmp_path: Path, valkey: Proc) -> None:
    idx = ValkeyIndex(tmp_path, owner="a", url=valkey.url)
    try:
        idx.insert([live("key-0001"), live("key-0002")])
        raw = redis.Redis.from_url(valkey.url, decode_responses=True)
        rows_key = f"{idx.prefix}:rows:{NS}"
        raw.hset(rows_key, "key-0002", "[1, 2, not json")
        raw.hset(rows_key, "bad/key", encode_row(live("key-0003")))  # a name no path may have
        rows, bad = idx.all_rows()
        assert [r.key for r in rows] == ["key-0001"] and bad == 2
        assert idx.get(NS, "key-0002") is None
        claim = idx.claim(
            namespace=NS,
            reserve=None,
            incoming=0,
            budget=150,  # 200 committed (key-0002's bytes were counted before it went bad)
            floor_deficit=-(1 << 62),
            protected=frozenset(),
            now=2000.0,
            wall=2000.0,
            half_life=3600.0,
        )
        assert claim.status == "ok" and [v.key for v in claim.victims] == ["key-0001"]  # never garbage
        assert idx.drop_garbage() == 2
        assert idx.all_rows()[1] == 0 and raw.hget(rows_key, "key-0002") is None
        assert idx.usage().committed_bytes == 0  # counted again: key-0001 is being evicted
    finally:
        idx.close()


def test_a_password_never_shows_in_messages() -> None:
    assert redacted("redis://user:hunter2@valkey:6379/1") == "redis://user:***@valkey:6379/1"
    assert "hunter2" not in redacted("redis://:hunter2@valkey:6379/1")
    assert redacted("redis://valkey:6379/1") == "redis://valkey:6379/1"


def test_opening_without_a_server_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(IndexDown, match="--cache-index-url"):
        ValkeyIndex(tmp_path, owner="a", url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)


def test_two_caches_share_entries_and_adopt_files_the_server_never_saw(tmp_path: Path, valkey: Proc) -> None:
    root = tmp_path / "cache"
    sqlite_era = DiskCache(root, NAMESPACE, budget_bytes=1 << 30, min_free_bytes=0, fsync=False).start()
    old = save(sqlite_era, 1)  # written under the SQLite index
    sqlite_era.close()
    a = open_cache(root, valkey.url)
    b = open_cache(root, valkey.url)
    try:
        assert a.contains(old)  # indexed from its header by a's start
        new = save(a, 2)
        assert b.contains(new) and {e.key for e in b.entries()} == {old, new}
        snap = b.load(new, toks(2), VALIDATE)
        assert snap is not None and same_bytes(snap, make_snapshot(8, seed=2))
        assert {e.key: e.hits for e in a.entries()}[new] == 1  # b's hit, seen by a
        assert a.stats().errors_by_kind == {} and b.stats().errors_by_kind == {}
    finally:
        a.close()
        b.close()


def test_the_disk_cache_serves_on_while_valkey_is_down(tmp_path: Path, valkey: Proc) -> None:
    root = tmp_path / "cache"
    cache = open_cache(root, valkey.url)
    try:
        stored = save(cache, 1)
        port = int(valkey.url.rsplit(":", 1)[1].split("/")[0])
        valkey.stop()
        # reads: the file's presence; no probes; a load still reads the file
        assert cache.contains(stored)
        assert cache.known_lengths() == set()
        snap = cache.load(stored, toks(1), VALIDATE)
        assert snap is not None and same_bytes(snap, make_snapshot(8, seed=1))
        # a write needs the index (the budget): refused and counted, the writer thread lives on
        key2 = prefix_key(NAMESPACE, "", toks(2))
        assert cache.save(key2, toks(2), make_snapshot(8, seed=2))
        cache.flush()
        assert not cache.path_for(key2).exists()
        s = cache.stats()
        assert s.write_errors == 1 and s.errors_by_kind.get("write:IndexDown") == 1
        assert s.errors_by_kind.get("index:IndexDown", 0) >= 1
        # Valkey back on its port with its data: the same cache writes again
        back = start_valkey(tmp_path / "valkey", port=port, persist=True)
        try:
            key3 = prefix_key(NAMESPACE, "", toks(3))
            for _ in range(200):  # the index fails fast for a few seconds after an error
                if cache.save(key3, toks(3), make_snapshot(8, seed=3)):
                    cache.flush()
                if cache.path_for(key3).exists():
                    break
                time.sleep(0.1)
            assert cache.path_for(key3).exists()
            assert {e.key for e in cache.entries()} >= {stored, key3}
            assert all(r.state == LIVE for r in cache._ridx().rows())
        finally:
            cache.close()
            back.stop()
    finally:
        cache.close()  # a second close is a no-op
