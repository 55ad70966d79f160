"""A save handed to the disk tier's writer thread: the key, its token ids and a detached snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from keepwarm.engine.cache.snapshot import Snapshot


@dataclass
class WriteJob:
    key: str
    tokens: list[int]
    snapshot: Snapshot
