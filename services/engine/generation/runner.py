"""Drives a backend: prefill in chunks that also stop exactly at snapshot
positions (recurrent and compressed state cannot be cut back later), and
records what cold prefill costs on this machine."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.models.backend import Backend, State

OnSnapshot = Callable[[int, Snapshot], None]


@dataclass
class PrefillClock:
    """Measured cold prefills (started at position 0): num_tokens -> seconds.
    Estimates the cold prefill time of n tokens from the nearest measurement,
    scaled linearly (what a restore of n tokens saved)."""

    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 16:  # too short to say anything about throughput
            return
        i = bisect.bisect_left(self.sizes, num_tokens)
        if i < len(self.sizes) and self.sizes[i] == num_tokens:
            self.seconds[i] = 0.5 * (self.seconds[i] + seconds)
        else:
            self.sizes.insert(i, num_tokens)
            self.seconds.insert(i, seconds)
        if len(self.sizes) > 64:  # keep a spread: drop every other middle point
            del self.sizes[1:-1:2], self.seconds[1:-1:2]

    def estimate(self, num_tokens: int) -> float | None:
        if not self.sizes:
            return None
        i = bisect.bisect_left(self.sizes, num_tokens)
        j = min(
            range(max(0, i - 1), min(len(self.sizes), i + 1)), key=lambda k: abs(self.sizes[k] - num_tokens)
        )
        return self.seconds[j] * num_tokens / self.sizes[j]


class Runner:
    def __init__(self, backend: Backend, chunk_size: int) -> None:
        self.backend = backend
        self.chunk_size = chunk_size
        self.clock = PrefillClock()

    def _sync(self) -> None:
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)

    def prefill(
        self,
        state: State,
        tokens: Sequence[int],
        snapshot_at: Sequence[int] = (),
        on_snapshot: OnSnapshot | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor | None:
        """Advance `state` over `tokens` (absolute positions state.position...).
        At each absolute position in `snapshot_at` the state is exported to
        `on_snapshot`. Returns the last logits, or None when `should_stop` fired."""
        start = state.position
        end = start + len(tokens)
        stops = sorted({p for p in snapshot_at if start < p <= end})
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.backend.device)
        t0 = time.perf_counter()
        logits = state.logits
        pos = start
        callback_s = 0.0  # snapshot copies are not prefill work
        while pos < end:
            nxt = min(pos + self.chunk_size, end)
            k = bisect.bisect_right(stops, pos)
            if k < len(stops):
                nxt = min(nxt, stops[k])
            logits = self.backend.prefill(state, ids[pos - start : nxt - start])
            assert state.position == nxt, f"backend advanced to {state.position}, expected {nxt}"
            pos = nxt
            if on_snapshot is not None and pos in stops:
                t_cb = time.perf_counter()
                on_snapshot(pos, self.backend.export(state))
                callback_s += time.perf_counter() - t_cb
            if should_stop is not None and should_stop():
                return None
        self._sync()
        if start == 0 and end > 0:
            self.clock.record(end, time.perf_counter() - t0 - callback_s)
        return logits

    def decode(self, state: State, token: int) -> torch.Tensor:
        return self.backend.decode(state, token)
