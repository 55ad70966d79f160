"""Namespace ids and the cached weights fingerprint."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import xxhash

from keepwarm.engine.cache import namespace as ns
from keepwarm.engine.cache.namespace import (
    namespace_id,
    text_hash,
    weights_fingerprint,
)

NS_FIELDS = dict(
    format_version=1,
    family="dense",
    weights_fingerprint="w",
    tokenizer_hash="t",
    chat_template_hash="c",
    dtype="bfloat16",
    layout_id="l",
    weights_format="safetensors",
    kernels="cpu_invariant:0123456789abcdef",
)


def test_namespace_id_is_pinned_and_changes_with_every_field() -> None:
    base = namespace_id(**NS_FIELDS)
    assert base == "8b990747a1f65404a8bae641989dbc2d"
    changed = set()
    for name, value in NS_FIELDS.items():
        other = dict(NS_FIELDS)
        other[name] = 2 if name == "format_version" else f"{value}x"
        changed.add(namespace_id(**other))  # type: ignore[arg-type]
    assert base not in changed and len(changed) == len(NS_FIELDS)


def test_text_hash() -> None:
    assert text_hash("{{ messages }}") == hashlib.sha256(b"{{ messages }}").hexdigest()[:32]
    assert text_hash("a") != text_hash("b")


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_weights_fingerprint_hashes_content_not_location(tmp_path: Path) -> None:
    a1 = _write(tmp_path / "a" / "model-1.safetensors", b"x" * 1000)
    a2 = _write(tmp_path / "a" / "model-2.safetensors", b"y" * 3000)
    b1 = _write(tmp_path / "b" / "model-1.safetensors", b"x" * 1000)
    b2 = _write(tmp_path / "b" / "model-2.safetensors", b"y" * 3000)
    fa = weights_fingerprint([a1, a2], None)
    assert fa == weights_fingerprint([b2, b1], None)  # other folder, other order
    expected = xxhash.xxh3_128()
    for name, data in sorted([("model-1.safetensors", b"x" * 1000), ("model-2.safetensors", b"y" * 3000)]):
        expected.update(f"{name}\0{len(data)}\0{xxhash.xxh3_128_hexdigest(data)}\n".encode())
    assert fa == expected.hexdigest()
    _write(b2, b"y" * 2999 + b"z")
    assert weights_fingerprint([b1, b2], None) != fa
    with pytest.raises(ValueError, match="at least one"):
        weights_fingerprint([], None)


def test_weights_fingerprint_cache_skips_rehash_until_size_or_mtime_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _write(tmp_path / "m" / "model.safetensors", b"abc" * 5000)
    cache = tmp_path / "state" / "fingerprints.json"
    reads: list[Path] = []
    real = ns._file_digest

    def counting(path: Path) -> str:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(ns, "_file_digest", counting)
    first = weights_fingerprint([w], cache)
    assert len(reads) == 1 and cache.is_file()
    assert weights_fingerprint([w], cache) == first  # a restart: answered from the cache
    assert len(reads) == 1
    st = w.stat()
    w.write_bytes(b"abd" * 5000)  # same size, new content, new mtime
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = weights_fingerprint([w], cache)
    assert len(reads) == 2 and second != first
    cache.write_text("{not json")  # a damaged cache is rebuilt, not trusted
    assert weights_fingerprint([w], cache) == second and len(reads) == 3


def test_the_kernels_enter_the_namespace_by_bundle_and_sources() -> None:
    """Snapshots of the invariant kernels and of the others (--deterministic false) never mix,
    nor those of two versions of the kernels' code."""
    from keepwarm.kernels.ops import TORCH_OPS, cpu_ops, kernel_sources_digest, kernels_id

    digest = kernel_sources_digest()
    assert len(digest) == 16 and kernels_id(TORCH_OPS) == f"torch:{digest}"
    assert kernels_id(cpu_ops(True)) != kernels_id(cpu_ops(False)) or cpu_ops(True) is cpu_ops(False)
    other = namespace_id(**{**NS_FIELDS, "kernels": f"cpu_invariant:{'f' * 16}"})  # type: ignore[arg-type]
    assert other != namespace_id(**NS_FIELDS)  # type: ignore[arg-type]


def test_the_cpu_kernels_build_enters_the_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines on an AVX-512 and on an AVX2 CPU sharing one cache folder keep their snapshots
    apart (the two builds' bf16 products need not have the same bits); a GPU bundle's do not
    depend on the host's CPU."""
    from dataclasses import replace

    from keepwarm.kernels import cpu_linear
    from keepwarm.kernels.ops import TORCH_OPS, kernel_sources_digest, kernels_id

    cpu = replace(TORCH_OPS, name="cpu_invariant")
    digest = kernel_sources_digest()
    monkeypatch.setattr(
        cpu_linear, "cpu_flags", lambda: frozenset({*cpu_linear.REQUIRED_FLAGS, *cpu_linear.AVX2_FLAGS})
    )
    monkeypatch.delenv(cpu_linear.ISA_ENV, raising=False)
    assert kernels_id(cpu) == f"cpu_invariant[avx512_bf16]:{digest}"
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx2")
    assert kernels_id(cpu) == f"cpu_invariant[avx2]:{digest}"
    monkeypatch.setattr(cpu_linear, "cpu_flags", frozenset)
    assert kernels_id(cpu) == f"cpu_invariant[None]:{digest}"
    assert kernels_id(replace(TORCH_OPS, name="triton_invariant")) == f"triton_invariant:{digest}"
