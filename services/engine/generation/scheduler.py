"""Which sequences run in the next step, and how many tokens each feeds.

Per step, a token budget (`max_batch_tokens`) is shared: first one token for each
running sequence that is decoding, then prefill chunks for running sequences
still prefilling (oldest first), then newly admitted sequences (first come,
first served, preempted ones before new ones). A prefill chunk ends at the
sequence's next save point, so snapshots are taken at exact positions; a long
prompt therefore delays running decodes by at most one step. At most
`max_seqs` sequences run at once; a sequence is admitted only when its state
fits the memory budget (the engine's `admit` decides and restores it).

A prefix is prefilled once even when requests sharing it arrive together: a waiting
sequence whose prompt starts with a prefix that a running sequence is about to snapshot
(one of its pending save points) stays waiting until that snapshot exists, then restores
it; sequences behind it that share nothing may go first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from keepwarm.engine.generation.sequence import Sequence, Status


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens fed this step; 0: sample from the logits the state already has


class Scheduler:
    def __init__(self, max_seqs: int, max_batch_tokens: int, chunk_size: int) -> None:
        assert max_seqs >= 1 and max_batch_tokens >= 1 and chunk_size >= 1
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
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

    def schedule(
        self, admit: Callable[[Sequence], bool], cached_depth: Callable[[Sequence], int] = lambda seq: 0
    ) -> list[Scheduled]:
        """The next step's work. `admit(seq)` gives a waiting sequence its state (restore,
        allocation) and returns False when memory cannot hold it yet; `cached_depth(seq)` is
        how deep a prefix of its prompt the cache already holds."""
        budget = self.max_batch_tokens
        out: list[Scheduled] = []
        for seq in self.running:  # decodes: one token each
            if not seq.prefilling and budget > 0:
                n = seq.num_tokens_to_feed()
                out.append(Scheduled(seq, n))
                budget -= n
        for seq in self.running:  # prefills already under way
            if seq.prefilling and budget > 0:
                n = self._chunk(seq, budget)
                out.append(Scheduled(seq, n))
                budget -= n
        deferred: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            if self._awaits_shared_prefix(seq, cached_depth):
                deferred.append(self.waiting.popleft())
                continue
            if not admit(seq):
                break  # first come, first served: nobody overtakes the head of the line
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget) if seq.prefilling else seq.num_tokens_to_feed()
            out.append(Scheduled(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back in their places, in order
        return out

    def _awaits_shared_prefix(self, seq: Sequence, cached_depth: Callable[[Sequence], int]) -> bool:
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
                return cached_depth(seq) < p
        return False

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens_to_feed(), self.chunk_size, budget)
        point = seq.next_save_point()
        if point is not None:
            n = min(n, point - seq.position)
        assert n >= 1
        return n
