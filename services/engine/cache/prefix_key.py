"""Prefix keys: which exact token prefix a snapshot holds inside its namespace.

A key names one exact token prefix inside a namespace for one tenant salt:
blake2b-128 of the length-prefixed namespace and salt followed by the int32
little-endian token ids. The token count needs no explicit field: every token
is exactly 4 bytes, so two different prefixes always give different messages.
That also lets `prefix_keys` hash many prefix lengths of one prompt in a single
pass (hasher.copy() at each length) instead of rehashing the prompt per probe.

Hashes here are cryptographic with fixed seeds; never Python's `hash()`, which is
salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as e:
        bad = next((t for t in tokens if not _INT32_MIN <= int(t) <= _INT32_MAX), None)
        raise ValueError(f"token ids must be int32; got {bad!r}") from e


def _hasher(namespace: str, salt: str) -> hashlib.blake2b:
    h = hashlib.blake2b(digest_size=16, person=b"keepwarm.key")
    for field in (namespace.encode(), salt.encode()):
        h.update(struct.pack("<I", len(field)))
        h.update(field)
    return h


def prefix_key(namespace: str, salt: str, tokens: Sequence[int]) -> str:
    """Key (32 hex) of the exact prefix `tokens` for one tenant `salt` in `namespace`."""
    h = _hasher(namespace, salt)
    h.update(_token_bytes(tokens))
    return h.hexdigest()


def prefix_keys(namespace: str, salt: str, tokens: Sequence[int], lengths: Sequence[int]) -> list[str]:
    """prefix_key(namespace, salt, tokens[:n]) for every n in `lengths`, in one pass
    over the tokens (probe lists: whole prompt plus every turn boundary)."""
    for n in lengths:
        if not 0 <= n <= len(tokens):
            raise ValueError(f"prefix length {n} outside 0..{len(tokens)}")
    h = _hasher(namespace, salt)
    data = _token_bytes(tokens)
    done = 0
    out: dict[int, str] = {}
    for n in sorted(set(lengths)):
        h.update(data[4 * done : 4 * n])
        done = n
        out[n] = h.copy().hexdigest()
    return [out[n] for n in lengths]
