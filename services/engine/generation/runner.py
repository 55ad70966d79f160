"""Runs one step's batch through the backend, and keeps what cold prefill costs on
this machine (to say what a restore saved)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from keepwarm.engine.generation.scheduler import Scheduled
from keepwarm.engine.models.backend import Backend


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


@dataclass(frozen=True)
class StepOutput:
    logits: dict[int, torch.Tensor]  # seq_id -> [vocab] float32 after its last fed token
    seconds: float
    num_tokens: int


class Runner:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.clock = PrefillClock()

    def run(self, batch: Sequence[Scheduled]) -> StepOutput:
        """One forward over every entry that feeds tokens; entries with 0 tokens take the
        logits their state already holds (an exact cache hit)."""
        t0 = time.perf_counter()
        work = [b for b in batch if b.num_tokens > 0]
        out: dict[int, torch.Tensor] = {}
        if work:
            states, chunks = [], []
            for b in work:
                seq, state = b.seq, b.seq.state
                assert state is not None and state.position + b.num_tokens <= state.capacity
                p = state.position
                states.append(state)
                chunks.append(torch.tensor(seq.tokens[p : p + b.num_tokens], dtype=torch.long))
            logits = self.backend.step(states, chunks)
            if self.backend.device.type == "cuda":
                torch.cuda.synchronize(self.backend.device)
            for b, row in zip(work, logits, strict=True):
                out[b.seq.seq_id] = row
        for b in batch:
            if b.num_tokens == 0:
                assert b.seq.state is not None and b.seq.state.logits is not None
                out[b.seq.seq_id] = b.seq.state.logits
        return StepOutput(out, time.perf_counter() - t0, sum(b.num_tokens for b in work))
