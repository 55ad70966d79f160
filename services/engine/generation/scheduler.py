"""Which sequences run in the next step, how many tokens each feeds, and what makes room.

Per step, a token budget (`max_batch_tokens`) is shared: first one token for each
running sequence that is decoding, then prefill chunks for running sequences
still prefilling (oldest first), then newly admitted sequences (first come,
first served, preempted ones before new ones), and what is left to speculative drafts
of decoding sequences (never a row anyone else would have had). A prefill chunk ends at the
sequence's next save point, so snapshots are taken at exact positions; a long
prompt therefore delays running decodes by at most one step. At most
`max_seqs` sequences run at once.

Admission, growth and preemption are decided here, when the batch is planned, from two
typed views: `StateMemory` (the state byte budget) and a `CacheView` (the snapshot
pipeline: one lookup per admission, carried on the sequence as `seq.probe`). A sequence is
admitted only when its state fits; a state the step outgrows grows, and when the budget
cannot hold it the newest running sequence is preempted (parked as a snapshot, first in
line to come back). The answer is one `SchedulerOutput`; nothing here calls the engine.

A prefix is prefilled once even when requests sharing it arrive together: a waiting
sequence whose prompt starts with a prefix that a running sequence is about to snapshot
(one of its pending save points) stays waiting until that snapshot exists, then restores
it; sequences behind it that share nothing may go first.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from keepwarm.engine.cache.prefix_cache import Probe
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.generation.scheduler_output import Scheduled, SchedulerOutput
from keepwarm.engine.generation.sequence import Sequence, Status
from keepwarm.engine.generation.state_memory import StateMemory

__all__ = ["CacheView", "Scheduled", "Scheduler", "SchedulerOutput"]


class CacheView(Protocol):
    """What scheduling asks of the cache (the snapshot pipeline implements it)."""

    def probe(self, seq: Sequence) -> Probe | None:
        """The admission's one lookup, carried on `seq.probe` (None: no cache for it)."""
        ...

    def restore(self, seq: Sequence) -> None:
        """A new sequence's empty state takes its deepest usable cached prefix."""
        ...

    def park(self, seq: Sequence) -> Snapshot | None:
        """A preempted sequence's state as a host snapshot (None: nothing computed yet)."""
        ...


class Scheduler:
    def __init__(
        self, max_seqs: int, max_batch_tokens: int, chunk_size: int, memory: StateMemory, cache: CacheView
    ) -> None:
        assert max_seqs >= 1 and max_batch_tokens >= 1 and chunk_size >= 1
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.memory = memory
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence: first in line to come back."""
        assert seq.status is Status.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        """The next step's work: the batch, every state in it grown to fit."""
        budget = self.max_batch_tokens
        batch: list[Scheduled] = []
        admitted: list[Sequence] = []
        out_of_memory: list[Sequence] = []
        for seq in self.running:  # decodes: one token each
            if not seq.prefilling and budget > 0:
                n = seq.num_tokens_to_feed()
                batch.append(Scheduled(seq, n))
                budget -= n
        for seq in self.running:  # prefills already under way
            if seq.prefilling and budget > 0:
                n = self._chunk(seq, budget)
                batch.append(Scheduled(seq, n))
                budget -= n
        deferred: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            if self._awaits_shared_prefix(seq):
                seq.probe = None  # looked up again when it comes back: the cache will have moved
                deferred.append(self.waiting.popleft())
                continue
            if not self._admit(seq, admitted, out_of_memory):
                seq.probe = None
                break  # first come, first served: nobody overtakes the head of the line
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget) if seq.prefilling else seq.num_tokens_to_feed()
            batch.append(Scheduled(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back in their places, in order
        batch = self._draft(batch, budget)
        preempted: list[Sequence] = []
        batch = self._fit(batch, preempted, out_of_memory)
        return SchedulerOutput(tuple(batch), tuple(admitted), tuple(preempted), tuple(out_of_memory))

    def _admit(self, seq: Sequence, admitted: list[Sequence], out_of_memory: list[Sequence]) -> bool:
        """Give a waiting sequence its state: a preempted one adopts its parked snapshot;
        a new one restores the deepest cached prefix. False: memory is full for now."""
        want = len(seq.tokens) + 1
        alone = not self.running
        if seq.num_preemptions and seq.parked is None:  # preempted before its first token
            state = self.memory.allocate(want)
            if state is None:
                return False
            seq.state = state
        elif seq.parked is not None:
            state = self.memory.adopt(seq.parked, want)
            if state is None:
                if alone:  # it cannot fit even with nothing else running: end the reply here
                    self.waiting.remove(seq)
                    out_of_memory.append(seq)
                return False
            seq.state, seq.parked = state, None
        else:
            state = self.memory.allocate(want)
            if state is None:
                return False
            seq.state = state
            self.cache.restore(seq)
            admitted.append(seq)
        return True

    @staticmethod
    def _draft(batch: list[Scheduled], budget: int) -> list[Scheduled]:
        """What the budget has left after every decode and prefill goes to drafts of decoding
        sequences that speculate (generation/speculation.py), in batch order: a draft never
        takes a row from anyone. A draft stops before the reply's token limit."""
        out = []
        for b in batch:
            seq = b.seq
            if budget > 0 and seq.spec is not None and b.num_tokens > 0 and seq.num_generated > 0:
                room = seq.decoding.max_new_tokens - seq.num_generated - 1
                draft = seq.spec.propose(seq.tokens, min(budget, room))
                if draft:
                    b = Scheduled(seq, b.num_tokens, draft)
                    budget -= len(draft)
            out.append(b)
        return out

    def _fit(
        self, batch: list[Scheduled], preempted: list[Sequence], out_of_memory: list[Sequence]
    ) -> list[Scheduled]:
        """Grow the states that this step outgrows; when memory runs out, preempt the
        newest running sequences (possibly the one that needed room) until it fits."""
        keep = list(batch)
        for b in batch:
            seq = b.seq
            if b not in keep or seq.state is None:
                continue
            need = seq.state.position + b.num_tokens + len(b.draft)
            while need > seq.state.capacity:
                grown = self.memory.grow(seq.state, need)
                if grown is not None:
                    seq.state = grown
                    break
                if b.draft:  # a draft never preempts anyone: it goes instead
                    keep[keep.index(b)] = b = Scheduled(seq, b.num_tokens)
                    need = seq.state.position + b.num_tokens
                    continue
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self.running.remove(seq)  # alone and out of memory: end the reply here
                    out_of_memory.append(seq)
                    keep = [k for k in keep if k.seq is not seq]
                    break
                self._preempt(victim)
                preempted.append(victim)
                keep = [k for k in keep if k.seq is not victim]
                if victim is seq:
                    break
        return keep

    def _preempt(self, seq: Sequence) -> None:
        assert seq.state is not None
        snap = self.cache.park(seq)
        self.memory.free(seq.state)
        seq.state, seq.parked = None, snap
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.requeue(seq)

    def _awaits_shared_prefix(self, seq: Sequence) -> bool:
        """Whether a running sequence will snapshot, in this prefill, a prefix of `seq`'s
        prompt deeper than anything cached for it (`seq` would compute the same tokens
        alongside). Cost: one comparison of at most a prompt's length per running sequence."""
        if not seq.policy.enabled or seq.num_preemptions or seq.parked is not None:
            return False
        for other in self.running:
            if not other.prefilling or other.salt != seq.salt:
                continue
            p = next((p for p in other.save_points if other.position < p <= seq.num_prompt_tokens), None)
            if p is not None and seq.tokens[:p] == other.tokens[:p]:
                probe = self.cache.probe(seq)
                return (probe.depth if probe is not None else 0) < p
        return False

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens_to_feed(), self.chunk_size, budget)
        point = seq.next_save_point()
        if point is not None:
            n = min(n, point - seq.position)
        assert n >= 1
        return n
