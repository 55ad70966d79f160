"""The measured queue drain rate behind the engine's 429 Retry-After."""

from __future__ import annotations

from keepwarm.engine.serving.drain_rate import MAX_RETRY_AFTER_S, DrainRate


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rate_counts_busy_time_only() -> None:
    clock = Clock()
    d = DrainRate(window=4, clock=clock)
    assert d.rate() is None and d.retry_after_s(5) == 1  # idle, nothing measured
    d.busy()  # a request arrives at an idle engine ...
    clock.t += 4.0
    # ... and before anything finished the open spell is a lower bound on one request.
    assert d.rate() is None and d.retry_after_s(3) == 12
    d.finished(waiting=2)  # 4 s for the first; two more waiting
    clock.t += 2.0
    d.finished(waiting=1)  # 2 s for the second
    assert d.rate() == 2 / 6.0
    assert d.retry_after_s(7) == 21  # 7 requests at 1/3 per second
    clock.t += 3.0
    d.finished(waiting=0)  # 3 s; now idle
    clock.t += 500.0  # idle time never counts
    d.busy()
    clock.t += 3.0
    d.finished(waiting=0)
    assert d.rate() == 4 / 12.0
    # The window keeps the last 4 intervals.
    for _ in range(4):
        d.busy()
        clock.t += 1.0
        d.finished(waiting=0)
    assert d.rate() == 1.0 and d.retry_after_s(28) == 28


def test_retry_after_is_bounded() -> None:
    clock = Clock()
    d = DrainRate(clock=clock)
    d.busy()
    clock.t += 100.0
    d.finished(waiting=1)
    assert d.retry_after_s(1000) == MAX_RETRY_AFTER_S
    assert d.retry_after_s(0) == 1
