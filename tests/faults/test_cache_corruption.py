"""Corruption canaries for the disk cache (issue 16): flipped bytes, truncation, swapped
files, forged tokens, an edited header position, garbage ledger lines and index rows, a
corrupt index. Nothing corrupt is ever adopted; what is ours and bad is deleted and
counted; the cache keeps working and rebuilds its index from the file headers."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from cache_faults import (
    NAMESPACE,
    OTHER_NAMESPACE,
    VALIDATE,
    forge_header,
    key_of,
    make_snapshot,
    open_cache,
    put,
    same_bytes,
    toks,
    validator,
)

from keepwarm.engine.cache.index import DB_NAME, IndexUnusable
from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.cache.snapshot_file import TOKENS, read_header, write_snapshot
from keepwarm.engine.models.geometry import Geometry, TensorSpec


def test_flipped_bytes_anywhere_are_never_adopted(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    path = c.path_for(k)
    good = path.read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    for offset in (20, 8 + n // 2, 8 + n + 3, len(good) // 2, len(good) - 1):  # header and payload
        data = bytearray(good)
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))
        assert c.load(k, toks(1), VALIDATE) is None, offset
    assert not path.exists()
    snap = c.load(put(c, 1), toks(1), VALIDATE)  # saved again: the right bytes
    assert snap is not None and same_bytes(snap, make_snapshot(8, seed=1))
    assert sum(c.stats().rejected_by_reason.values()) >= 1
    c.close()


def test_truncation_at_every_kind_of_cut_is_never_adopted(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    good = c.path_for(k).read_bytes()
    for cut in (0, 5, 8, 40, len(good) // 2, len(good) - 1):
        c.path_for(k).write_bytes(good[:cut])
        assert c.load(k, toks(1), VALIDATE) is None, cut
        c.close()
        c = open_cache(tmp_path)  # and at start: never fatal, never adopted
        assert c.load(k, toks(1), VALIDATE) is None, cut
    c.close()


def test_swapped_files_are_rejected_and_the_originals_still_hit(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    a, b = put(c, 1), put(c, 2)
    c.path_for(b).write_bytes(c.path_for(a).read_bytes())  # b's name, a's content
    assert c.load(b, toks(2), VALIDATE) is None and not c.path_for(b).exists()
    assert c.stats().rejected_by_reason == {"key_mismatch": 1}
    hit = c.load(a, toks(1), VALIDATE)
    assert hit is not None and same_bytes(hit, make_snapshot(8, seed=1))
    c.close()


def _rewrite_tokens(path: Path, new_tokens: list[int], *, fix_checksums: bool) -> None:
    """Replace the stored token ids (same count) in place; optionally fix every checksum,
    as a forger who knows the format would."""
    h = read_header(path)
    t = h.tensors[TOKENS]
    raw = torch.tensor(new_tokens, dtype=torch.int32).numpy().tobytes()
    data = bytearray(path.read_bytes())
    data[h.data_start + t.begin : h.data_start + t.end] = raw
    path.write_bytes(bytes(data))
    if fix_checksums:
        sums = dict(h.checksums)
        sums[TOKENS] = xxhash.xxh3_64_hexdigest(raw)
        forge_header(path, checksums=json.dumps(sums, sort_keys=True))


@pytest.mark.parametrize("fix_checksums", [False, True])
def test_forged_tokens_are_never_adopted(tmp_path: Path, fix_checksums: bool) -> None:
    c = open_cache(tmp_path)
    k = put(c, 1)
    _rewrite_tokens(c.path_for(k), toks(7), fix_checksums=fix_checksums)
    assert c.load(k, toks(1), VALIDATE) is None and not c.path_for(k).exists()
    assert c.load(k, toks(7), VALIDATE) is None  # nor under the tokens it now claims
    reason = "tokens_mismatch" if fix_checksums else "checksum"
    assert c.stats().rejected_by_reason == {reason: 1}
    c.close()


FIXED = Geometry(  # a layout whose shapes do not depend on the position (sliding-window state, full)
    (TensorSpec("layers.0.window", torch.bfloat16, (4, 2, 8)), TensorSpec(LOGITS, torch.float32, (300,)))
)


def test_an_edited_header_position_is_rejected_and_deleted(tmp_path: Path) -> None:
    """The DeepSeek V4 sliding-only case: the tensors fit any position, so only the header
    checksum can tell that the position was edited."""
    c = open_cache(tmp_path)
    tokens = list(range(20))
    k = key_of(tokens)
    snap = Snapshot(20, {"layers.0.window": torch.randn(4, 2, 8).bfloat16(), LOGITS: torch.randn(300)})
    write_snapshot(c.path_for(k), namespace=NAMESPACE, key=k, tokens=tokens, snapshot=snap)
    forge_header(c.path_for(k), position="19", rechecksum=False)
    validate = validator(FIXED)
    assert c.load(k, tokens, validate) is None
    assert not c.path_for(k).exists()
    assert c.stats().rejected_by_reason == {"checksum": 1}
    # and at start, from the header alone
    write_snapshot(c.path_for(k), namespace=NAMESPACE, key=k, tokens=tokens, snapshot=snap)
    forge_header(c.path_for(k), position="19", rechecksum=False)
    c.close()
    c2 = open_cache(tmp_path)
    assert not c2.path_for(k).exists() and c2.stats().rejected_by_reason == {"checksum": 1}
    c2.close()


def test_garbage_hit_ledger_lines_do_not_stop_the_cache(tmp_path: Path) -> None:
    """The old hits.log: one malformed line stopped the engine from starting."""
    c = open_cache(tmp_path)
    k = put(c, 1)
    c.close()
    (tmp_path / NAMESPACE / "hits.log").write_text(
        f"H {k} 12.5 w1\nH ../../etc/passwd 1.0 w\nS {k} x y z\n\x00\xff garbage\nH\n"
    )
    c2 = open_cache(tmp_path)
    assert c2.load(k, toks(1), VALIDATE) is not None
    c2.close()


def _db(root: Path) -> sqlite3.Connection:
    return sqlite3.connect(root / DB_NAME, isolation_level=None)


def test_garbage_index_rows_are_dropped_and_touch_nothing(tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"precious")
    root = tmp_path / "cache"
    c = open_cache(root, budget=1 << 20)
    k = put(c, 1)
    c.close()
    cols = "namespace, key, path, tokens, position, bytes, created, state, owner, since, hits, decayed, ref, last_used"
    garbage = [
        ("..", "..", "../outside.safetensors", 1, 0, 10, 0.0, 0, "", 0.0, 0, 0.0, 0.0, 0.0),
        (NAMESPACE, "zz" * 16, "/etc/passwd", 10, 8, 10, 0.0, 0, "", 0.0, 0, 0.0, 0.0, 0.0),  # wrong path
        (NAMESPACE, "yy" * 16, f"{NAMESPACE}/yy/{'yy' * 16}.safetensors", -5, 0, 10, 0.0, 0, "", 0.0, 0, 0.0, 0.0, 0.0),
        (OTHER_NAMESPACE, "xx" * 16, f"{OTHER_NAMESPACE}/xx/{'xx' * 16}.safetensors", 10, 8, 1 << 40, 0.0, 0, "",
         0.0, 0, 0.0, 0.0, 0.0),  # a valid row claiming 1 TiB for a file that does not exist
        (NAMESPACE, "ww" * 16, f"{NAMESPACE}/ww/{'ww' * 16}.safetensors", 10, 8, 10, 0.0, 7, "", 0.0, 0, 0.0, 0.0, 0.0),
        (NAMESPACE, "vv" * 16, f"{NAMESPACE}/vv/{'vv' * 16}.safetensors", 10, 80, 10, 0.0, 0, "", 0.0, 0, 0.0, 0.0, 0.0),
    ]  # fmt: skip
    with _db(root) as db:
        db.executemany(f"INSERT INTO entries ({cols}) VALUES ({','.join('?' * 14)})", garbage)
        db.execute("UPDATE entries SET hits=-3 WHERE key=?", (k,))  # a valid file, a garbage hit count
    c3 = open_cache(root, budget=1 << 20)
    # k's row was garbage too: dropped, and its file indexed again from its header
    assert [(e.key, e.hits) for e in c3.entries()] == [(k, 0)]
    assert c3.stats().garbage_rows == 6
    for i in range(2, 6):  # the 1 TiB phantom does not block saves
        put(c3, i)
    assert c3.stats().refused_for_space == 0 and c3.load(k, toks(1), VALIDATE) is not None
    c3.close()
    assert outside.read_bytes() == b"precious"
    with _db(root) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 5


def test_a_corrupt_index_is_rebuilt_from_the_file_headers(tmp_path: Path) -> None:
    c = open_cache(tmp_path)
    keys = [put(c, i) for i in range(4)]
    for _ in range(3):
        c.load(keys[0], toks(0), VALIDATE)
    c.close()
    for f in tmp_path.glob(DB_NAME + "*"):
        f.unlink()
    (tmp_path / DB_NAME).write_bytes(b"SQLite format 3\x00" + b"\xde\xad" * 4000)  # torn / overwritten
    c2 = open_cache(tmp_path)
    assert {e.key for e in c2.entries()} == set(keys)
    for i, k in enumerate(keys):
        assert c2.load(k, toks(i), VALIDATE) is not None
    assert c2.stats().rejected_by_reason == {}
    c2.close()


def test_an_index_path_that_is_a_link_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.db"
    target.write_bytes(b"not a database of ours")
    root = tmp_path / "cache"
    root.mkdir()
    (root / DB_NAME).symlink_to(target)
    with pytest.raises(IndexUnusable, match=DB_NAME):
        open_cache(root)
    assert target.read_bytes() == b"not a database of ours"
