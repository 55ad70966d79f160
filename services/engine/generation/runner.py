"""Runs one step's batch through the backend: the tokens each scheduled sequence
feeds, as one batched forward."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from keepwarm.engine.generation.decode_graph import DecodeGraphs
from keepwarm.engine.generation.scheduler_output import Scheduled
from keepwarm.engine.models.backend import Backend
from keepwarm.engine.models.rewind import Rewind


@dataclass(frozen=True)
class StepOutput:
    # seq_id -> [vocab] float32 after its last fed token; with a draft, [1 + k, vocab]: after
    # the last real token and after each drafted one
    logits: dict[int, torch.Tensor]
    seconds: float
    num_tokens: int  # rows of the forward, drafted ones included
    rewinds: dict[int, Rewind] = field(default_factory=dict)  # seq_id -> undo of a drafted entry


class Runner:
    def __init__(self, backend: Backend, graphs: DecodeGraphs | None = None) -> None:
        self.backend = backend
        self.graphs = graphs  # decode steps (one token per sequence) run static / captured

    def run(self, batch: Sequence[Scheduled]) -> StepOutput:
        """One forward over every entry that feeds tokens; entries with 0 tokens take the
        logits their state already holds (an exact cache hit). An entry's draft is fed after
        its tokens, with logits for each drafted row, and what it overwrites saved first."""
        t0 = time.perf_counter()
        work = [b for b in batch if b.num_tokens > 0]
        out: dict[int, torch.Tensor] = {}
        rewinds: dict[int, Rewind] = {}
        rows = 0
        if work:
            states, chunks, heads = [], [], []
            for b in work:
                seq, state = b.seq, b.seq.state
                n = b.num_tokens + len(b.draft)
                assert state is not None and state.position + n <= state.capacity
                p = state.position
                states.append(state)
                chunks.append(seq.tokens[p : p + b.num_tokens] + list(b.draft))
                heads.append(1 + len(b.draft))
                if b.draft:
                    rewinds[seq.seq_id] = Rewind.before(self.backend.geometry, state, n)
                rows += n
            logits = None
            if self.graphs is not None and all(len(c) == 1 for c in chunks):
                logits = self.graphs.run(states, [c[0] for c in chunks])
            if logits is None:
                tensors = [torch.tensor(c, dtype=torch.long) for c in chunks]
                logits = (
                    self.backend.step(states, tensors, heads)
                    if rewinds
                    else self.backend.step(states, tensors)
                )
            if self.backend.device.type == "cuda":
                torch.cuda.synchronize(self.backend.device)
            at = 0
            for b, h in zip(work, heads, strict=True):
                out[b.seq.seq_id] = logits[at : at + h] if b.draft else logits[at]
                at += h
        for b in batch:
            if b.num_tokens == 0:
                assert b.seq.state is not None and b.seq.state.logits is not None
                out[b.seq.seq_id] = b.seq.state.logits
        return StepOutput(out, time.perf_counter() - t0, rows, rewinds)
