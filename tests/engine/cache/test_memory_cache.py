"""The RAM tier: byte-budgeted LRU of detached snapshots."""

from __future__ import annotations

import pytest
import torch
from snapshot_fixtures import make_snapshot, same_bytes

from keepwarm.engine.cache.memory_cache import MemoryCache, MemoryCacheStats

# make_snapshot(p): k and v p*2*8 bf16 (32p B each) + state 64 B + logits 1200 B
SIZE_4 = 2 * 32 * 4 + 64 + 1200  # 1520
SIZE_8 = 2 * 32 * 8 + 64 + 1200  # 1776


def test_sizes_are_what_the_budget_counts() -> None:
    assert make_snapshot(4).num_bytes == SIZE_4 and make_snapshot(8).num_bytes == SIZE_8


def test_lru_eviction_order_and_stats() -> None:
    cache = MemoryCache(budget_bytes=3 * SIZE_4)
    for i, key in enumerate("abc"):
        assert cache.put(key, list(range(4)), make_snapshot(4, seed=i))
    assert cache.get("a") is not None  # a becomes most recent: b is now the LRU
    assert cache.put("d", list(range(4)), make_snapshot(4, seed=3))
    assert cache.keys() == ["c", "a", "d"]
    assert cache.get("b") is None
    assert cache.put("e", list(range(8)), make_snapshot(8))  # needs two slots' worth: evicts c and a
    assert cache.keys() == ["d", "e"]
    assert cache.stats() == MemoryCacheStats(
        entries=2, bytes=SIZE_4 + SIZE_8, budget_bytes=3 * SIZE_4, hits=1, misses=1, evictions=3, refused=0
    )


def test_oversized_entry_is_refused_without_flushing_the_cache() -> None:
    cache = MemoryCache(budget_bytes=SIZE_4)
    assert cache.put("a", [1, 2, 3, 4], make_snapshot(4))
    assert not cache.put("big", list(range(8)), make_snapshot(8))
    assert cache.keys() == ["a"]
    s = cache.stats()
    assert (s.refused, s.evictions, s.entries, s.bytes) == (1, 0, 1, SIZE_4)


def test_get_returns_tokens_and_a_detached_copy() -> None:
    cache = MemoryCache(budget_bytes=10_000)
    live = make_snapshot(4)
    expected = make_snapshot(4)
    tokens = [9, 8, 7, 6]
    cache.put("a", tokens, live)
    live.tensors["layers.0.k"].fill_(0)  # the engine keeps decoding into its live state
    tokens.append(5)
    got = cache.get("a")
    assert got is not None
    got_tokens, snap = got
    assert got_tokens == [9, 8, 7, 6]
    assert same_bytes(snap, expected)
    got_tokens.append(1)  # the caller's list is its own
    assert cache.get("a")[0] == [9, 8, 7, 6]  # type: ignore[index]


def test_detached_put_stores_the_given_snapshot_and_reput_only_refreshes() -> None:
    cache = MemoryCache(budget_bytes=10_000)
    snap = make_snapshot(4)
    cache.put("a", [1, 2, 3, 4], snap, detached=True)
    cache.put("b", [1, 2, 3, 4], make_snapshot(4, seed=1))
    assert cache.get("a")[1] is snap  # type: ignore[index]
    assert cache.put("b", [1, 2, 3, 4], make_snapshot(4, seed=2))
    assert cache.keys() == ["a", "b"]
    assert cache.stats().bytes == 2 * SIZE_4
    assert torch.equal(
        cache.get("b")[1].tensors["layers.0.state"], make_snapshot(4, seed=1).tensors["layers.0.state"]
    )  # type: ignore[index]


def test_remove_clear_and_bad_config() -> None:
    cache = MemoryCache(budget_bytes=10_000)
    cache.put("a", [1, 2, 3, 4], make_snapshot(4))
    assert "a" in cache and len(cache) == 1
    assert cache.remove("a") and not cache.remove("a")
    assert cache.stats().bytes == 0
    cache.put("b", [1, 2, 3, 4], make_snapshot(4))
    cache.clear()
    assert len(cache) == 0 and cache.stats().bytes == 0
    with pytest.raises(ValueError, match="covers 4 positions but the key has 3"):
        cache.put("c", [1, 2, 3], make_snapshot(4))
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        MemoryCache(-1)


def test_token_counts_and_tokens_do_not_count_hits_or_reorder() -> None:
    m = MemoryCache(budget_bytes=10**9)
    m.put("a", [1, 2, 3], make_snapshot(3))
    m.put("b", [4, 5, 6, 7, 8], make_snapshot(5))
    before = m.stats()
    assert m.token_counts() == {3, 5}
    assert m.tokens("a") == [1, 2, 3] and m.tokens("zz") is None
    assert m.stats() == before  # no hit, no miss
    assert m.keys() == ["a", "b"]  # "a" was not moved to most recently used
