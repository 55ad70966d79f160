"""The prefill cost model's warm-up, run between requests when none was persisted.

Cold prefills of growing size and partial ones from a deep start
(`PrefillCost.calibration_plan`), on random tokens, into states of their own: no
request's state, cache entry or counter is touched. It advances one chunk per call
(`step`), in the chunks real prefills run in, so a request never waits for more than
one; real prefills are recorded in the cost model meanwhile."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from keepwarm.engine.generation.prefill_cost import PrefillCost
from keepwarm.engine.models.backend import Backend


class Calibration:
    def __init__(self, backend: Backend, cost: PrefillCost, max_tokens: int, chunk: int) -> None:
        self.backend, self.cost, self.chunk = backend, cost, max(1, chunk)
        self.plan = [] if cost.calibrated else PrefillCost.calibration_plan(max_tokens)
        self.planned = len(self.plan)  # warm-up prefills to run (0: the model was persisted)
        self.done = 0  # of those, run
        self.started = False
        self.seconds = 0.0  # from the warm-up's first chunk to its end, requests between
        self._chunks: Iterator[None] | None = self._prefills() if self.plan else None

    @property
    def pending(self) -> bool:
        """Whether warm-up prefills are left to run."""
        return self._chunks is not None

    @property
    def state(self) -> str:
        """ "persisted" (the model was read from the cache folder: no warm-up), "waiting"
        (none of its prefills run yet), "running" or "done"."""
        if not self.planned:
            return "persisted"
        if self._chunks is None:
            return "done"
        return "running" if self.started else "waiting"

    def step(self) -> bool:
        """Run one chunk (the caller holds the engine's step lock); False when none is left.
        A warm-up that raises is not retried: real prefills still fit the model."""
        if self._chunks is None:
            return False
        self.started = True
        try:
            next(self._chunks)
        except StopIteration:
            self._chunks = None
        except BaseException:
            self._chunks = None
            raise
        return True

    def stop(self) -> None:
        """End an unfinished warm-up here (its prefills so far are kept)."""
        self._chunks = None

    def _prefills(self) -> Iterator[None]:
        g = torch.Generator().manual_seed(0)
        vocab = self.backend.vocab_size
        t_start = time.perf_counter()
        for start, n in self.plan:
            ids = torch.randint(0, vocab, (start + n,), generator=g)
            state = self.backend.new_state(start + n)
            for i in range(0, start, self.chunk):
                self.backend.prefill(state, ids[i : min(start, i + self.chunk)])
                yield
            seconds = 0.0
            for i in range(start, start + n, self.chunk):
                t0 = time.perf_counter()
                self.backend.prefill(state, ids[i : min(start + n, i + self.chunk)])
                seconds += time.perf_counter() - t0
                yield
            del state
            self.cost.record(start, n, seconds)
            self.done += 1
        self.cost.save()
        self.seconds = time.perf_counter() - t_start
