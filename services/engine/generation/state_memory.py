"""One byte budget for the state of every running sequence (all families).

Per-sequence slots, not paged blocks: each family's state is a handful of
tensors whose layout the backend owns (K/V rows, recurrent and conv states,
compressed rows, hyper-connection streams), and its attention reads contiguous
rows. Paging would need every family's kernels to gather through a block table;
slots keep the model code plain and the snapshot export a set of views. A slot
holds `capacity` tokens, rounded up to BLOCK; it grows (a copy into a larger
slot, geometric so the copies amortize) when a sequence outgrows it. The price
is internal fragmentation of up to one growth step per sequence, which the
accounting charges honestly: the budget counts allocated capacity, not rows used.
"""

from __future__ import annotations

import math

import torch

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.models.backend import Backend, State

BLOCK = 256  # capacity granularity, tokens


class StateMemory:
    def __init__(self, backend: Backend, budget_bytes: int, max_context: int, block: int = BLOCK) -> None:
        self.backend = backend
        self.block = block
        self.budget_bytes = budget_bytes
        self.max_context = max_context
        self.used_bytes = 0
        self.peak_bytes = 0

    def bytes_for(self, capacity: int) -> int:
        """State bytes of one sequence with room for `capacity` tokens (from geometry)."""
        total = 0
        for s in self.backend.geometry.specs:
            if s.name == LOGITS:
                continue
            size = torch.empty((), dtype=s.dtype).element_size()
            total += math.prod(s.shape_at(capacity)) * size
        return total

    def capacity_for(self, num_tokens: int) -> int:
        return min(self.max_context, max(self.block, -(-num_tokens // self.block) * self.block))

    def fits(self, num_tokens: int) -> bool:
        return self.used_bytes + self.bytes_for(self.capacity_for(num_tokens)) <= self.budget_bytes

    def allocate(self, num_tokens: int) -> State | None:
        """An empty state with room for `num_tokens`, or None when the budget is full."""
        cap = self.capacity_for(num_tokens)
        if not self._reserve(self.bytes_for(cap)):
            return None
        return self.backend.new_state(cap)

    def adopt(self, snapshot: Snapshot, num_tokens: int) -> State | None:
        """A state equal to `snapshot` with room for `num_tokens`, or None when full."""
        cap = self.capacity_for(max(num_tokens, snapshot.position))
        need = self.bytes_for(cap)
        if not self._reserve(need):
            return None
        try:
            return self.backend.adopt(snapshot, cap)
        except BaseException:
            self.used_bytes -= need
            raise

    def grow(self, state: State, num_tokens: int) -> State | None:
        """`state` moved into a slot of at least `num_tokens` (geometric growth; the budget
        then holds the new slot instead of the old), or None when the budget cannot hold
        the larger slot (the old one is kept)."""
        assert num_tokens <= self.max_context, "a sequence never outgrows max_context"
        if num_tokens <= state.capacity:
            return state
        cap = self.capacity_for(max(num_tokens, int(state.capacity * 1.5)))
        extra = self.bytes_for(cap) - self.bytes_for(state.capacity)
        if not self._reserve(extra):
            cap = self.capacity_for(num_tokens)  # the least that would do
            extra = self.bytes_for(cap) - self.bytes_for(state.capacity)
            if not self._reserve(extra):
                return None
        if state.position == 0:
            grown = self.backend.new_state(cap)
        else:
            grown = self.backend.adopt(self.backend.export(state), cap)
        return grown

    def free(self, state: State) -> None:
        self.used_bytes -= self.bytes_for(state.capacity)
        assert self.used_bytes >= 0, "state memory freed twice"

    def _reserve(self, num_bytes: int) -> bool:
        if self.used_bytes + num_bytes > self.budget_bytes:
            return False
        self.used_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True
