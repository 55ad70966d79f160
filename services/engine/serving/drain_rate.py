"""How fast the engine's queue drains, measured, for an honest `Retry-After`.

A *busy interval* is time during which the engine had work without a break:
it starts when a request arrives at an idle engine (`busy`) or when a request
finishes with others still waiting, and ends at the next finish. Each closed
interval is one request's worth of draining; the rate is the number of recent
intervals over their total length, so idle time between requests never counts.

`retry_after_s(depth)` is how long `depth` requests take to drain at that rate.
Before any interval has closed, the open one is a lower bound on one request's
time, so `depth` times its age is used (at least 1 s). Thread-safe: finishes
are reported from the generation thread, arrivals and 429s from the event loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

MAX_RETRY_AFTER_S = 3600


class DrainRate:
    def __init__(self, window: int = 32, clock: Callable[[], float] = time.monotonic) -> None:
        assert window >= 1
        self._clock = clock
        self._intervals: deque[float] = deque(maxlen=window)  # seconds per drained request
        self._open_since: float | None = None  # start of the busy interval now running
        self._lock = threading.Lock()

    def busy(self) -> None:
        """A request arrived at an idle engine."""
        with self._lock:
            if self._open_since is None:
                self._open_since = self._clock()

    def finished(self, waiting: int) -> None:
        """A request finished; `waiting` requests are still queued or running."""
        now = self._clock()
        with self._lock:
            if self._open_since is not None:
                self._intervals.append(max(0.0, now - self._open_since))
            self._open_since = now if waiting > 0 else None

    def rate(self) -> float | None:
        """Requests drained per second over the recent busy intervals; None before any."""
        with self._lock:
            total = sum(self._intervals)
            return len(self._intervals) / total if self._intervals and total > 0 else None

    def retry_after_s(self, depth: int) -> int:
        """Whole seconds for `depth` requests to drain, in [1, MAX_RETRY_AFTER_S]."""
        rate = self.rate()
        if rate is not None:
            wait = depth / rate
        else:
            with self._lock:
                age = self._clock() - self._open_since if self._open_since is not None else 0.0
            wait = depth * age
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait))))
