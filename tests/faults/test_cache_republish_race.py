"""A row is dropped only as the publication it was read as: when another process evicts an
entry and saves it again between a check that found its file gone and the drop, the new row
stays (else the new file lives on without a row, outside the budget, until a reconcile finds
it: the many-writers test once saw 11 files under a budget of 10.5). With either index
backend. The race is made deterministic: the evict-and-save runs inside the existence check."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_faults import NAMESPACE, VALIDATE, key_of, open_cache, put, toks

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.reconcile import FolderScan


def _republish_inside_lexists(
    monkeypatch: pytest.MonkeyPatch, other: DiskCache, path: Path, i: int
) -> list[Path]:
    """os.path.lexists(path), the first time, has `other` evict entry i and save it again,
    then answers what it saw in between: no file."""
    real = os.path.lexists
    raced: list[Path] = []

    def lexists(p: str | os.PathLike[str]) -> bool:
        if Path(p) == path and not raced:
            raced.append(path)
            other.clear()
            assert not real(path) and not other.entries()
            put(other, i)
            return False
        return real(p)

    monkeypatch.setattr(os.path, "lexists", lexists)
    return raced


Two = tuple[DiskCache, DiskCache, str, Path]  # two processes' caches on one folder, b's entry 1


@pytest.fixture
def two(tmp_path: Path, cache_index_url: str | None) -> Iterator[Two]:
    root = tmp_path / "cache"
    a = open_cache(root, index_url=cache_index_url)
    b = open_cache(root, index_url=cache_index_url)
    key = put(b, 1)
    yield a, b, key, b.path_for(key)
    a.close()
    b.close()


def _live_keys(cache: DiskCache) -> set[str]:
    return {e.key for e in cache.entries()}


def test_reconcile_keeps_a_row_published_again_after_its_walk(
    two: Two, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, key, path = two
    old = {e.key: e.created for e in b.entries()}[key]
    walk = a._scan

    def walk_before_the_publish() -> FolderScan:  # the file appeared just after the walk
        out = walk()
        del out.files[(NAMESPACE, key)]
        return out

    monkeypatch.setattr(a, "_scan", walk_before_the_publish)
    raced = _republish_inside_lexists(monkeypatch, b, path, 1)
    a._reconcile(clean_tmp=False)
    monkeypatch.undo()

    assert raced == [path] and path.exists()
    (entry,) = a.entries()
    assert entry.key == key and entry.created != old  # the new publication's row
    assert entry.bytes == path.stat().st_size


def test_a_load_that_found_no_file_keeps_a_row_published_again_meanwhile(
    two: Two, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, key, path = two
    os.unlink(path)  # gone by hand: a's load misses and looks for the row to drop
    raced = _republish_inside_lexists(monkeypatch, b, path, 1)
    assert a.load(key, toks(1), VALIDATE) is None
    monkeypatch.undo()

    assert path.exists()
    assert raced == [path] and _live_keys(a) == {key}
    assert a.load(key, toks(1), VALIDATE) is not None


def test_a_row_whose_file_was_deleted_by_hand_is_still_dropped(
    tmp_path: Path, cache_index_url: str | None
) -> None:
    root = tmp_path / "cache"
    a = open_cache(root, index_url=cache_index_url)
    keys = [put(a, i) for i in range(3)]
    os.unlink(a.path_for(keys[0]))
    assert a.load(keys[0], toks(0), VALIDATE) is None
    assert _live_keys(a) == set(keys[1:])
    os.unlink(a.path_for(keys[1]))
    a._reconcile(clean_tmp=False)
    assert _live_keys(a) == {keys[2]} == {key_of(toks(2))}
    a.close()
