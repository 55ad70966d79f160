"""Row-local CPU ops whose per-row result does not depend on how many rows a call has
(kernels/csrc/cpu_rowwise.cpp): RMSNorm and silu(gate) * up. torch's versions are not
guaranteed so: an elementwise transcendental finishes a thread's range with scalar code
whose last bit can differ from the vector code (measured: fp32 F.silu changes with the row
count), and which elements land there depends on the tensor's size.

Both fall back to the torch references when the kernel is absent or the inputs are not
bf16/fp32 CPU tensors with a contiguous last dim (then results are not invariant)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_extension, reference

SOURCE = cpu_extension.CSRC / "cpu_rowwise.cpp"
EXTENSION_NAME = "keepwarm_cpu_rowwise"


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME)


def available() -> bool:
    return extension() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]: weight * round(x * rsqrt(mean(x^2) + eps))."""
    ext = extension()
    if ext is not None and not torch.is_grad_enabled():
        y = ext.try_rms_norm(x, weight, eps)
        if y is not None:
            return y
    return reference.rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up (each step rounded to the inputs' dtype)."""
    ext = extension()
    if ext is not None and not torch.is_grad_enabled():
        y = ext.try_silu_mul(gate, up)
        if y is not None:
            return y
    return F.silu(gate) * up
