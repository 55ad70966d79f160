"""GGUF quantized blocks to float32 in torch, for the types small models ship most (Q8_0,
Q4_0, Q4_1, F16): the same formulas as the `gguf` package's numpy reference, one whole tensor
at a time on torch's threads (the reference works through groups of 16 rows in Python). Each
value is `d * q` or `d * q + m` in float32 with the multiply and the add as two operations,
as the reference computes them, so the results are bitwise the reference's
(tests/engine/loading/test_gguf_blocks.py holds them to it). Other types: `None`, and the
caller uses the reference.

The block formulas and layouts live with the block weights the kernels multiply by
(kernels/quant_weight.py).
"""

from __future__ import annotations

import numpy as np
import torch

from keepwarm.kernels import quant_weight
from keepwarm.kernels.quant_weight import KINDS


def dequantize_blocks(type_name: str, raw: np.ndarray) -> torch.Tensor | None:
    """The blocks in `raw` (the tensor's bytes) as a flat float32 tensor; None for a type this
    module does not handle."""
    if type_name == "F16":
        return torch.from_numpy(np.array(raw, copy=True).view(np.float16)).float()
    if type_name not in KINDS:
        return None
    return quant_weight.dequantize_blocks(type_name, torch.from_numpy(np.array(raw, copy=True)))  # type: ignore[arg-type]
