"""Snapshots: model state after N prompt tokens, as canonically named tensors.

A snapshot is valid only at the exact position where it was taken: recurrent
states and compressed rows cannot be cut back to a shorter prefix, so no code
ever truncates one. Names are global (`layers.7.k`, `layers.7.conv`,
`sidecar.logits`) so that any engine of the same model can adopt it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

LOGITS = "sidecar.logits"  # [vocab] float32: logits after the last covered token


@dataclass(frozen=True)
class Snapshot:
    """State after `position` tokens. `tensors` holds every geometry tensor, right-sized
    to `position` (views of the live state where possible), plus `sidecar.logits`."""

    position: int
    tensors: Mapping[str, torch.Tensor]

    @property
    def logits(self) -> torch.Tensor:
        return self.tensors[LOGITS]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def detached(self) -> Snapshot:
        """A host-memory copy that no longer aliases live state (for the RAM tier and the
        writer). Device tensors go to pinned host memory by non-blocking copies, with one
        wait for all of them rather than a stall per tensor."""
        out: dict[str, torch.Tensor] = {}
        waits: set[torch.device] = set()
        for k, v in self.tensors.items():
            if v.device.type == "cpu":
                out[k] = v.detach().to("cpu", copy=True)
                continue
            host = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            host.copy_(v.detach(), non_blocking=True)
            out[k] = host
            waits.add(v.device)
        for d in waits:
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        return Snapshot(self.position, out)
