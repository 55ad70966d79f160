"""The models' state contract: every state tensor a model keeps (names, dtypes, shapes by
position), the one source for allocating live state, declaring snapshots and validating them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


class SnapshotMismatch(ValueError):
    """A snapshot does not fit the loaded model's geometry (wrong name, dtype or shape)."""


def all_rows(position: int) -> int:
    """`TensorSpec.rows` of a tensor with one row per position (a full attention layer's K/V):
    a step writes rows at and after its start only."""
    return position


@dataclass(frozen=True)
class TensorSpec:
    """One state tensor: its name, dtype and shape at a given position.

    `shape` holds -1 at `length_dim` (the dimension that grows with position);
    `rows(position)` gives that dimension's size for a snapshot at `position`.
    A spec with `length_dim is None` has a fixed shape (recurrent states).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    length_dim: int | None = None
    rows: Callable[[int], int] | None = field(default=None, compare=False)

    def shape_at(self, position: int) -> tuple[int, ...]:
        if self.length_dim is None:
            return self.shape
        assert self.rows is not None, f"{self.name}: a length dim needs rows()"
        out = list(self.shape)
        out[self.length_dim] = self.rows(position)
        return tuple(out)


@dataclass(frozen=True)
class Geometry:
    """Every state tensor of a model: the single source of truth for allocation,
    snapshot declaration and validation."""

    specs: tuple[TensorSpec, ...]

    def spec(self, name: str) -> TensorSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def layout_id(self) -> str:
        """Hash of names, dtypes and shapes with the length dim normalized, so that
        snapshots of every length share one namespace. A `rows` function with a `layout_key`
        (e.g. a sliding window's size) is part of the layout: it decides the row counts."""
        h = hashlib.sha256()
        for s in sorted(self.specs, key=lambda s: s.name):
            h.update(f"{s.name}|{str(s.dtype)}|{s.shape}|{s.length_dim}\n".encode())
            rows_key = getattr(s.rows, "layout_key", None)
            if rows_key is not None:
                h.update(f"rows={rows_key}\n".encode())
        return h.hexdigest()[:32]

    def validate(self, tensors: Mapping[str, torch.Tensor], position: int) -> None:
        """Raise SnapshotMismatch unless `tensors` holds exactly the specs at `position`."""
        missing = [n for n in self.names if n not in tensors]
        extra = [n for n in tensors if n not in self.names]
        if missing or extra:
            raise SnapshotMismatch(f"tensor names differ: missing {missing[:4]}, unexpected {extra[:4]}")
        for s in self.specs:
            t = tensors[s.name]
            if t.dtype != s.dtype:
                raise SnapshotMismatch(f"{s.name}: dtype {t.dtype}, model needs {s.dtype}")
            want = s.shape_at(position)
            if tuple(t.shape) != want:
                raise SnapshotMismatch(
                    f"{s.name}: shape {tuple(t.shape)}, model needs {want} at position {position}"
                )
