"""The disk cache on a small real volume: a 4 MiB tmpfs mounted for the test (issue 16:
"a cache on a small disk never saves anything and logs nothing; on a full disk every
failed save logs a full traceback and nothing is evicted to make room")."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_fault_worker import VALIDATE, entry_key, entry_snapshot, loop_tokens
from cache_faults import NAMESPACE, flush, same_bytes

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.eviction import default_min_free
from keepwarm.engine.config import config_from

SIZE = 4 << 20
ENTRY = 256 << 10


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; run the fault suite as root (ops/test does in CI)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _save(c: DiskCache, i: int) -> bool:
    ok = c.save(entry_key(i), loop_tokens(i), entry_snapshot(i), detached=True)
    flush(c)
    return ok


def _verify_all(c: DiskCache) -> int:
    keys = {e.key for e in c.entries()}
    found = 0
    for i in range(100):
        if entry_key(i) in keys:
            snap = c.load(entry_key(i), loop_tokens(i), VALIDATE)
            assert snap is not None and same_bytes(snap, entry_snapshot(i)), i
            found += 1
    assert found == len(keys)
    return found


def test_the_default_floor_lets_a_small_disk_cache(small_disk: Path) -> None:
    cfg = config_from(env={"KEEPWARM_MODEL": "/models/x", "KEEPWARM_CACHE_DIR": str(small_disk)})
    c = DiskCache(
        small_disk, NAMESPACE, budget_bytes=cfg.disk_budget, min_free_bytes=cfg.min_free_disk
    ).start()
    assert c.min_free_bytes == default_min_free(SIZE) == SIZE // 20
    for i in range(24):  # 6 MiB of entries through a 4 MiB disk
        assert _save(c, i)
        assert shutil.disk_usage(small_disk).free >= c.min_free_bytes
    s = c.stats()
    assert (
        s.saves == 24
        and s.evictions >= 10
        and (s.refused_for_space, s.enospc, s.errors_by_kind) == (0, 0, {})
    )
    assert _verify_all(c) == 24 - s.evictions
    c.close()


def test_saves_refused_for_space_are_logged_once_and_counted(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = DiskCache(small_disk, NAMESPACE, budget_bytes=1 << 30, min_free_bytes=1 << 20).start()
    ballast = small_disk / "ballast.bin"  # not the cache's: it fills the disk and is never touched
    ballast.write_bytes(b"\0" * (SIZE - (1 << 20) - ENTRY))
    with caplog.at_level(logging.WARNING, logger="keepwarm.engine.cache.disk_cache"):
        for i in range(5):
            _save(c, i)
    s = c.stats()
    assert (s.saves, s.refused_for_space, s.refused_saves) == (0, 5, 5)
    said = [r.getMessage() for r in caplog.records if "not saving" in r.getMessage()]
    assert len(said) == 1 and "floor" in said[0]
    assert ballast.stat().st_size == SIZE - (1 << 20) - ENTRY
    c.close()


def test_a_full_disk_makes_room_by_eviction_before_giving_up(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The free-space figure lies (a volume shared with others, quotas): only ENOSPC tells.
    c = DiskCache(
        small_disk,
        NAMESPACE,
        budget_bytes=1 << 30,
        min_free_bytes=1,
        disk_free=lambda _: 1 << 40,
        fsync=False,
    ).start()
    with caplog.at_level(logging.WARNING, logger="keepwarm.engine.cache.disk_cache"):
        for i in range(30):  # 7.5 MiB through a 4 MiB disk
            assert _save(c, i)
    s = c.stats()
    assert s.enospc >= 1 and s.evictions >= 10
    assert (s.saves, s.write_errors, s.refused_for_space, s.errors_by_kind) == (30, 0, 0, {})
    assert _verify_all(c) == 30 - s.evictions
    assert not [r for r in caplog.records if r.exc_info]  # no traceback per failed save
    c.close()
