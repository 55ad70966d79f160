"""Progress of a model's weights loading, shown on a terminal: one line redrawn in place
(`loading NAME: 120/272 weights, 1.4 s`), then the total time. Silent when stderr is not a
terminal (a service's log gets the one closing line from the engine instead)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class LoadProgress:
    def __init__(self, name: str, total: int, out: TextIO | None = None) -> None:
        self.name = name
        self.total = max(1, total)
        self.done = 0
        self.started = time.perf_counter()
        self._out = out if out is not None else sys.stderr
        self._tty = self._out.isatty()
        self._shown = 0.0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def step(self) -> None:
        """One more weight read (a weight read twice, as a tied head is, counts once more)."""
        self.done = min(self.total, self.done + 1)
        now = time.perf_counter()
        if self._tty and (now - self._shown >= 0.1 or self.done == self.total):
            self._shown = now
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            self._out.write(
                f"\rloading {self.name} [{bar}] {self.done}/{self.total} weights, {self.seconds:.1f} s"
            )
            self._out.flush()

    def finish(self) -> float:
        """Ends the line on a terminal; the seconds the load took."""
        if self._tty:
            self._out.write(
                f"\rloading {self.name}: {self.total} weights in {self.seconds:.1f} s" + " " * 20 + "\n"
            )
            self._out.flush()
        return self.seconds
