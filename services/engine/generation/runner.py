"""Runs one step's batch through the backend: the tokens each scheduled sequence
feeds, as one batched forward."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from keepwarm.engine.generation.decode_graph import DecodeGraphs
from keepwarm.engine.generation.scheduler_output import Scheduled
from keepwarm.engine.models.backend import Backend


@dataclass(frozen=True)
class StepOutput:
    logits: dict[int, torch.Tensor]  # seq_id -> [vocab] float32 after its last fed token
    seconds: float
    num_tokens: int


class Runner:
    def __init__(self, backend: Backend, graphs: DecodeGraphs | None = None) -> None:
        self.backend = backend
        self.graphs = graphs  # decode steps (one token per sequence) run static / captured

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
                chunks.append(seq.tokens[p : p + b.num_tokens])
            logits = None
            if self.graphs is not None and all(len(c) == 1 for c in chunks):
                logits = self.graphs.run(states, [c[0] for c in chunks])
            if logits is None:
                logits = self.backend.step(states, [torch.tensor(c, dtype=torch.long) for c in chunks])
            if self.backend.device.type == "cuda":
                torch.cuda.synchronize(self.backend.device)
            for b, row in zip(work, logits, strict=True):
                out[b.seq.seq_id] = row
        for b in batch:
            if b.num_tokens == 0:
                assert b.seq.state is not None and b.seq.state.logits is not None
                out[b.seq.seq_id] = b.seq.state.logits
        return StepOutput(out, time.perf_counter() - t0, sum(b.num_tokens for b in work))
