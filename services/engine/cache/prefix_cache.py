"""The two-tier prefix cache as the engine sees it: RAM LRU in front of disk,
keyed by (namespace, tenant salt, exact token prefix).

Lookup probes candidate prefix lengths deepest first; the first entry whose
stored tokens equal the prompt's prefix and whose tensors fit the model's
geometry wins. A disk hit is promoted to RAM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.memory_cache import MemoryCache
from keepwarm.engine.cache.prefix_key import prefix_key, prefix_keys
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import Alloc


@dataclass(frozen=True)
class SessionHint:
    """The session's last prefix as the gateway remembers it."""

    key: str
    num_tokens: int


@dataclass(frozen=True)
class Hit:
    key: str
    num_key_tokens: int
    snapshot: Snapshot
    source: str  # "memory" | "disk"
    seconds: float
    num_bytes: int
    tokens: tuple[int, ...] = ()  # the key's tokens
    aliased: bool = False  # the snapshot lives in the caller's `alloc` memory: promote() it later


@dataclass(frozen=True)
class Probe:
    """One prompt's candidate prefix lengths, deepest first, and their keys (hashed once per
    admission), and the deepest of them some tier holds by key alone (0: none)."""

    salt: str
    tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    keys: tuple[str, ...]
    hint: SessionHint | None
    depth: int


@dataclass(frozen=True)
class Lookup:
    """What `PrefixCache.read` says about a prompt: the deepest usable entry (None: a
    miss) and, when the session's last prefix was not reached, where the prompt left it."""

    hit: Hit | None
    diverged_at: int | None = None


def candidate_lengths(
    prompt_len: int,
    boundaries: Iterable[int],
    known_lengths: Iterable[int],
    hint: SessionHint | None,
    min_tokens: int,
) -> list[int]:
    """Prefix lengths to probe, deepest first: the session's last prefix, the whole
    prompt, every turn boundary, and every length the cache holds an entry of
    (continued checkpoints), all within [min_tokens, prompt_len]."""
    lengths = {prompt_len, *boundaries, *known_lengths}
    if hint is not None:
        lengths.add(hint.num_tokens)
    return sorted((n for n in lengths if min_tokens <= n <= prompt_len), reverse=True)


class PrefixCache:
    def __init__(
        self,
        namespace: str,
        memory: MemoryCache | None,
        disk: DiskCache | None,
        validate: Callable[[Snapshot], None],
    ) -> None:
        self.namespace = namespace
        self.memory = memory
        self.disk = disk
        self.validate = validate

    def key(self, salt: str, tokens: Sequence[int]) -> str:
        return prefix_key(self.namespace, salt, tokens)

    def known_lengths(self) -> set[int]:
        out: set[int] = set()
        if self.memory is not None:
            out.update(self.memory.token_counts())
        if self.disk is not None:
            out.update(self.disk.known_lengths())
        return out

    def probe(
        self,
        salt: str,
        tokens: Sequence[int],
        boundaries: Iterable[int],
        hint: SessionHint | None,
        min_tokens: int,
    ) -> Probe:
        """The prompt's candidate prefixes (the hint, the whole prompt, turn boundaries and
        every stored length), hashed once, and how deep a prefix some tier holds by key
        alone: nothing is read or validated (a scheduling estimate, not a hit)."""
        lengths = candidate_lengths(len(tokens), boundaries, self.known_lengths(), hint, min_tokens)
        keys = prefix_keys(self.namespace, salt, tokens, lengths)  # one hashing pass for all lengths
        depth = next((n for n, key in zip(lengths, keys, strict=True) if self._holds_any(key)), 0)
        return Probe(salt, tuple(tokens), tuple(lengths), tuple(keys), hint, depth)

    def read(self, probe: Probe, alloc: Alloc | None = None) -> Lookup:
        """The engine's one question to the cache: the deepest usable entry among `probe`'s
        candidates (keys hashed by `probe`). A miss against the session's last prefix is
        explained only when that entry was keyed with the caller's salt: another tenant's
        key never yields a position."""
        hit = None
        for n, key in zip(probe.lengths, probe.keys, strict=True):
            hit = self._probe(key, list(probe.tokens[:n]), alloc)
            if hit is not None:
                break
        hint, tokens, diverged = probe.hint, probe.tokens, None
        if hint is not None and (hit is None or hit.num_key_tokens < hint.num_tokens):
            last = self.stored_tokens(hint.key)
            if last is not None and self.key(probe.salt, last) == hint.key:
                d = diverged_at(tokens, last)
                diverged = d if d < min(len(last), len(tokens)) else None  # a real difference
        return Lookup(hit, diverged)

    def promote(self, hit: Hit) -> None:
        """Put an aliased disk hit into the RAM tier (a copy: the alias is reused later)."""
        if hit.aliased and self.memory is not None and hit.key not in self.memory:
            self._remember(hit.key, list(hit.tokens), hit.snapshot.detached())

    def _probe(self, key: str, tokens: list[int], alloc: Alloc | None) -> Hit | None:
        t0 = time.perf_counter()
        if self.memory is not None:
            found = self.memory.get(key)
            if found is not None:
                stored_tokens, snap = found
                if stored_tokens == tokens:
                    return Hit(
                        key,
                        len(tokens),
                        snap,
                        "memory",
                        time.perf_counter() - t0,
                        snap.num_bytes,
                        tuple(tokens),
                    )
                self.memory.remove(key)  # a hash collision or a stale entry: never adopt it
        if self.disk is not None and self.disk.contains(key):
            snap = self.disk.load(key, tokens, self.validate, alloc)
            if snap is not None:
                if alloc is None:
                    self._remember(key, tokens, snap)
                return Hit(
                    key,
                    len(tokens),
                    snap,
                    "disk",
                    time.perf_counter() - t0,
                    snap.num_bytes,
                    tuple(tokens),
                    aliased=alloc is not None,
                )
        return None

    def _holds_any(self, key: str) -> bool:
        """Whether some tier stores `key` (by key alone)."""
        return (self.memory is not None and key in self.memory) or (
            self.disk is not None and self.disk.contains(key)
        )

    def _missing(self, key: str) -> tuple[bool, bool]:
        """Whether the RAM tier and the disk tier lack `key` (a tier that is off lacks nothing)."""
        return (self.memory is not None and key not in self.memory), (
            self.disk is not None and not self.disk.contains(key)
        )

    def holds(self, key: str) -> bool:
        """Whether every tier already stores `key` (a save of it would be a no-op)."""
        return not any(self._missing(key))

    def save(self, salt: str, tokens: Sequence[int], snapshot: Snapshot) -> str:
        """Store a detached copy of `snapshot` under the key of `tokens` in both tiers."""
        key = self.key(salt, tokens)
        self.store(key, tokens, snapshot)
        return key

    def store(self, key: str, tokens: Sequence[int], snapshot: Snapshot, *, detached: bool = False) -> None:
        """`save` under `key` (= self.key(salt, tokens), computed by the caller); no copy when the
        caller says `snapshot` is `detached` (host memory it gives away) or every tier holds it."""
        assert snapshot.position <= len(tokens), "a snapshot is never keyed by fewer tokens than it covers"
        need_memory, need_disk = self._missing(key)
        if not (need_memory or need_disk):
            return
        toks = list(tokens)
        copy = snapshot if detached else snapshot.detached()
        if need_memory:
            self._remember(key, toks, copy)
        if need_disk and self.disk is not None:
            self.disk.save(key, toks, copy, detached=True)

    def _remember(self, key: str, tokens: list[int], snapshot: Snapshot) -> None:
        if self.memory is not None:
            self.memory.put(key, tokens, snapshot, detached=True)

    def stored_tokens(self, key: str) -> list[int] | None:
        """The tokens an entry was keyed by (to explain a miss), or None."""
        if self.memory is not None:
            found = self.memory.tokens(key)
            if found is not None:
                return found
        if self.disk is not None:
            return self.disk.stored_tokens(key)  # the no-follow walk below the cache root
        return None


def diverged_at(a: Sequence[int], b: Sequence[int]) -> int:
    """First position where two token sequences differ (the shorter length if one is a prefix)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
