"""Shared pieces of the disk cache fault tests (tests/faults/test_cache_*.py) and their
worker process (cache_fault_worker.py): synthetic snapshots, keys, a cache opener (either
index backend), and a flush that fails instead of hanging when the writer thread is dead."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "cache"))

from snapshot_fixtures import (  # noqa: E402
    NAMESPACE,
    OTHER_NAMESPACE,
    forge_header,
    geometry,
    make_snapshot,
    same_bytes,
    validator,
)

from keepwarm.engine.cache.disk_cache import DiskCache  # noqa: E402
from keepwarm.engine.cache.prefix_key import prefix_key  # noqa: E402

__all__ = [
    "NAMESPACE",
    "OTHER_NAMESPACE",
    "VALIDATE",
    "forge_header",
    "geometry",
    "make_snapshot",
    "same_bytes",
    "validator",
]

VALIDATE = validator()


def toks(i: int, n: int = 10) -> list[int]:
    return [100 * i + j for j in range(n)]


def key_of(tokens: list[int], ns: str = NAMESPACE) -> str:
    return prefix_key(ns, "", tokens)


def index_args(url: str | None) -> dict[str, Any]:
    """DiskCache arguments for the index backend: SQLite without a URL, else Valkey at `url`."""
    return {"index": "redis", "index_url": url} if url else {}


def open_cache(
    root: Path, *, ns: str = NAMESPACE, budget: int = 1 << 30, index_url: str | None = None, **kw: object
) -> DiskCache:
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("fsync", False)
    kw.update(index_args(index_url))
    return DiskCache(root, ns, budget_bytes=budget, **kw).start()  # type: ignore[arg-type]


def flush(cache: DiskCache, timeout: float = 30.0) -> None:
    """cache.flush(), failing (not hanging) when the writer thread has died."""
    t = threading.Thread(target=cache.flush, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the writer thread stopped: queued saves are never written"


def put(cache: DiskCache, i: int, *, position: int = 8, n: int = 10) -> str:
    tokens = toks(i, n)
    key = key_of(tokens, cache.namespace)
    assert cache.save(key, tokens, make_snapshot(position, seed=i))
    flush(cache)
    return key
