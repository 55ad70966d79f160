"""The contract every model family implements (DESIGN.md §2.2).

The runner owns chunking and snapshot points; a backend only advances a state
by some tokens and moves state in and out of snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from keepwarm.engine.snapshot import Geometry, Snapshot


@dataclass
class State:
    """Live model state of one sequence.

    `tensors` holds preallocated buffers keyed by geometry names (capacity rows on
    the length dim); `position` is how many tokens they cover; `logits` [vocab]
    float32 are the logits after the last covered token (None before any token).
    `extra` is for family-private bookkeeping that is derivable from tensors.
    """

    capacity: int
    position: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    extra: dict[str, object] = field(default_factory=dict)


class Backend(Protocol):
    """A model family bound to loaded weights on one device and dtype."""

    family: str
    geometry: Geometry
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def new_state(self, capacity: int) -> State:
        """Empty state able to hold `capacity` tokens."""
        ...

    def prefill(self, state: State, tokens: torch.Tensor) -> torch.Tensor:
        """Advance `state` by `tokens` [n] int64 (one chunk); return the logits
        [vocab] float32 after the last token and keep them in `state.logits`."""
        ...

    def decode(self, state: State, token: int) -> torch.Tensor:
        """Advance `state` by one token; return logits [vocab] float32."""
        ...

    def export(self, state: State) -> Snapshot:
        """Right-sized named views of `state` plus `sidecar.logits`; no copy."""
        ...

    def adopt(self, snapshot: Snapshot, capacity: int, into: State | None = None) -> State:
        """A state equal to `snapshot`; raises SnapshotMismatch (after validating every
        tensor, before writing any) when it does not fit `geometry`. `into` is a spent
        state of this backend whose buffers may be reused (their pages are already
        mapped, which makes a restore a plain memory copy)."""
        ...
