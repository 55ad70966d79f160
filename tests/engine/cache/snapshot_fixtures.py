"""Synthetic snapshots for the cache tests (no model): a one-layer geometry with
length-dim K/V rows in bf16, a fixed-size recurrent state in fp32 and the logits."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from keepwarm.engine.cache import snapshot_file
from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.models.geometry import Geometry, TensorSpec

VOCAB = 300
NAMESPACE = "a1" * 16  # 32 hex, stands in for namespace_id(...)
OTHER_NAMESPACE = "b2" * 16


def geometry(heads: int = 2, dim: int = 8) -> Geometry:
    return Geometry(
        (
            TensorSpec("layers.0.k", torch.bfloat16, (-1, heads, dim), 0, lambda p: p),
            TensorSpec("layers.0.v", torch.bfloat16, (-1, heads, dim), 0, lambda p: p),
            TensorSpec("layers.0.state", torch.float32, (4, 4)),
            TensorSpec(LOGITS, torch.float32, (VOCAB,)),
        )
    )


def make_snapshot(position: int, seed: int = 0, heads: int = 2, dim: int = 8) -> Snapshot:
    """Deterministic snapshot at `position` (same seed and shape: same bytes)."""
    g = torch.Generator().manual_seed(seed * 100_003 + position)
    return Snapshot(
        position,
        {
            "layers.0.k": torch.randn(position, heads, dim, generator=g).to(torch.bfloat16),
            "layers.0.v": torch.randn(position, heads, dim, generator=g).to(torch.bfloat16),
            "layers.0.state": torch.randn(4, 4, generator=g),
            LOGITS: torch.randn(VOCAB, generator=g),
        },
    )


def validator(g: Geometry | None = None) -> Callable[[Snapshot], None]:
    geo = g or geometry()

    def validate(s: Snapshot) -> None:
        geo.validate(s.tensors, s.position)

    return validate


def same_bytes(a: Snapshot, b: Snapshot) -> bool:
    """Equal positions, names, dtypes, shapes and bit patterns."""
    if a.position != b.position or set(a.tensors) != set(b.tensors):
        return False
    for name, t in a.tensors.items():
        u = b.tensors[name]
        if t.dtype != u.dtype or t.shape != u.shape:
            return False
        if not torch.equal(t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8)):
            return False
    return True


def forge_header(path: Path, *, rechecksum: bool = True, **fields: str) -> None:
    """Rewrite metadata fields of a snapshot file in place, as an attacker or a bit flip
    would; with `rechecksum` the header checksum is recomputed (a forger who knows the
    format), so only the semantic checks can catch the edit. Offsets stay valid."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    doc = json.loads(data[8 : 8 + n])
    meta = doc.pop("__metadata__")
    meta.update(fields)
    if rechecksum:
        meta["header_checksum"] = snapshot_file._header_checksum(meta, doc)
    doc["__metadata__"] = meta
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert len(body) <= n, "forged header must not grow"
    body += b" " * (n - len(body))
    path.write_bytes(data[:8] + body + data[8 + n :])
