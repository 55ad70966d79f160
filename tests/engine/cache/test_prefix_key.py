"""Prefix keys: pinned, separated by salt, namespace and tokens, one pass for many lengths."""

from __future__ import annotations

import hashlib
import struct

import pytest

from keepwarm.engine.cache.prefix_key import prefix_key, prefix_keys


def _independent_key(namespace: str, salt: str, tokens: list[int]) -> str:
    """The documented construction, rebuilt from hashlib alone."""
    h = hashlib.blake2b(digest_size=16, person=b"keepwarm.key")
    for f in (namespace.encode(), salt.encode()):
        h.update(struct.pack("<I", len(f)) + f)
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return h.hexdigest()


def test_prefix_key_is_pinned_and_matches_the_documented_construction() -> None:
    # A golden value: changing it silently orphans every cache folder in the field.
    assert prefix_key("ns", "salt", [1, 2, 3]) == "0ddaccf33897fc7525e5ca16a87252b1"
    for tokens in ([], [0], [1, 2, 3], [-5, 2**31 - 1, 151643]):
        assert prefix_key("nsx", "s", tokens) == _independent_key("nsx", "s", tokens)


def test_prefix_key_separates_salt_namespace_tokens_and_length() -> None:
    base = prefix_key("ns", "tenant-a", [1, 2, 3])
    assert len(base) == 32 and int(base, 16) >= 0
    assert prefix_key("ns", "tenant-a", [1, 2, 3]) == base  # deterministic
    others = {
        prefix_key("ns", "tenant-b", [1, 2, 3]),  # tenant salt
        prefix_key("ns", "", [1, 2, 3]),  # identity (no) salt
        prefix_key("ns2", "tenant-a", [1, 2, 3]),  # namespace
        prefix_key("ns", "tenant-a", [1, 2, 4]),  # one token
        prefix_key("ns", "tenant-a", [1, 2]),  # shorter
        prefix_key("ns", "tenant-a", [1, 2, 3, 0]),  # longer by a zero token
        prefix_key("nst", "enant-a", [1, 2, 3]),  # field boundaries cannot shift
    }
    assert base not in others and len(others) == 7


def test_prefix_keys_equals_one_key_per_length() -> None:
    tokens = list(range(100, 140))
    lengths = [40, 0, 7, 7, 31]
    assert prefix_keys("ns", "s", tokens, lengths) == [prefix_key("ns", "s", tokens[:n]) for n in lengths]
    with pytest.raises(ValueError, match="outside 0..40"):
        prefix_keys("ns", "s", tokens, [41])


def test_prefix_key_rejects_non_int32_tokens() -> None:
    with pytest.raises(ValueError, match="int32"):
        prefix_key("ns", "s", [1, 2**31])
