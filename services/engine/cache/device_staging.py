"""Device staging: host bounce buffers for snapshot reads whose destination is not CPU
memory (a GPU state buffer is never handed to a host read)."""

from __future__ import annotations

import torch


class DeviceStaging:
    """Host bounce buffers for reads whose destination is not CPU memory: two slots
    (pinned when CUDA is available) so the device copy of one tensor overlaps the
    file read of the next; a slot is reused only after its copy has completed."""

    def __init__(self) -> None:
        self.pin = torch.cuda.is_available()
        self.slots: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self.turn
        self.turn ^= 1
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
            self.events[i] = None
        buf = self.slots[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self.slots[i] = buf
        return i, buf[:nbytes]

    def copied(self, i: int, dest: torch.Tensor) -> None:
        if dest.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dest.device))
            self.events[i] = ev

    def drain(self) -> None:
        for i, ev in enumerate(self.events):
            if ev is not None:
                ev.synchronize()
                self.events[i] = None
