"""Cache identity: what a snapshot belongs to (namespace; the keys inside it: prefix_key.py).

A snapshot may only ever be adopted by the exact model that wrote it, so the
namespace hashes everything that changes the meaning of the state bytes:
snapshot format version, family, the weights' *content* (not their path), the
tokenizer, the chat template, the runtime dtype and the tensor layout (names,
dtypes, shapes with the length dimension normalized; see models/geometry.py, Geometry.layout_id).

Hashes here are cryptographic or content hashes with fixed seeds; never
Python's `hash()`, which is salted per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import xxhash

_CHUNK = 8 << 20  # streaming read size for fingerprinting weights


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _load_fingerprint_cache(cache_file: Path | None) -> dict[str, dict[str, object]]:
    if cache_file is None:
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged cache: rehash, then rewrite it
    return data if isinstance(data, dict) else {}


def _store_fingerprint_cache(cache_file: Path, data: dict[str, dict[str, object]]) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True, indent=1))
    os.replace(tmp, cache_file)  # readers see the old or the new cache, never half of one


def weights_fingerprint(
    files: Sequence[Path], cache_file: Path | None = None, with_names: bool = True
) -> str:
    """Content hash (xxh3-128, 32 hex) of a checkpoint's weight files.

    Each file is hashed by streaming its bytes; the per-file digests are cached in
    `cache_file` (JSON keyed by absolute path, valid while size and mtime_ns are
    unchanged) so a restart does not rehash gigabytes. The result depends on the
    files' base names and contents only, so moving a model folder keeps its
    namespace; without `with_names` (one self-describing file, a GGUF) on the contents alone,
    so two paths to the same bytes share it. Raises FileNotFoundError naming a missing file.
    """
    if not files:
        raise ValueError("weights_fingerprint needs at least one weight file")
    cache = _load_fingerprint_cache(cache_file)
    dirty = False
    parts: list[tuple[str, int, str]] = []
    for f in files:
        path = Path(f).resolve()
        st = path.stat()
        entry = cache.get(str(path))
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("xxh3_128"), str)
        ):
            digest = str(entry["xxh3_128"])
        else:
            digest = _file_digest(path)
            cache[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3_128": digest}
            dirty = True
        parts.append((path.name if with_names else "", st.st_size, digest))
    if dirty and cache_file is not None:
        _store_fingerprint_cache(cache_file, cache)
    h = xxhash.xxh3_128()
    for name, size, digest in sorted(parts):
        h.update(f"{name}\0{size}\0{digest}\n".encode())
    return h.hexdigest()


def text_hash(s: str) -> str:
    """sha256 of the UTF-8 text, 32 hex (tokenizer.json contents, chat template source)."""
    return hashlib.sha256(s.encode("utf-8")).hexdigest()[:32]


def namespace_id(
    *,
    format_version: int,
    family: str,
    weights_fingerprint: str,
    tokenizer_hash: str,
    chat_template_hash: str,
    dtype: str,
    layout_id: str,
    weights_format: str,
    kernels: str,
) -> str:
    """32 hex naming everything a snapshot's bytes depend on (docs/architecture.md, 'Namespaces and keys')."""
    fields = {
        "kernels": kernels,
        "format_version": int(format_version),
        "family": family,
        "weights_fingerprint": weights_fingerprint,
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": chat_template_hash,
        "dtype": dtype,
        "layout_id": layout_id,
        "weights_format": weights_format,
    }
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"keepwarm.namespace\0" + blob).hexdigest()[:32]
