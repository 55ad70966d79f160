"""The cache folder is the cache's alone (issue 16): links are never followed, nothing that
is not a snapshot file the cache wrote is ever deleted, and folders, FIFOs or foreign
files named like snapshots are skipped and counted, never fatal: not at start, not in the
writer thread."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from cache_faults import (
    NAMESPACE,
    OTHER_NAMESPACE,
    VALIDATE,
    flush,
    key_of,
    make_snapshot,
    open_cache,
    put,
    toks,
)
from safetensors.torch import save_file

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.snapshot_file import encode_snapshot, write_snapshot


def _models(tmp_path: Path) -> tuple[Path, bytes]:
    """A models folder holding a real checkpoint file: what must never be deleted."""
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    weights = models / "tiny" / "model.safetensors"
    save_file({"w": torch.arange(256, dtype=torch.float32)}, str(weights))
    return weights, weights.read_bytes()


def _entry_size() -> int:
    return encode_snapshot(
        namespace=NAMESPACE, key="0" * 32, tokens=toks(0), snapshot=make_snapshot(8), created=time.time()
    ).size


def test_a_link_to_a_models_folder_survives_eviction(tmp_path: Path) -> None:
    weights, content = _models(tmp_path)
    root = tmp_path / "cache"
    root.mkdir()
    (root / "modelslink").symlink_to(tmp_path / "models", target_is_directory=True)  # named like a namespace
    c = open_cache(root, budget=3 * _entry_size() + 100)
    for i in range(6):  # over budget twice over: evictions happen
        put(c, i)
        assert weights.read_bytes() == content
    assert c.clear(all_namespaces=True) == 3
    assert weights.read_bytes() == content and (root / "modelslink").is_symlink()
    assert (c.stats().evictions, c.stats().foreign_by_kind) == (3, {"symlink": 1})
    c.close()


def test_links_named_like_shards_and_snapshots_are_never_followed_nor_deleted(tmp_path: Path) -> None:
    weights, content = _models(tmp_path)
    root = tmp_path / "cache"
    # A real snapshot of our namespace, outside the folder, reachable through a linked shard.
    outside = tmp_path / "elsewhere"
    k_out = key_of(toks(1))
    write_snapshot(
        outside / f"{k_out}.safetensors",
        namespace=NAMESPACE,
        key=k_out,
        tokens=toks(1),
        snapshot=make_snapshot(8),
    )
    (root / NAMESPACE).mkdir(parents=True)
    (root / NAMESPACE / k_out[:2]).symlink_to(outside, target_is_directory=True)
    # A file link named like a snapshot, pointing at a model's weights.
    k_link = key_of(toks(2))
    if k_link[:2] == k_out[:2]:
        k_link = key_of(toks(3))
    (root / NAMESPACE / k_link[:2]).mkdir()
    link = root / NAMESPACE / k_link[:2] / f"{k_link}.safetensors"
    link.symlink_to(weights)

    c = open_cache(root, budget=2 * _entry_size())
    assert c.load(k_out, toks(1), VALIDATE) is None  # never read through the link
    assert c.load(k_link, toks(2 if k_link == key_of(toks(2)) else 3), VALIDATE) is None
    for i in range(10, 14):
        put(c, i)
    c.clear(all_namespaces=True)
    stats = c.stats()
    c.close()
    assert weights.read_bytes() == content and link.is_symlink()
    assert (outside / f"{k_out}.safetensors").is_file()  # the snapshot behind the linked shard
    assert (root / NAMESPACE / k_out[:2]).is_symlink()
    assert stats.foreign_by_kind == {"symlink": 2}


def test_a_folder_named_like_a_snapshot_is_skipped_at_start_and_while_running(tmp_path: Path) -> None:
    k1 = key_of(toks(1))
    d1 = tmp_path / NAMESPACE / k1[:2] / f"{k1}.safetensors"
    d1.mkdir(parents=True)
    (d1 / "precious.txt").write_text("not the cache's")
    c = open_cache(tmp_path, refresh_s=0.02)  # the old code died here: IsADirectoryError
    assert c.stats().foreign_by_kind == {"directory": 1}
    assert c.load(k1, toks(1), VALIDATE) is None
    assert c.save(k1, toks(1), make_snapshot(8, seed=1))  # a folder sits at its path: not written
    flush(c)

    k2 = key_of(toks(2))
    d2 = tmp_path / NAMESPACE / k2[:2] / f"{k2}.safetensors"
    d2.mkdir(parents=True)  # made while running: the idle refresh meets it
    deadline = time.monotonic() + 30
    while c.stats().foreign_by_kind.get("directory") != 2:
        assert time.monotonic() < deadline, c.stats()
        time.sleep(0.01)
    keys = [put(c, i) for i in range(3, 6)]  # the writer thread still works
    assert all(c.load(k, toks(i), VALIDATE) is not None for i, k in zip(range(3, 6), keys, strict=True))
    s = c.stats()
    assert (s.saves, s.errors_by_kind, s.write_errors) == (3, {}, 0)
    c.close()
    assert d1.is_dir() and (d1 / "precious.txt").read_text() == "not the cache's" and d2.is_dir()


def test_a_fifo_named_like_a_snapshot_never_blocks(tmp_path: Path) -> None:
    k = key_of(toks(1))
    fifo = tmp_path / NAMESPACE / k[:2] / f"{k}.safetensors"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    box: list[DiskCache] = []
    t = threading.Thread(target=lambda: box.append(open_cache(tmp_path)), daemon=True)
    t.start()
    t.join(30)
    assert box, "start blocked opening a FIFO"
    c = box[0]
    assert c.load(k, toks(1), VALIDATE) is None
    assert c.stats().foreign_by_kind == {"not_regular": 1}
    c.close()
    assert fifo.exists()


def test_foreign_regular_files_named_like_snapshots_are_never_deleted(tmp_path: Path) -> None:
    weights, content = _models(tmp_path)
    root = tmp_path / "cache"
    k1, k2 = key_of(toks(1)), key_of(toks(2), OTHER_NAMESPACE)
    copy = root / NAMESPACE / k1[:2] / f"{k1}.safetensors"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(content)  # a model's safetensors named like one of our entries
    hard = root / OTHER_NAMESPACE / k2[:2] / f"{k2}.safetensors"
    hard.parent.mkdir(parents=True)
    os.link(weights, hard)  # the same inode as the model's weights, in another namespace's folder
    (root / NAMESPACE / k1[:2] / "notes.txt").write_text("x")

    c = open_cache(root, budget=2 * _entry_size())
    assert copy.read_bytes() == content
    assert c.load(k1, toks(1), VALIDATE) is None
    for i in range(10, 15):
        put(c, i)
    c.clear(all_namespaces=True)
    stats = c.stats()
    c.close()
    assert copy.read_bytes() == content and weights.read_bytes() == content and hard.exists()
    assert stats.foreign_by_kind == {"foreign_file": 3}
    c2 = open_cache(root)  # and again after a restart
    c2.close()
    assert copy.exists() and hard.exists() and weights.exists()
