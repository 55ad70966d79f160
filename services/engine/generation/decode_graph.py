"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A decode step feeds one token to each of B sequences. On a GPU, launching its dozen
kernels per layer from Python costs more than running them at small B, so the step is
recorded once per bucket (1, 2, 4, 8, then multiples of 8 up to `max_seqs`) and replayed.
The graph reads everything that changes between steps from static device buffers that each
replay refills: the tokens, the positions and the addresses of each sequence's state
buffers (`StaticDecode.state_addresses`), so sequences whose states live anywhere in
memory share one graph and nothing is allocated per token. Attention lengths come from the
positions on the device (kernels/triton_invariant.py `decode_attention_table`); the RoPE
tables are built for every position below max_context before the first capture.

A batch is padded up to its bucket with rows that write and read a scratch state of their
own. The kernels are row-invariant (a row's bits do not depend on the other rows), so the
padding, the bucket and the capture change no output bit: a replayed step equals the
eager `Backend.step` bitwise. Without a GPU the same static function runs uncaptured (the
tests run it on CPU under the Triton interpreter); `--enforce-eager` turns both off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from keepwarm.engine.models.backend import Backend, State, StaticDecode


def buckets(max_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8, the last
    covering max_seqs."""
    out = [b for b in (1, 2, 4) if b < max_seqs]
    out += list(range(8, max_seqs + 8, 8)) if max_seqs > 4 else [max_seqs]
    return out


class DecodeGraphs:
    def __init__(self, backend: StaticDecode, max_seqs: int, capture: bool) -> None:
        self.backend = backend
        self.device = device = backend.device
        self.capture = capture
        self.buckets = buckets(max_seqs)
        n = self.buckets[-1]
        # padding rows' state: room for the one row each writes at position 0
        self.scratch = backend.new_state(1)
        self.pad_addresses = backend.state_addresses(self.scratch)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.addresses = torch.zeros((len(self.pad_addresses), n), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's logits [bucket, vocab]
        self.pool: Any = None  # one memory pool handle shared by every bucket's graph

    @staticmethod
    def for_backend(
        backend: Backend, max_seqs: int, max_context: int, enforce_eager: bool
    ) -> DecodeGraphs | None:
        """The graphs for `backend` (captured on a GPU), or None with `enforce_eager` and where
        its decode step cannot run static (a family without `StaticDecode`, ops without
        address-table kernels, layers on several devices): then every step is eager."""
        if enforce_eager or not isinstance(backend, StaticDecode) or not backend.static_decode(max_context):
            return None
        return DecodeGraphs(backend, max_seqs, capture=backend.device.type == "cuda")

    def run(self, states: Sequence[State], tokens: Sequence[int]) -> torch.Tensor | None:
        """Feed tokens[j] to states[j] (each at its own position, room for one more row):
        logits [B, vocab] float32, positions and logits advanced as `Backend.step` does.
        None when B exceeds the largest bucket (the caller steps eagerly)."""
        n = len(states)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or n == 0:
            return None
        pad = bucket - n
        for s in states:
            assert s.position < s.capacity, "a decode row needs room in its state"
        host = torch.tensor([[*tokens, *[0] * pad], [s.position for s in states] + [0] * pad])
        addrs = [self.backend.state_addresses(s) for s in states] + [self.pad_addresses] * pad
        self.tokens[:bucket].copy_(host[0])
        self.positions[:bucket].copy_(host[1])
        self.addresses[:, :bucket].copy_(torch.tensor(addrs, dtype=torch.int64).T)
        if self.capture:
            graph = self.graphs.get(bucket) or self._capture(bucket)
            graph.replay()
            out = self.outputs[bucket]
        else:
            out = self.backend.decode_rows(*self._inputs(bucket))
        logits = out[:n].clone()  # the graph's buffer is rewritten by the next replay
        for state, row in zip(states, logits, strict=True):
            state.position += 1
            state.logits = row
        return logits

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens[:bucket], self.positions[:bucket], self.addresses[:, :bucket]

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        """Record the bucket's step (after one warm-up run on a side stream, as torch asks:
        kernels compile and the allocator settles outside the capture). The warm-up writes
        the same rows the replay that follows writes again."""
        inputs = self._inputs(bucket)
        compute = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            self.backend.decode_rows(*inputs)
        compute.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bucket] = self.backend.decode_rows(*inputs)
        self.pool = graph.pool()
        self.graphs[bucket] = graph
        return graph
