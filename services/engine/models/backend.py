"""The contract every model family implements (docs/architecture.md, 'The backend contract').

The runner owns chunking and snapshot points; a backend only advances a state
by some tokens and moves state in and out of snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.models.geometry import Geometry
from keepwarm.engine.models.placement import Placement
from keepwarm.kernels.quant_weight import QuantRows, QuantWeight


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
    """A model family bound to loaded weights and a dtype, its layers placed on one or more
    devices (`placement`: each layer's weights and state on its stage's device; `device` is
    the first stage's, where tokens enter; logits come out on the last stage's)."""

    family: str
    geometry: Geometry
    vocab_size: int
    placement: Placement
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

    def step(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """One batched forward: advance `states[i]` by `chunks[i]` [n_i] int64 (a decode
        is a chunk of one token; sequences are distinct). Matrix products run over all
        sum(n_i) tokens at once; attention and recurrent/compressed state per sequence.
        Returns logits [sum(heads), vocab] float32 after each chunk's last `heads[i]` tokens
        (1 each when `heads` is None: a verified draft needs one row per drafted token) and
        sets each `state.logits` (its chunk's last row) and `state.position`. Each row must
        equal what `prefill(states[i], chunks[i])` alone gives (same greedy tokens; float32
        within the family's parity tolerance)."""
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


@runtime_checkable
class StaticDecode(Backend, Protocol):
    """A backend whose one-token-per-sequence step reads no device value on the host, so a
    CUDA graph can capture it (generation/decode_graph.py); dense implements it."""

    def static_decode(self, max_context: int) -> bool:
        """Whether `decode_rows` can run with this backend's ops and placement (and make it
        ready for positions below `max_context`)."""
        ...

    def state_addresses(self, state: State) -> list[int]:
        """The buffer addresses `decode_rows` needs for `state` (a fixed count per backend)."""
        ...

    def decode_rows(
        self, tokens: torch.Tensor, positions: torch.Tensor, addresses: torch.Tensor
    ) -> torch.Tensor:
        """tokens [B], positions [B], addresses [A, B] int64 on `device` -> logits [B, vocab]
        float32; writes each sequence's new state rows, leaves positions/logits to the caller."""
        ...


def step_each(backend: Backend, states: Sequence[State], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """`Backend.step` by one `prefill` per sequence: the reference a batched step is
    tested against, and the fallback for a family without a batched forward."""
    assert len(states) == len(chunks) and states, "step needs one chunk per state"
    return torch.stack([backend.prefill(s, c) for s, c in zip(states, chunks, strict=True)])


def weight_bytes_by_type(backend: object) -> dict[str, int]:
    """Bytes of the weights reachable from a backend's attributes (each tensor once, the rotary
    tables excluded), by type: a block kind (`Q4_1`, ...) or a tensor dtype (`bfloat16`, ...)."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def walk(obj: object, depth: int) -> None:
        if isinstance(obj, QuantRows):
            for part in obj.parts:
                walk(part, depth)
        elif isinstance(obj, QuantWeight):
            if id(obj.blocks) not in seen:
                seen.add(id(obj.blocks))
                out[obj.kind] = out.get(obj.kind, 0) + obj.nbytes
        elif isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                kind = str(obj.dtype).removeprefix("torch.")
                out[kind] = out.get(kind, 0) + obj.numel() * obj.element_size()
        elif depth <= 3:
            if isinstance(obj, (list, tuple)):
                items: Sequence[object] = obj
            elif isinstance(obj, dict):
                items = list(obj.values())
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                items = [x for k, x in vars(obj).items() if k != "rope"]
            else:
                return
            for x in items:
                walk(x, depth + 1)

    walk(backend, 0)
    return out
