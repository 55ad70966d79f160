"""Host copies of snapshots that never make the engine's step wait.

Why: the engine takes a snapshot at every save point of a prefill and at every reply's
end. Copying it to host memory and then synchronizing the compute stream would stall
the step thread for the copy and for all compute queued before it, once per snapshot.
Here the step only enqueues work; the copy lands later (`PendingSnapshot.done()`), and
the engine hands it to the cache then, in the order the snapshots were taken.

On CUDA, for each device tensor of the snapshot:
  1. clone it on the current (compute) stream, device to device. The clone is ordered
     after the forward that produced the state and before any later step, so a later
     step may update the live state in place (recurrent states, compressed rows) or
     free it without racing the host copy;
  2. on the copier's side stream for that device (one per device, made on first use),
     wait for the compute stream (up to the clone), copy the clone into a pinned host
     tensor with non_blocking=True, and mark the clone as used by the side stream
     (`record_stream`), so the caching allocator does not hand its memory out again
     before the copy has read it;
  3. record an event on each side stream used: the copy is done when every event is.
Nothing on this path synchronizes the host with the compute stream.

Invariants: the work that wrote the state is on each device's current stream, or joined
back into it (decode_graph's warm-up does), when `start` is called; a pending copy's host
tensors are read only after its events completed (`wait()`, or once `done()` returned
True); the clones are device memory outside the state budget, alive until their copy
ends (the engine lands pending copies every step, so at most a few steps' snapshots).
CPU tensors are copied at once (as `Snapshot.detached()` does), so a snapshot held in
host memory is done on return.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keepwarm.engine.cache.snapshot import Snapshot


def _always_done() -> bool:
    return True


def _nothing_to_wait_for() -> None:
    return None


class PendingSnapshot:
    """A host copy of a snapshot that may still be in flight: `done()` polls without
    blocking, `wait()` blocks until the copy is complete and returns it. `done`/`wait`
    are the completion pair of whatever makes the copy (CUDA events here); `wait` must
    return only once `done` would be true."""

    def __init__(
        self,
        host: Snapshot,
        done: Callable[[], bool] = _always_done,
        wait: Callable[[], None] = _nothing_to_wait_for,
    ) -> None:
        self._host = host  # tensors not to be read before the copy completes
        self._done = done
        self._wait = wait
        self._complete = False

    def done(self) -> bool:
        if not self._complete:
            self._complete = self._done()
        return self._complete

    def wait(self) -> Snapshot:
        if not self._complete:
            self._wait()
            self._complete = True
        return self._host


class SnapshotCopier:
    """Starts host copies of snapshots; owned by one engine (its side streams are per
    device, created lazily, and used only from the engine's stepping thread)."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, snapshot: Snapshot) -> PendingSnapshot:
        """Begin copying `snapshot` (views of live state) to host memory. Returns at once;
        later work on the compute stream may update the live state in place."""
        out: dict[str, torch.Tensor] = {}
        clones: dict[str, torch.Tensor] = {}
        for name, t in snapshot.tensors.items():
            src = t.detach()
            if src.device.type == "cuda":
                clones[name] = src.clone(memory_format=torch.contiguous_format)  # on the compute stream
            else:
                out[name] = src.to("cpu", copy=True)
        if not clones:
            return PendingSnapshot(Snapshot(snapshot.position, out))
        events: list[torch.cuda.Event] = []
        for device in {c.device for c in clones.values()}:
            side = self._stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the clones happen before the copies
            with torch.cuda.stream(side):
                for name, clone in clones.items():
                    if clone.device != device:
                        continue
                    host = torch.empty(clone.shape, dtype=clone.dtype, device="cpu", pin_memory=True)
                    host.copy_(clone, non_blocking=True)
                    clone.record_stream(side)  # its memory is not reused before `side` has read it
                    out[name] = host
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)

        def done() -> bool:
            return all(e.query() for e in events)

        def wait() -> None:
            for e in events:
                e.synchronize()

        # the names in the snapshot's order, so the host copy lists them as the source does
        ordered = {name: out[name] for name in snapshot.tensors}
        return PendingSnapshot(Snapshot(snapshot.position, ordered), done, wait)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        side = self._side.get(device)
        if side is None:
            side = torch.cuda.Stream(device)
            self._side[device] = side
        return side
