"""One snapshot on disk: a plain safetensors file with keepwarm metadata
(docs/architecture.md, 'Snapshot file format').

Layout (standard safetensors, readable by `safetensors.safe_open`):

    [u64 LE n] [n bytes JSON header, space-padded so data starts 8-aligned] [data]

The header's `__metadata__` holds: `format` ("keepwarm.snapshot"),
`format_version`, `namespace`, `key`, `key_tokens` (token count of the key),
`position` (positions the snapshot covers), `created` (unix seconds),
`checksum_algo` ("xxh3_64"), `checksums` (JSON {tensor name: 16 hex}, every
tensor including `meta.tokens`) and `header_checksum`: xxh3_64 of every other
metadata field and the whole tensor table (names, dtypes, shapes, offsets), so an
edited position, token count, namespace, key or offset is a checksum failure like a
flipped payload byte. The key's token ids are the int32 tensor `meta.tokens`
[key_tokens], so a hit is verified exactly, not by hash alone. Tensors are laid out
by item size descending, then name, so each one is naturally aligned inside the data
section and can be a zero-copy view.

The folder is not trusted: every path below the cache root (`root=`) is opened
without following links (no_follow.py). `is_ours` says whether a file may be
deleted: a regular file whose parseable header carries the keepwarm format marker;
anything else (a model's safetensors, garbage, a directory, a link) is left alone.

Write: temp file in the target folder (`<final>.<pid>.<rand>.tmp`; the pid lets a
later start tell a dead writer's leftovers from a live one's), fsync, then
link to the final name (fails if the key exists, so a published file is never
rewritten; a file is immutable once visible), unlink the temp, fsync the folder.
A reader can therefore only ever see complete files; a crash leaves at most a
stray temp file.

Read: `read_header` parses the header alone (index rebuild, no payload reads,
size checked against the stat size). `read_snapshot` reads the whole file with
one sequential read into one buffer, verifies everything, then builds every
tensor as a view into that buffer (torch.frombuffer): no second copy, so restore
runs at close to raw read bandwidth. With an `alloc` it reads each tensor straight
into the caller's memory; memory that is not on the CPU (a GPU state buffer) is
never handed to a host read: the bytes go to a host staging buffer
(device_staging.py, pinned when CUDA is available), are checksummed there, and are
copied to the device with a non-blocking copy that overlaps the next tensor's read.

Every failure is a SnapshotFileError with a short machine `reason`:
unreadable, truncated, checksum, foreign_namespace, key_mismatch, version,
position_past_key, tokens_mismatch (geometry is the caller's validate step), and
for what is not a snapshot at all: symlink, not_regular.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from keepwarm.engine.cache.device_staging import DeviceStaging
from keepwarm.engine.cache.no_follow import dir_fd, open_in, open_regular, read_exact
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_error import SnapshotFileError

FORMAT_VERSION = 2  # 2: header_checksum covers every metadata field and the tensor table
FORMAT_NAME = "keepwarm.snapshot"
TOKENS = "meta.tokens"  # [key_tokens] int32: the key's token ids
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"

_MAX_HEADER = 64 << 20  # a header beyond this is not ours (safetensors caps at 100 MB)
_ALIGN = 8
_HEADER_CHECKSUM = "header_checksum"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

# Where a restore may put a tensor: (name, dtype, shape) -> a contiguous tensor of
# exactly that dtype and shape (e.g. rows of a live state's preallocated buffer,
# whose pages are already mapped; on any device), or None for a fresh CPU allocation.
Alloc = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the data section: bytes [begin, end) relative to the data start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SnapshotHeader:
    """Everything a file says about itself without reading its payload."""

    format_version: int
    namespace: str
    key: str
    key_tokens: int
    position: int
    created: float
    checksums: Mapping[str, str]
    tensors: Mapping[str, TensorEntry]
    data_start: int  # byte offset of the data section in the file
    file_bytes: int  # the size the file must have: data_start + data length

    def check(self, *, namespace: str, key: str | None = None) -> None:
        """Raise SnapshotFileError unless this header may be adopted under `namespace`/`key`."""
        if self.namespace != namespace:
            raise SnapshotFileError("foreign_namespace", f"file {self.namespace}, expected {namespace}")
        if key is not None and self.key != key:
            raise SnapshotFileError("key_mismatch", f"file {self.key}, expected {key}")
        if self.position > self.key_tokens:
            raise SnapshotFileError(
                "position_past_key", f"snapshot covers {self.position} positions, key has {self.key_tokens}"
            )


def tmp_writer_pid(name: str) -> int | None:
    """The writer pid encoded in a temp file name `<final>.<pid>.<rand>.tmp`, or None."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-1] != TMP_SUFFIX[1:]:
        return None
    try:
        return int(parts[-3])
    except ValueError:
        return None


# ---- header -----------------------------------------------------------------------------


def _header_checksum(meta: Mapping[str, object], table: Mapping[str, object]) -> str:
    """xxh3_64 of every metadata field but the checksum itself, and the tensor table."""
    covered = {k: v for k, v in meta.items() if k != _HEADER_CHECKSUM}
    blob = json.dumps({"meta": covered, "tensors": table}, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(blob.encode())


def _parse_header(raw: bytes | memoryview, file_size: int) -> SnapshotHeader:
    """Parse and structurally validate the header; `raw` holds at least the header bytes."""
    if file_size < 8 or len(raw) < 8:
        raise SnapshotFileError("truncated", f"{file_size} bytes, no header length")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    if n > _MAX_HEADER:
        raise SnapshotFileError("unreadable", f"header length {n}")
    if file_size < 8 + n or len(raw) < 8 + n:
        raise SnapshotFileError("truncated", f"{file_size} bytes, header needs {8 + n}")
    try:
        doc = json.loads(bytes(raw[8 : 8 + n]))
        meta = doc.pop("__metadata__")
        if meta.get("format") != FORMAT_NAME:
            raise SnapshotFileError("unreadable", "not a keepwarm snapshot")
        version = int(meta["format_version"])
        if version != FORMAT_VERSION:
            raise SnapshotFileError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
        if meta.get(_HEADER_CHECKSUM) != _header_checksum(meta, doc):
            raise SnapshotFileError("checksum", "header fields do not match their checksum")
        checksums = json.loads(meta["checksums"])
        tensors: dict[str, TensorEntry] = {}
        for name, d in doc.items():
            begin, end = (int(x) for x in d["data_offsets"])
            shape = tuple(int(x) for x in d["shape"])
            tensors[name] = TensorEntry(_DTYPES[d["dtype"]], shape, begin, end)
        header = SnapshotHeader(
            format_version=version,
            namespace=str(meta["namespace"]),
            key=str(meta["key"]),
            key_tokens=int(meta["key_tokens"]),
            position=int(meta["position"]),
            created=float(meta["created"]),
            checksums={str(k): str(v) for k, v in checksums.items()},
            tensors=tensors,
            data_start=8 + n,
            file_bytes=8 + n + max((t.end for t in tensors.values()), default=0),
        )
    except SnapshotFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SnapshotFileError("unreadable", f"bad header: {e!r}") from e
    _check_table(header)
    if file_size < header.file_bytes:
        raise SnapshotFileError("truncated", f"{file_size} bytes, header promises {header.file_bytes}")
    if file_size > header.file_bytes:
        raise SnapshotFileError("unreadable", f"{file_size} bytes, header promises {header.file_bytes}")
    return header


def _check_table(h: SnapshotHeader) -> None:
    """The tensor table must tile the data section exactly, with sizes matching shapes."""
    cursor = 0
    for name, t in sorted(h.tensors.items(), key=lambda kv: kv[1].begin):
        numel = 1
        for d in t.shape:
            if d < 0:
                raise SnapshotFileError("unreadable", f"{name}: negative dim")
            numel *= d
        if t.begin != cursor or t.end - t.begin != numel * t.dtype.itemsize:
            raise SnapshotFileError("unreadable", f"{name}: offsets {t.begin}..{t.end} do not fit")
        if (h.data_start + t.begin) % t.dtype.itemsize:
            raise SnapshotFileError("unreadable", f"{name}: offset {t.begin} not aligned to its dtype")
        cursor = t.end
    if set(h.checksums) != set(h.tensors):
        raise SnapshotFileError("unreadable", "checksums do not list exactly the tensors")
    tok = h.tensors.get(TOKENS)
    if tok is None or tok.dtype != torch.int32 or tok.shape != (h.key_tokens,):
        raise SnapshotFileError("unreadable", f"{TOKENS} missing or not int32 [{h.key_tokens}]")
    if h.position < 0:
        raise SnapshotFileError("unreadable", f"negative position {h.position}")


def _read_head(fd: int) -> tuple[bytes, int]:
    """(8-byte length + JSON header as far as the file has it, file size)."""
    size = os.fstat(fd).st_size
    head = read_exact(fd, 8, 0)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= _MAX_HEADER:
            head += read_exact(fd, n, 8)
    return head, size


def read_header(path: Path, *, root: Path | None = None) -> SnapshotHeader:
    """Header only (index rebuild): reads 8 bytes plus the JSON, never the payload.
    Checks structure, version, the header checksum and that the stat size matches."""
    try:
        with open_regular(path, root) as fd:
            head, size = _read_head(fd)
    except (FileNotFoundError, SnapshotFileError):
        raise
    except OSError as e:
        raise SnapshotFileError("unreadable", repr(e)) from e
    return _parse_header(head, size)


@dataclass(frozen=True)
class FileIdentity:
    """What a file claims to be, from a leniently parsed header (no checksum checks):
    enough to decide that a file is a keepwarm snapshot the cache may delete."""

    namespace: str
    key: str


def read_identity(path: Path, *, root: Path | None = None) -> FileIdentity | None:
    """The claimed (namespace, key) of a regular keepwarm snapshot file at `path`;
    None when it is anything else (a link, a folder, an unparseable or foreign file).
    FileNotFoundError passes through."""
    try:
        with open_regular(path, root) as fd:
            head, _ = _read_head(fd)
    except SnapshotFileError:
        return None
    except FileNotFoundError:
        raise
    except OSError:
        return None
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    try:
        meta = json.loads(head[8 : 8 + n])["__metadata__"]
        if meta.get("format") != FORMAT_NAME:
            return None
        return FileIdentity(str(meta["namespace"]), str(meta["key"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def unlink_if_ours(path: Path, *, root: Path | None = None) -> bool:
    """Delete `path` when it is a regular keepwarm snapshot file reached without links
    below `root` (read_identity says so); otherwise leave it. True when deleted."""
    try:
        with dir_fd(path, root) as dfd:
            try:
                fd = open_in(path.name, dfd)
            except (FileNotFoundError, SnapshotFileError):
                return False
            try:
                ino = os.fstat(fd).st_ino
                head, _ = _read_head(fd)
            finally:
                os.close(fd)
            if not _is_keepwarm_head(head):
                return False
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode):
                return False  # swapped meanwhile: not the file we checked
            os.unlink(path.name, dir_fd=dfd)
            return True
    except (FileNotFoundError, SnapshotFileError):
        return False


def _is_keepwarm_head(head: bytes) -> bool:
    if len(head) < 8:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    try:
        meta = json.loads(head[8 : 8 + n])["__metadata__"]
        return bool(meta.get("format") == FORMAT_NAME)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


# ---- payload ----------------------------------------------------------------------------


def _read_all(fd: int) -> torch.Tensor:
    """The whole file as a uint8 CPU tensor, one sequential read into one buffer.

    torch.empty, not bytearray: no zero-fill pass, so this runs at raw read speed.
    Loops only on short reads (a single read() returns at most ~2 GiB on Linux).
    """
    size = os.fstat(fd).st_size
    buf = torch.empty(size, dtype=torch.uint8, device="cpu")
    view = buf.numpy().data
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    return buf[:got]


def _tensor_view(buf: torch.Tensor, start: int, t: TensorEntry) -> torch.Tensor:
    """A zero-copy view of one tensor inside the file buffer (offsets are aligned)."""
    return buf[start + t.begin : start + t.end].view(t.dtype).view(t.shape)


def read_snapshot(
    path: Path,
    *,
    namespace: str,
    tokens: Sequence[int] | None = None,
    key: str | None = None,
    alloc: Alloc | None = None,
    root: Path | None = None,
) -> tuple[Snapshot, list[int]]:
    """Load and verify one file: (snapshot, key token ids).

    Verifies format version, header checksum, namespace (and key when given),
    position <= key tokens, file size = header + data, every checksum, and the token
    ids when `tokens` is given. Without `alloc` the returned tensors are views into
    one CPU buffer holding the file; with it, each tensor lands in the memory `alloc`
    names (CPU: read straight into it; another device: through a host staging buffer;
    on failure that memory holds garbage). FileNotFoundError passes through (a miss,
    not a bad file); every other problem raises SnapshotFileError.
    """
    try:
        with open_regular(path, root) as fd:
            if alloc is not None:
                return _read_into(fd, namespace=namespace, tokens=tokens, key=key, alloc=alloc)
            buf = _read_all(fd)
    except (FileNotFoundError, SnapshotFileError):
        raise
    except OSError as e:
        raise SnapshotFileError("unreadable", repr(e)) from e
    view = buf.numpy().data
    header = _parse_header(view[: 8 + _MAX_HEADER], len(view))
    header.check(namespace=namespace, key=key)
    start = header.data_start
    for name, t in header.tensors.items():
        if xxhash.xxh3_64_hexdigest(view[start + t.begin : start + t.end]) != header.checksums[name]:
            raise SnapshotFileError("checksum", name)
    del view
    stored = _tensor_view(buf, start, header.tensors[TOKENS]).tolist()
    if tokens is not None and list(tokens) != stored:
        raise SnapshotFileError("tokens_mismatch", _divergence(stored, tokens))
    tensors = {name: _tensor_view(buf, start, t) for name, t in header.tensors.items() if name != TOKENS}
    return Snapshot(header.position, tensors), stored


def _readinto_exact(fd: int, raw: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(raw):
        k = os.preadv(fd, [raw[got:]], offset + got)
        if not k:
            raise SnapshotFileError("truncated", f"{name}: file ended early")
        got += k


def _read_into(
    fd: int, *, namespace: str, tokens: Sequence[int] | None, key: str | None, alloc: Alloc
) -> tuple[Snapshot, list[int]]:
    """read_snapshot reading each tensor into its destination, in file order."""
    head, size = _read_head(fd)
    header = _parse_header(head, size)
    header.check(namespace=namespace, key=key)
    tensors: dict[str, torch.Tensor] = {}
    staging: DeviceStaging | None = None
    try:
        for name, t in sorted(header.tensors.items(), key=lambda kv: kv[1].begin):
            dest = alloc(name, t.dtype, t.shape) if name != TOKENS else None
            if (
                dest is None
                or dest.dtype != t.dtype
                or tuple(dest.shape) != t.shape
                or not dest.is_contiguous()
            ):
                dest = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            nbytes = t.end - t.begin
            offset = header.data_start + t.begin
            if dest.device.type == "cpu":
                raw = dest.reshape(-1).view(torch.uint8).numpy().data if nbytes else memoryview(b"")
                _readinto_exact(fd, raw, offset, name)
                if xxhash.xxh3_64_hexdigest(raw) != header.checksums[name]:
                    raise SnapshotFileError("checksum", name)
            else:
                # Device memory is never handed to a host read: bounce through host memory.
                staging = staging or DeviceStaging()
                slot, host = staging.take(nbytes)
                raw = host.numpy().data
                _readinto_exact(fd, raw, offset, name)
                if xxhash.xxh3_64_hexdigest(raw) != header.checksums[name]:
                    raise SnapshotFileError("checksum", name)
                if nbytes:
                    dest.reshape(-1).view(torch.uint8).copy_(host, non_blocking=True)
                    staging.copied(slot, dest)
            tensors[name] = dest
    finally:
        if staging is not None:
            staging.drain()  # the staging buffers must outlive every copy out of them
    stored = tensors.pop(TOKENS).tolist()
    if tokens is not None and list(tokens) != stored:
        raise SnapshotFileError("tokens_mismatch", _divergence(stored, tokens))
    return Snapshot(header.position, tensors), stored


def read_tokens(path: Path, *, namespace: str, key: str | None = None, root: Path | None = None) -> list[int]:
    """The key's token ids alone (header + `meta.tokens`, checksum verified), without
    reading the payload: enough to explain where a prompt diverged from an entry."""
    try:
        with open_regular(path, root) as fd:
            head, size = _read_head(fd)
            header = _parse_header(head, size)
            header.check(namespace=namespace, key=key)
            t = header.tensors[TOKENS]
            raw = read_exact(fd, t.end - t.begin, header.data_start + t.begin)
    except (FileNotFoundError, SnapshotFileError):
        raise
    except OSError as e:
        raise SnapshotFileError("unreadable", repr(e)) from e
    if len(raw) != t.end - t.begin:
        raise SnapshotFileError("truncated", f"{TOKENS}: file ended early")
    if xxhash.xxh3_64_hexdigest(raw) != header.checksums[TOKENS]:
        raise SnapshotFileError("checksum", TOKENS)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).tolist()


def _divergence(stored: Sequence[int], wanted: Sequence[int]) -> str:
    n = next(
        (i for i, (a, b) in enumerate(zip(stored, wanted, strict=False)) if a != b),
        min(len(stored), len(wanted)),
    )
    return f"stored {len(stored)} tokens, expected {len(wanted)}, first difference at {n}"


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor as host memory: a device tensor is copied to the host
    first (numpy views and checksums only ever see CPU memory)."""
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    flat = flat.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


@dataclass(frozen=True)
class EncodedSnapshot:
    """A file ready to publish: header bytes, then the tensors' bytes in data order."""

    header: bytes
    views: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(len(v) for v in self.views)


def encode_snapshot(
    *,
    namespace: str,
    key: str,
    tokens: Sequence[int],
    snapshot: Snapshot,
    created: float,
) -> EncodedSnapshot:
    """Checksums and header for one entry (the tensor bytes stay where they are when
    they are CPU memory).

    Raises ValueError for a snapshot that cannot be stored: position past the key
    (the guard), the reserved `meta.tokens` name, or an unsupported dtype.
    """
    if TOKENS in snapshot.tensors:
        raise ValueError(f"snapshot tensor name {TOKENS!r} is reserved for the key's token ids")
    if snapshot.position > len(tokens):
        raise ValueError(
            f"snapshot covers {snapshot.position} positions but the key has {len(tokens)} tokens"
        )
    items: list[tuple[str, torch.Tensor]] = list(snapshot.tensors.items())
    items.append((TOKENS, torch.tensor(list(tokens), dtype=torch.int32)))
    for name, t in items:
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored; use one of {sorted(_DTYPES)}")
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    doc: dict[str, object] = {}
    checksums: dict[str, str] = {}
    views: list[memoryview] = []
    offset = 0
    for name, t in items:
        v = _byte_view(t)
        checksums[name] = xxhash.xxh3_64_hexdigest(v)
        doc[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(v)],
        }
        offset += len(v)
        views.append(v)
    meta: dict[str, str] = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "namespace": namespace,
        "key": key,
        "key_tokens": str(len(tokens)),
        "position": str(snapshot.position),
        "created": repr(float(created)),
        "checksum_algo": "xxh3_64",
        "checksums": json.dumps(checksums, sort_keys=True),
    }
    meta[_HEADER_CHECKSUM] = _header_checksum(meta, doc)
    doc["__metadata__"] = meta
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % _ALIGN)
    return EncodedSnapshot(struct.pack("<Q", len(body)) + body, tuple(views))


def publish(
    path: Path, encoded: EncodedSnapshot, *, fsync: bool = True, root: Path | None = None
) -> int | None:
    """Write `encoded` to a temp file beside `path`, fsync, link it to `path`, fsync the
    folder. Returns the size, or None when `path` already exists (never rewritten; also
    when something that is not ours sits there). Folders below `root` are created or
    entered without following links (a link there raises SnapshotFileError).
    OSError (disk full...) propagates after the temp file is removed."""
    tmp_name = f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    with dir_fd(path, root, create=True, fsync=fsync) as dfd:
        try:
            os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            return None
        except FileNotFoundError:
            pass
        fd = os.open(
            tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
        )
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(encoded.header)
                for v in encoded.views:
                    f.write(v)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            try:
                # no-overwrite publish: fails if another writer (or anything else) got there first
                os.link(tmp_name, path.name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return None
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                    raise
                # Filesystems without hard links: rename overwrites, but a key's content is
                # determined by its key, so a lost race replaces a file by an equivalent one.
                try:
                    os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
                    return None
                except FileNotFoundError:
                    os.rename(tmp_name, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dfd)
        if fsync:
            os.fsync(dfd)
    return encoded.size


def write_snapshot(
    path: Path,
    *,
    namespace: str,
    key: str,
    tokens: Sequence[int],
    snapshot: Snapshot,
    fsync: bool = True,
    created: float | None = None,
    root: Path | None = None,
) -> int | None:
    """encode_snapshot + publish: the file's size, or None when `path` already exists."""
    encoded = encode_snapshot(
        namespace=namespace,
        key=key,
        tokens=tokens,
        snapshot=snapshot,
        created=time.time() if created is None else created,
    )
    return publish(path, encoded, fsync=fsync, root=root)
