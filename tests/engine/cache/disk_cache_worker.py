"""A separate process using a DiskCache folder, for the disk-tier tests (test_disk_cache.py, test_writer.py).

disk_cache_worker.py save ROOT NAMESPACE LO HI GO_FILE
    creates GO_FILE.ready.LO, waits for GO_FILE, saves entries LO..HI-1 (fsync on; a key the other
    process is writing is left to it), flushes, waits until each is published, loads each back
    (one hit per key), prints its stats as JSON.
disk_cache_worker.py loop ROOT NAMESPACE
    saves large entries 0, 1, 2, ... forever, one at a time (to be SIGKILLed);
    prints "ready" once the first is on disk.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from snapshot_fixtures import make_snapshot, validator

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.prefix_key import prefix_key

LOOP_POSITION, LOOP_HEADS, LOOP_DIM = 1024, 8, 128  # k + v = 4 MiB per entry


def entry_tokens(i: int) -> list[int]:
    """Entry i: a 6+i token prompt whose snapshot covers all of it (seed 0)."""
    return [1000 + j for j in range(6 + i)]


def loop_tokens(i: int) -> list[int]:
    return [i] * LOOP_POSITION


def save_range(root: Path, namespace: str, lo: int, hi: int, go: Path) -> None:
    cache = DiskCache(root, namespace, budget_bytes=1 << 30, min_free_bytes=0, queue_size=2).start()
    go.with_name(f"{go.name}.ready.{lo}").touch()
    while not go.exists():
        time.sleep(0.005)
    for i in range(lo, hi):
        tokens = entry_tokens(i)
        key = prefix_key(namespace, "", tokens)
        snap = make_snapshot(len(tokens))
        while not cache.save(key, tokens, snap) and not cache.contains(key):
            cache.flush()  # queue full: wait for the writer, then retry
    cache.flush()
    validate = validator()
    for i in range(lo, hi):
        tokens = entry_tokens(i)
        key = prefix_key(namespace, "", tokens)
        deadline = time.monotonic() + 60
        while not cache.path_for(key).exists():  # the other process may still be writing it
            assert time.monotonic() < deadline, f"entry {i} never published"
            time.sleep(0.005)
        assert cache.load(key, tokens, validate) is not None, i
    cache.close()
    print(json.dumps(dataclasses.asdict(cache.stats())), flush=True)


def loop(root: Path, namespace: str) -> None:
    cache = DiskCache(root, namespace, budget_bytes=1 << 40, min_free_bytes=0, queue_size=1).start()
    snap = make_snapshot(LOOP_POSITION, heads=LOOP_HEADS, dim=LOOP_DIM)  # same bytes under every key
    i = 0
    while True:
        tokens = loop_tokens(i)
        assert cache.save(prefix_key(namespace, "", tokens), tokens, snap, detached=True)
        cache.flush()
        if i == 0:
            print("ready", flush=True)
        i += 1


if __name__ == "__main__":
    mode, root, ns = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if mode == "save":
        save_range(root, ns, int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    elif mode == "loop":
        loop(root, ns)
    else:
        raise SystemExit(f"unknown mode {mode!r}; use save or loop")
