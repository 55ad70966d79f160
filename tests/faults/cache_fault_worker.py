"""A process using a shared DiskCache folder, for the disk cache fault tests.

cache_fault_worker.py loop ROOT BUDGET SEED
    saves entries SEED*10000, +1, ... forever (fsync on, 256 KiB each) under BUDGET bytes,
    loading earlier ones between saves (hits); prints "ready" once the first is published.
    Made to be SIGKILLed at any moment.
cache_fault_worker.py share ROOT BUDGET LO HI GO_FILE
    creates GO_FILE.ready.LO, waits for GO_FILE, saves entries LO..HI-1 under BUDGET bytes,
    loading earlier ones between saves, then prints its stats as JSON.
Entry i: key of `loop_tokens(i)`, snapshot `entry_snapshot(i)`.

Environment: CACHE_FAULT_INDEX_URL, when set, puts the index in that Valkey (--cache-index
redis) instead of SQLite. CACHE_FAULT_HANG_MID_EVICTION=MARKER makes the first eviction this
process claims delete its first victim's file, write the claimed (namespace, key) pairs to
MARKER and hang there (every victim's row still EVICTING, the others' files still on disk),
for a test to SIGKILL it mid-eviction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from cache_faults import NAMESPACE, geometry, index_args, make_snapshot, validator

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.index import Row
from keepwarm.engine.cache.index_protocol import Index
from keepwarm.engine.cache.prefix_key import prefix_key
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import unlink_if_ours

POSITION, HEADS, DIM = 64, 8, 128  # k + v = 256 KiB per entry
VALIDATE = validator(geometry(heads=HEADS, dim=DIM))


def loop_tokens(i: int) -> list[int]:
    return [i, *range(POSITION - 1)]


def entry_key(i: int) -> str:
    return prefix_key(NAMESPACE, "", loop_tokens(i))


def entry_snapshot(i: int) -> Snapshot:
    return make_snapshot(POSITION, seed=i % 7, heads=HEADS, dim=DIM)


INDEX = index_args(os.environ.get("CACHE_FAULT_INDEX_URL") or None)


def _hang_mid_eviction(marker: Path) -> None:
    """The first claimed eviction deletes its first victim's file, then hangs before the
    others' files and before the index forgets any of them."""
    delete = DiskCache._delete_claimed

    def delete_one_then_hang(
        self: DiskCache, idx: Index, victims: Sequence[Row], *, count: bool = True
    ) -> int:
        if not victims:
            return delete(self, idx, victims, count=count)
        v = victims[0]
        unlink_if_ours(self.root / v.namespace / v.key[:2] / f"{v.key}.safetensors", root=self.root)
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(json.dumps([[r.namespace, r.key] for r in victims]))
        os.replace(tmp, marker)  # whole, or not there yet
        threading.Event().wait()  # until SIGKILL
        return 0

    DiskCache._delete_claimed = delete_one_then_hang  # type: ignore[method-assign]


def _save_and_hit(cache: DiskCache, i: int, lo: int) -> None:
    while not cache.save(entry_key(i), loop_tokens(i), entry_snapshot(i), detached=True):
        if cache.contains(entry_key(i)):
            break
        cache.flush()  # queue full
    if i > lo:
        j = lo + (i * 7919) % (i - lo)
        cache.load(entry_key(j), loop_tokens(j), VALIDATE)  # a hit, or a miss when evicted


def loop(root: Path, budget: int, seed: int) -> None:
    cache = DiskCache(root, NAMESPACE, budget_bytes=budget, min_free_bytes=0, queue_size=2, **INDEX).start()
    i = lo = seed * 10000
    while True:
        _save_and_hit(cache, i, lo)
        if i == lo:
            cache.flush()
            print("ready", flush=True)
        i += 1


def share(root: Path, budget: int, lo: int, hi: int, go: Path) -> None:
    cache = DiskCache(
        root,
        NAMESPACE,
        budget_bytes=budget,
        min_free_bytes=0,
        queue_size=2,
        fsync=False,
        **INDEX,  # type: ignore[arg-type]
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
    if os.environ.get("CACHE_FAULT_HANG_MID_EVICTION"):
        _hang_mid_eviction(Path(os.environ["CACHE_FAULT_HANG_MID_EVICTION"]))
    mode, root_arg, budget_arg = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "loop":
        loop(root_arg, budget_arg, int(sys.argv[4]))
    elif mode == "share":
        share(root_arg, budget_arg, int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; use loop or share")
