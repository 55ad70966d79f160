"""The snapshot file: format, verification reasons, atomic no-overwrite publish."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from snapshot_fixtures import NAMESPACE, OTHER_NAMESPACE, forge_header, make_snapshot, same_bytes

from keepwarm.engine.cache import snapshot_file
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import (
    FORMAT_VERSION,
    TOKENS,
    read_header,
    read_snapshot,
    read_tokens,
    tmp_writer_pid,
    write_snapshot,
)

KEY = "0123456789abcdef0123456789abcdef"
TOKENS_10 = [5, 17, 299, 0, 42, 7, 7, 1, 2, 3]


def _write(path: Path, position: int = 8, tokens: list[int] = TOKENS_10, ns: str = NAMESPACE) -> Snapshot:
    snap = make_snapshot(position)
    size = write_snapshot(path, namespace=ns, key=KEY, tokens=tokens, snapshot=snap, created=1234.5)
    assert size == path.stat().st_size
    return snap


def _header_json(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _patch_header(path: Path, old: str, new: str) -> None:
    """Rewrite header text in place (same length, so offsets and size stay valid)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = data[8 : 8 + n]
    assert head.count(old.encode()) == 1, old
    path.write_bytes(data[:8] + head.replace(old.encode(), new.encode()) + data[8 + n :])


def _reason(path: Path, **kw: object) -> str:
    with pytest.raises(SnapshotFileError) as e:
        read_snapshot(path, namespace=kw.pop("namespace", NAMESPACE), **kw)  # type: ignore[arg-type]
    return e.value.reason


def test_round_trip_is_byte_identical_and_header_complete(tmp_path: Path) -> None:
    path = tmp_path / "01" / f"{KEY}.safetensors"
    snap = _write(path)
    got, tokens = read_snapshot(path, namespace=NAMESPACE, tokens=TOKENS_10, key=KEY)
    assert tokens == TOKENS_10
    assert same_bytes(got, snap)
    assert got.tensors["layers.0.k"].dtype == torch.bfloat16 and got.tensors["layers.0.k"].shape == (8, 2, 8)

    h = read_header(path)
    assert (h.format_version, h.namespace, h.key, h.key_tokens, h.position, h.created) == (
        FORMAT_VERSION,
        NAMESPACE,
        KEY,
        10,
        8,
        1234.5,
    )
    # data: k, v 8*2*8 bf16 = 256 B each; state 64 B; logits 1200 B; tokens 40 B
    assert h.file_bytes - h.data_start == 256 + 256 + 64 + 1200 + 40
    assert h.data_start % 8 == 0 and path.stat().st_size == h.file_bytes
    assert set(h.checksums) == {"layers.0.k", "layers.0.v", "layers.0.state", "sidecar.logits", TOKENS}
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind

    # A standard safetensors file: any safetensors reader sees the same tensors and metadata.
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(h.checksums)
        meta = f.metadata()
        assert meta["position"] == "8" and meta["key_tokens"] == "10" and meta["namespace"] == NAMESPACE
        assert torch.equal(f.get_tensor(TOKENS), torch.tensor(TOKENS_10, dtype=torch.int32))
        assert torch.equal(f.get_tensor("layers.0.state"), snap.tensors["layers.0.state"])


def test_non_contiguous_and_empty_tensors_round_trip(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    snap = Snapshot(0, {"a.t": base.t(), "b.empty": torch.zeros(0, 2, 8, dtype=torch.bfloat16)})
    path = tmp_path / "x.safetensors"
    write_snapshot(path, namespace=NAMESPACE, key=KEY, tokens=[], snapshot=snap, fsync=False)
    got, tokens = read_snapshot(path, namespace=NAMESPACE, tokens=[])
    assert tokens == [] and same_bytes(got, snap)
    assert got.tensors["a.t"].tolist() == base.t().tolist()


def test_existing_key_is_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path, position=8)
    before = path.read_bytes()
    again = write_snapshot(path, namespace=NAMESPACE, key=KEY, tokens=TOKENS_10, snapshot=make_snapshot(9))
    assert again is None and path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["k.safetensors"]


def test_write_refuses_snapshot_past_its_key_and_reserved_names(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    with pytest.raises(ValueError, match="covers 11 positions but the key has 10 tokens"):
        write_snapshot(path, namespace=NAMESPACE, key=KEY, tokens=TOKENS_10, snapshot=make_snapshot(11))
    bad = Snapshot(1, {TOKENS: torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(ValueError, match="reserved"):
        write_snapshot(path, namespace=NAMESPACE, key=KEY, tokens=[1], snapshot=bad)
    assert list(tmp_path.iterdir()) == []


def test_flipped_payload_byte_fails_checksum_but_not_header(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor of the data section
    path.write_bytes(bytes(data))
    assert read_header(path).position == 8  # the header alone still parses
    assert _reason(path) == "checksum"


def test_truncated_and_empty_files(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    full = path.read_bytes()
    path.write_bytes(full[:-1])
    assert _reason(path) == "truncated"
    with pytest.raises(SnapshotFileError) as e:
        read_header(path)
    assert e.value.reason == "truncated"
    path.write_bytes(full[:20])  # cut inside the header
    assert _reason(path) == "truncated"
    path.write_bytes(b"")
    assert _reason(path) == "truncated"
    path.write_bytes(full + b"\0")
    assert _reason(path) == "unreadable"


def test_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{}xx")
    assert _reason(path) == "unreadable"
    path.write_bytes(struct.pack("<Q", 1 << 40))  # absurd header length
    assert _reason(path) == "unreadable"
    # A valid safetensors file that is not a keepwarm snapshot.
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, str(path))
    assert _reason(path) == "unreadable"
    # A hand-made header whose fp32 tensor sits at an odd offset: refused, never a crash.
    snap = Snapshot(0, {"a.byte": torch.zeros(3, dtype=torch.uint8), "b.f32": torch.zeros(2)})
    write_snapshot(path.with_name("odd.safetensors"), namespace=NAMESPACE, key=KEY, tokens=[], snapshot=snap)
    n, doc = _header_json(path.with_name("odd.safetensors"))
    payload = path.with_name("odd.safetensors").read_bytes()[8 + n :]
    meta = doc.pop("__metadata__")
    doc["a.byte"]["data_offsets"] = [0, 3]
    doc["b.f32"]["data_offsets"] = [3, 11]
    doc[TOKENS]["data_offsets"] = [11, 11]
    meta["header_checksum"] = snapshot_file._header_checksum(meta, doc)  # a forger who knows the format
    doc["__metadata__"] = meta
    body = json.dumps(doc).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + payload[8:11] + payload[:8])
    assert _reason(path) == "unreadable"


def test_namespace_key_version_position_and_tokens_checks(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path, ns=OTHER_NAMESPACE)
    assert _reason(path) == "foreign_namespace"
    assert _reason(path, namespace=OTHER_NAMESPACE, key="f" * 32) == "key_mismatch"
    assert _reason(path, namespace=OTHER_NAMESPACE, tokens=TOKENS_10[:-1] + [4]) == "tokens_mismatch"
    assert _reason(path, namespace=OTHER_NAMESPACE, tokens=TOKENS_10[:-1]) == "tokens_mismatch"

    _patch_header(path, f'"format_version":"{FORMAT_VERSION}"', '"format_version":"9"')
    assert _reason(path, namespace=OTHER_NAMESPACE) == "version"
    with pytest.raises(SnapshotFileError) as e:
        read_header(path)
    assert e.value.reason == "version"


def test_forged_position_past_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path, position=8, tokens=TOKENS_10[:8])  # 8-token key
    forge_header(path, position="9")  # header checksum recomputed: only the guard can tell
    h = read_header(path)
    assert (h.position, h.key_tokens) == (9, 8)
    assert _reason(path) == "position_past_key"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"position":"8"', '"position":"7"'),  # the DeepSeek V4 sliding-only case: a smaller position
        ('"key_tokens":"10"', '"key_tokens":"11"'),
        (f'"namespace":"{NAMESPACE}"', f'"namespace":"{OTHER_NAMESPACE}"'),
        (f'"key":"{KEY}"', f'"key":"{KEY[::-1]}"'),
        ('"created":"1234.5"', '"created":"1234.6"'),
        ('"shape":[4,4]', '"shape":[2,8]'),
    ],
)
def test_every_edited_header_field_is_a_checksum_failure(tmp_path: Path, old: str, new: str) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    _patch_header(path, old, new)
    with pytest.raises(SnapshotFileError) as e:
        read_header(path)
    assert e.value.reason == "checksum"
    assert _reason(path, namespace=NAMESPACE) == "checksum"
    assert _reason(path, namespace=OTHER_NAMESPACE) == "checksum"
    with pytest.raises(SnapshotFileError) as e:
        read_snapshot(path, namespace=NAMESPACE, alloc=lambda *_: None)
    assert e.value.reason == "checksum"


def test_header_json_lists_tensors_by_item_size(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    n, doc = _header_json(path)
    assert (8 + n) % 8 == 0
    order = sorted((v["data_offsets"][0], k) for k, v in doc.items() if k != "__metadata__")
    assert [k for _, k in order] == ["layers.0.state", TOKENS, "sidecar.logits", "layers.0.k", "layers.0.v"]
    assert json.loads(doc["__metadata__"]["checksums"])[TOKENS] == xxhash.xxh3_64_hexdigest(
        torch.tensor(TOKENS_10, dtype=torch.int32).numpy().tobytes()
    )


def test_tmp_writer_pid() -> None:
    assert tmp_writer_pid(f"{KEY}.safetensors.4242.deadbeef.tmp") == 4242
    assert tmp_writer_pid(f"{KEY}.safetensors") is None
    assert tmp_writer_pid("junk.tmp") is None


def test_read_into_caller_memory_is_byte_identical_and_zero_copy(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    snap = _write(path)
    k_buf = torch.zeros(32, 2, 8, dtype=torch.bfloat16)  # a state buffer with spare capacity
    asked: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def alloc(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        asked.append((name, dtype, shape))
        if name == "layers.0.k":
            return k_buf[: shape[0]]
        if name == "layers.0.v":
            return torch.empty(shape[0] + 1, 2, 8, dtype=dtype)  # wrong shape: ignored, fresh memory used
        return None

    got, toks = read_snapshot(path, namespace=NAMESPACE, tokens=TOKENS_10, alloc=alloc)
    assert toks == TOKENS_10
    assert same_bytes(got, snap)
    assert got.tensors["layers.0.k"].data_ptr() == k_buf.data_ptr()
    assert torch.equal(k_buf[:8], snap.tensors["layers.0.k"]) and not k_buf[8:].any()
    assert sorted(n for n, _, _ in asked) == sorted(snap.tensors)  # meta.tokens is never offered
    assert ("layers.0.k", torch.bfloat16, (8, 2, 8)) in asked


def test_read_into_rejects_a_flipped_byte(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotFileError) as e:
        read_snapshot(path, namespace=NAMESPACE, alloc=lambda *_: None)
    assert e.value.reason == "checksum"


def test_read_tokens_needs_no_payload(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    _write(path)
    header = read_header(path)
    data = bytearray(path.read_bytes())
    t = header.tensors["layers.0.k"]
    data[header.data_start + t.begin] ^= 0xFF  # a corrupt payload does not matter here
    path.write_bytes(bytes(data))
    assert read_tokens(path, namespace=NAMESPACE, key=KEY) == TOKENS_10
    tok = header.tensors["meta.tokens"]
    data[header.data_start + tok.begin] ^= 0x01  # ... but the tokens are verified
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotFileError) as e:
        read_tokens(path, namespace=NAMESPACE, key=KEY)
    assert e.value.reason == "checksum"
    with pytest.raises(SnapshotFileError) as e:
        read_tokens(path, namespace=OTHER_NAMESPACE)
    assert e.value.reason == "foreign_namespace"
