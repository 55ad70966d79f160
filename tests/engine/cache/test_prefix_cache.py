"""The two-tier prefix cache: one hashing pass per admission (`probe`, then `read`), and what
it reads from the disk tier to explain a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_fixtures import NAMESPACE, make_snapshot, validator

from keepwarm.engine.cache import prefix_cache as prefix_cache_module
from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.memory_cache import MemoryCache
from keepwarm.engine.cache.prefix_cache import Lookup, PrefixCache, SessionHint
from keepwarm.engine.cache.prefix_key import prefix_key
from keepwarm.engine.cache.snapshot_file import write_snapshot

SALT = "tenant-a"
STORED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # the entry's key tokens
PROMPT = [7, 8, 9, 10, 99, 98, 97, 96, 95, 94, 93, 92]  # leaves STORED at position 4


def _cache(root: Path) -> tuple[PrefixCache, DiskCache]:
    disk = DiskCache(root, NAMESPACE, budget_bytes=1 << 30, min_free_bytes=0, fsync=False).start()
    return PrefixCache(NAMESPACE, None, disk, validator()), disk


def _find(cache: PrefixCache, key: str) -> Lookup:
    return cache.read(cache.probe(SALT, PROMPT, [], SessionHint(key, len(STORED)), min_tokens=1))


def test_a_miss_is_explained_from_an_entry_in_a_real_shard_folder(tmp_path: Path) -> None:
    """The control: the same file in a real shard folder is read."""
    root = tmp_path / "cache"
    cache, disk = _cache(root)
    try:
        key = prefix_key(NAMESPACE, SALT, STORED)
        shard = root / NAMESPACE / key[:2]
        shard.mkdir(parents=True)
        path = shard / f"{key}.safetensors"
        write_snapshot(
            path, namespace=NAMESPACE, key=key, tokens=STORED, snapshot=make_snapshot(8), fsync=False
        )
        assert cache.stored_tokens(key) == STORED
        assert _find(cache, key) == Lookup(None, 4)
    finally:
        disk.close()


def test_a_symlinked_shard_folder_is_never_read(tmp_path: Path) -> None:
    """A shard folder below the cache root that is a link to elsewhere: the entry file
    behind it is valid (namespace, key, checksums), yet neither `stored_tokens` nor the
    divergence position of a lookup may come from it."""
    root = tmp_path / "cache"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    cache, disk = _cache(root)
    try:
        key = prefix_key(NAMESPACE, SALT, STORED)
        target = outside / f"{key}.safetensors"
        size = write_snapshot(
            target, namespace=NAMESPACE, key=key, tokens=STORED, snapshot=make_snapshot(8), fsync=False
        )
        (root / NAMESPACE).mkdir(parents=True)
        (root / NAMESPACE / key[:2]).symlink_to(outside, target_is_directory=True)
        assert (root / NAMESPACE / key[:2] / f"{key}.safetensors").is_file()  # reachable through the link
        assert disk.stored_tokens(key) is None
        assert cache.stored_tokens(key) is None
        assert _find(cache, key) == Lookup(None, None)
        assert target.stat().st_size == size  # left alone
    finally:
        disk.close()


def test_a_probe_hashes_the_prompt_once_and_its_read_finds_the_deepest_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's estimate (`depth`, by key alone) and the admission's read share one
    hashing pass of the prompt's candidate prefixes."""
    cache = PrefixCache(NAMESPACE, MemoryCache(1 << 30), None, validator())
    cache.save(SALT, PROMPT[:4], make_snapshot(4))
    cache.save(SALT, PROMPT[:8], make_snapshot(8))
    cache.save("another-tenant", PROMPT, make_snapshot(len(PROMPT)))
    passes = []
    inner = prefix_cache_module.prefix_keys

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        passes.append(args)
        return inner(*args, **kwargs)

    monkeypatch.setattr(prefix_cache_module, "prefix_keys", counted)
    probe = cache.probe(SALT, PROMPT, [4], None, min_tokens=1)
    assert probe.depth == 8 and probe.lengths[0] == len(PROMPT)
    found = cache.read(probe)
    assert found.hit is not None and found.hit.num_key_tokens == 8 and found.hit.source == "memory"
    assert len(passes) == 1
    assert cache.probe("nobody", PROMPT, [4], None, min_tokens=1).depth == 0
