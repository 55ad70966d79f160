"""GGUF quantized blocks to float32 in torch, for the types small models ship most (Q8_0,
Q4_0, Q4_1, F16): the same formulas as the `gguf` package's numpy reference, one whole tensor
at a time on torch's threads (the reference works through groups of 16 rows in Python). Each
value is `d * q` or `d * q + m` in float32 with the multiply and the add as two operations,
as the reference computes them, so the results are bitwise the reference's
(tests/engine/loading/test_gguf_blocks.py holds them to it). Other types: `None`, and the
caller uses the reference.

Layouts (bytes per block of 32 weights): Q8_0 = f16 d, 32 x int8 q; Q4_0 = f16 d, 16 bytes
of nibbles (low nibbles are weights 0-15, high nibbles 16-31), w = d * (q - 8); Q4_1 = f16 d,
f16 m, 16 bytes of nibbles, w = d * q + m.
"""

from __future__ import annotations

import numpy as np
import torch

_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _f16(col: torch.Tensor) -> torch.Tensor:
    """Two bytes per row, little-endian float16, as float32 (one per block, shape (n, 1))."""
    return col.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> its 32 4-bit values, low nibbles first."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def dequantize_blocks(type_name: str, raw: np.ndarray) -> torch.Tensor | None:
    """The blocks in `raw` (the tensor's bytes) as a flat float32 tensor; None for a type this
    module does not handle."""
    if type_name == "F16":
        return torch.from_numpy(np.array(raw, copy=True).view(np.float16)).float()
    size = _BYTES.get(type_name)
    if size is None:
        return None
    b = torch.from_numpy(np.array(raw, copy=True)).view(-1, size)
    d = _f16(b[:, 0:2])
    if type_name == "Q8_0":
        out = d * b[:, 2:].contiguous().view(torch.int8).float()
    elif type_name == "Q4_0":
        out = d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()
    else:
        out = d * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])
    return out.reshape(-1)
