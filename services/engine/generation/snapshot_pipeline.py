"""The snapshot pipeline: where a sequence's state is saved, and how it reaches the cache.

One unit for every snapshot the engine takes or reads:
  - lookups for an admission (`probe` once, its result carried on the sequence; `restore`
    adopts the deepest usable prefix into the sequence's new state);
  - save points: where a prefill stops to snapshot (`save_points`, and the recent prompts
    that `auto` compares with);
  - host copies (`save`: started without waiting, see snapshot_copier) and their landing
    in the cache, oldest first (`land`);
  - continued checkpoints: a finished reply's last token fed so prompt + reply is saved
    for the next turn (`checkpoint`);
  - a preempted sequence's parked snapshot (`park`), also a cache entry.
Invariant: every cache lookup for an admission lands all pending copies first, so whether a
prompt reuses a prefix an earlier step saved never depends on copy timing.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Iterable

from keepwarm.engine.cache.prefix_cache import PrefixCache, Probe, diverged_at
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.runner import Runner
from keepwarm.engine.generation.scheduler_output import Scheduled
from keepwarm.engine.generation.sequence import Prompt, Sequence
from keepwarm.engine.generation.snapshot_copier import PendingSnapshot, SnapshotCopier
from keepwarm.engine.generation.state_memory import StateMemory
from keepwarm.engine.models.backend import Backend

MAX_AUTO_WINDOW = 256  # `auto:W` compares with at most this many recent prompts


class SnapshotPipeline:
    """Owned by one engine; used only from its stepping thread."""

    def __init__(self, cache: PrefixCache, backend: Backend, min_tokens: int) -> None:
        self.cache = cache
        self.backend = backend
        self.min_tokens = min_tokens
        # optional backend capability: read disk hits straight into a state's buffers
        self.restore_target = getattr(backend, "restore_target", None)
        self.copier = SnapshotCopier()
        # snapshots on their way to host memory, oldest first: (key, key tokens, copy);
        # they enter the cache in this order (see land)
        self.copies: deque[tuple[str, list[int], PendingSnapshot]] = deque()
        # (salt, prompt tokens) of recent requests for `auto`; int32 arrays: 4 bytes a token
        self.recent_prompts: deque[tuple[str, array[int]]] = deque(maxlen=MAX_AUTO_WINDOW)
        self.num_saved = 0

    # -- the scheduler's view of the cache --------------------------------------------
    def probe(self, seq: Sequence) -> Probe | None:
        """The one lookup of an admission, carried on `seq` until it is admitted (None: the
        sequence's policy consults no cache)."""
        if not seq.policy.enabled:
            return None
        if seq.probe is None:
            self.land(wait=True)  # the cache is consulted for an admission: see the invariant
            prompt = seq.tokens[: seq.num_prompt_tokens]
            seq.probe = self.cache.probe(
                seq.salt, prompt, seq.boundaries, seq.request.session_hint, self.min_tokens
            )
        return seq.probe

    def restore(self, seq: Sequence) -> None:
        """A new sequence's state (just allocated, empty) takes the deepest usable cached
        prefix of its prompt; then its save points are planned from where it starts."""
        if not seq.policy.enabled:
            return
        assert seq.state is not None
        probe = self.probe(seq)
        assert probe is not None
        seq.probe = None  # read once: the hit is carried on the sequence from here
        t0 = time.perf_counter()
        alloc = self.restore_target(seq.state) if self.restore_target is not None else None
        found = self.cache.read(probe, alloc)
        seq.reply.diverged_at = found.diverged_at
        if found.hit is not None:
            try:
                seq.state = self.backend.adopt(found.hit.snapshot, seq.state.capacity, into=seq.state)
                seq.hit = found.hit
                seq.reply.restore_s = time.perf_counter() - t0
            except ValueError:
                seq.state.position, seq.state.logits = 0, None  # a mismatch the tier missed: a miss
        prompt = Prompt(seq.tokens[: seq.num_prompt_tokens], seq.boundaries, seq.prompt_extends_to_next_turn)
        seq.save_points = self.save_points(seq.policy, seq.salt, prompt, seq.position)
        self.recent_prompts.append((seq.salt, array("i", seq.tokens)))

    def park(self, seq: Sequence) -> Snapshot | None:
        """A preempted sequence's state as a host snapshot (None: nothing computed yet)."""
        assert seq.state is not None
        if seq.state.position == 0:
            return None
        # a synchronous copy, unlike save's: preemption is rare, and the state is freed
        # (its memory reused) right after
        snap = self.backend.export(seq.state).detached()
        if seq.policy.enabled and seq.state.position >= self.min_tokens:
            # also a cache entry (the same host copy: nothing writes a stored snapshot); the
            # sequence keeps its own reference, so the RAM tier's LRU can never make it recompute
            tokens = seq.tokens[: snap.position]
            self.cache.store(self.cache.key(seq.salt, tokens), tokens, snap, detached=True)
        return snap

    # -- save points, copies, landing ---------------------------------------------------
    def save_points(self, policy: Policy, salt: str, prompt: Prompt, restored: int) -> list[int]:
        """Positions during this prefill where a snapshot is taken (deeper than the
        restored state, at least min_tokens)."""
        tokens, n = prompt.tokens, len(prompt.tokens)
        points: set[int] = set()
        inner = [b for b in prompt.boundaries if 0 < b < n]
        if policy.mode == "full":
            points.add(n)  # exact repeat of this prompt, and the next turn when the prompt extends to it
            if inner:
                points.add(inner[0])  # a shared system prompt
                if not prompt.extends_to_next_turn:
                    points.add(inner[-1])  # the history before this turn's reply: where the next turn forks
        elif policy.mode == "auto":
            recent = [toks for s, toks in list(self.recent_prompts)[-policy.window :] if s == salt]
            lcp = max((diverged_at(tokens, toks) for toks in recent), default=0)
            floored = [b for b in inner if b <= lcp]
            if floored:
                points.add(floored[-1])
        elif policy.mode == "fixed":
            points.add(min(policy.num_tokens, n))
        return sorted(p for p in points if p > restored and p >= self.min_tokens)

    def save(self, seq: Sequence, position: int) -> None:
        """Start the host copy of the state at `position` without waiting for it; the
        copy enters the cache when it lands (at once on the CPU)."""
        assert seq.state is not None and seq.state.position == position
        tokens = seq.tokens[:position]
        key = self.cache.key(seq.salt, tokens)
        if not self.cache.holds(key):  # stored already: no copy
            self.copies.append((key, tokens, self.copier.start(self.backend.export(seq.state))))
        self.num_saved += 1
        self.land(wait=False)

    def land(self, wait: bool) -> None:
        """Hand finished snapshot copies to the cache, oldest first, stopping at the first
        still in flight; `wait`: wait for each instead. In order, so the tiers see the
        snapshots as a synchronous copy would have stored them."""
        while self.copies:
            key, tokens, pending = self.copies[0]
            if not wait and not pending.done():
                return
            self.copies.popleft()
            self.cache.store(key, tokens, pending.wait(), detached=True)

    def checkpoint(self, seqs: Iterable[Sequence], memory: StateMemory, runner: Runner) -> None:
        """Feed each finished sequence's last token in one batched forward and save the
        state covering prompt + reply under exactly those tokens (after the replies are
        out, before any new request is admitted). A state with no room for one more row
        (memory full) skips its checkpoint. The caller releases the sequences after."""
        room = []
        for seq in seqs:
            assert seq.state is not None
            need = len(seq.tokens)  # the last token; after a rejected draft maybe a few more
            if need > seq.state.capacity:
                grown = memory.grow(seq.state, need)
                if grown is None:
                    memory.free(seq.state)  # no room for one more row: no checkpoint, the room freed now
                    seq.state = None
                    continue
                seq.state = grown
            room.append(seq)
        if room:
            runner.run([Scheduled(s, s.num_tokens_to_feed()) for s in room])
            for seq in room:
                self.save(seq, len(seq.tokens))
