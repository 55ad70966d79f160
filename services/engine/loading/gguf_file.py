"""A GGUF file: its metadata and tensor directory, read once; tensors dequantized on demand.

The container is parsed here (header, key/value metadata, tensor infos) because the `gguf`
package's reader builds a numpy view per array element and takes seconds on a 50k-token
vocabulary; the tensor data is memory-mapped and each weight's blocks are dequantized by the
`gguf` package's reference formulas (`gguf.quants.dequantize`), the same code transformers
uses when it reads a GGUF, so a dequantized weight has the bits the oracle sees.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value; each tensor info
a string name, u32 dims, u64 per dim (innermost first), u32 type, u64 offset into the data
section, which starts at the next multiple of `general.alignment` (32) after the infos.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keepwarm.engine.loading.gguf_blocks import dequantize_blocks

GGUF_MAGIC = b"GGUF"
_SCALAR = {  # value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
    7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The GGUF file is unusable here; the message names the file and what to change."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first): [rows, cols] for a matrix
    type_id: int  # ggml type number
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


# ggml types this loader reads (the list); others are refused naming them.
SUPPORTED_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)


class GgufFile:
    """Metadata (`metadata[key]`: int, float, bool, str or list) and tensors of one file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GgufError(f"{self.path}: cannot be read ({e})") from e
        buf = memoryview(self._map)  # type: ignore[arg-type]
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GgufError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        self.version = struct.unpack_from("<I", buf, 4)[0]
        if self.version not in (2, 3):
            raise GgufError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        try:
            self.metadata, self.tensors = self._parse(buf)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GgufError(f"{self.path}: truncated or corrupt GGUF header ({e})") from e

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            s = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            return s

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == _STRING:
                return string()
            if vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if etype == _STRING:
                    return [string() for _ in range(count)]
                if etype in _NUMPY:
                    arr: np.ndarray = np.frombuffer(buf, dtype=_NUMPY[etype], count=count, offset=pos)
                    pos += arr.nbytes
                    return arr.tolist()
                return [value(etype) for _ in range(count)]
            fmt = _SCALAR.get(vtype)
            if fmt is None:
                raise GgufError(f"{self.path}: unknown metadata value type {vtype}")
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            metadata[key] = value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), int(type_id), int(offset)))
        align = int(metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        tensors: dict[str, GgufTensor] = {}
        for name, shape, type_id, offset in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise GgufError(f"{self.path}: tensor {name!r} has unknown ggml type {type_id}") from None
            count = int(np.prod(shape)) if shape else 1
            if count % block:
                raise GgufError(f"{self.path}: tensor {name!r} {shape} is not whole {block}-element blocks")
            nbytes = count // block * size
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GgufError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            tensors[name] = GgufTensor(name, shape, type_id, start, nbytes)
        return metadata, tensors

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GgufError(f"{self.path}: metadata general.architecture is missing")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (a read-only view of the mapped file)."""
        t = self.tensors[name]
        return self._map[t.offset : t.offset + t.nbytes]

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 (F16 / BF16 widened exactly; blocks by gguf's formulas:
        Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K in torch by gguf_blocks, bitwise the same, the others by the gguf
        package), in its PyTorch shape, in freshly allocated memory."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        if t.type_name not in SUPPORTED_TYPES:
            raise GgufError(
                f"{self.path}: tensor {name!r} is {t.type_name}, which this loader does not read "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))}); re-quantize the file to one of them"
            )
        raw = self.raw(name)
        fast = dequantize_blocks(t.type_name, raw)
        if fast is not None:
            return fast.reshape(t.shape)
        if t.type_name == "BF16":
            out = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
        elif t.type_name == "F32":
            out = torch.from_numpy(raw.view(np.float32).copy())
        else:
            n_rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
            rows = raw.reshape(n_rows, t.nbytes // n_rows)
            out = torch.from_numpy(np.ascontiguousarray(dequantize(rows, GGMLQuantizationType(t.type_id))))
        return out.reshape(t.shape)
