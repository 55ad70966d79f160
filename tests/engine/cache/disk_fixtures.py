"""Helpers the disk-tier tests share (test_disk_cache.py, test_writer.py, test_eviction.py,
test_reconcile.py): a settable clock, test entries and their keys and sizes, opening a cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from snapshot_fixtures import (
    NAMESPACE,
    make_snapshot,
    validator,
)

from keepwarm.engine.cache.disk_cache import HALF_LIFE_S, DiskCache
from keepwarm.engine.cache.prefix_key import prefix_key
from keepwarm.engine.cache.snapshot_file import encode_snapshot

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


def run_worker(*args: str) -> subprocess.Popen[str]:
    """The worker script (disk_cache_worker.py) in a new process, its output piped."""
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
