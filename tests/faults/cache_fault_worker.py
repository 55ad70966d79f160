"""A process using a shared DiskCache folder, for the disk cache fault tests.

cache_fault_worker.py loop ROOT BUDGET SEED
    saves entries SEED*10000, +1, ... forever (fsync on, 256 KiB each) under BUDGET bytes,
    loading earlier ones between saves (hits); prints "ready" once the first is published.
    Made to be SIGKILLed at any moment.
cache_fault_worker.py share ROOT BUDGET LO HI GO_FILE
    creates GO_FILE.ready.LO, waits for GO_FILE, saves entries LO..HI-1 under BUDGET bytes,
    loading earlier ones between saves, then prints its stats as JSON.
Entry i: key of `loop_tokens(i)`, snapshot `entry_snapshot(i)`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from cache_faults import NAMESPACE, geometry, make_snapshot, validator

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.namespace import prefix_key
from keepwarm.engine.cache.snapshot import Snapshot

POSITION, HEADS, DIM = 64, 8, 128  # k + v = 256 KiB per entry
VALIDATE = validator(geometry(heads=HEADS, dim=DIM))


def loop_tokens(i: int) -> list[int]:
    return [i, *range(POSITION - 1)]


def entry_key(i: int) -> str:
    return prefix_key(NAMESPACE, "", loop_tokens(i))


def entry_snapshot(i: int) -> Snapshot:
    return make_snapshot(POSITION, seed=i % 7, heads=HEADS, dim=DIM)


def _save_and_hit(cache: DiskCache, i: int, lo: int) -> None:
    while not cache.save(entry_key(i), loop_tokens(i), entry_snapshot(i), detached=True):
        if cache.contains(entry_key(i)):
            break
        cache.flush()  # queue full
    if i > lo:
        j = lo + (i * 7919) % (i - lo)
        cache.load(entry_key(j), loop_tokens(j), VALIDATE)  # a hit, or a miss when evicted


def loop(root: Path, budget: int, seed: int) -> None:
    cache = DiskCache(root, NAMESPACE, budget_bytes=budget, min_free_bytes=0, queue_size=2).start()
    i = lo = seed * 10000
    while True:
        _save_and_hit(cache, i, lo)
        if i == lo:
            cache.flush()
            print("ready", flush=True)
        i += 1


def share(root: Path, budget: int, lo: int, hi: int, go: Path) -> None:
    cache = DiskCache(
        root, NAMESPACE, budget_bytes=budget, min_free_bytes=0, queue_size=2, fsync=False
    ).start()
    go.with_name(f"{go.name}.ready.{lo}").touch()
    while not go.exists():
        time.sleep(0.005)
    for i in range(lo, hi):
        _save_and_hit(cache, i, lo)
    cache.flush()
    cache.close()
    print(json.dumps(dataclasses.asdict(cache.stats())), flush=True)


if __name__ == "__main__":
    mode, root_arg, budget_arg = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "loop":
        loop(root_arg, budget_arg, int(sys.argv[4]))
    elif mode == "share":
        share(root_arg, budget_arg, int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; use loop or share")
