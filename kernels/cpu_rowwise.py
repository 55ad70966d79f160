"""Row-local CPU ops whose per-row result does not depend on how many rows a call has
(kernels/csrc/cpu_rowwise.cpp): RMSNorm (plain and Qwen3.5's 1 + weight form), silu(gate) * up,
the pointwise exp / sigmoid / silu / softplus, the depthwise causal conv followed by silu, and
the rotary embedding (bitwise torch's: one call instead of ~10 ops). torch's versions are not
guaranteed so: an elementwise transcendental finishes a thread's range with scalar code
whose last bit can differ from the vector code (measured: fp32 F.silu changes with the row
count), and which elements land there depends on the tensor's size.

All fall back to the torch references when the kernel is absent or the inputs are not
bf16/fp32 CPU tensors with a contiguous last dim (then results are not invariant)."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, Dr], cos / sin [T, Dr] -> x * cos + rotate_half(x) * sin, each step rounded to x's
    dtype as torch rounds it: the reference's bits in one call (it takes ~10 torch ops)."""
    ext = extension()
    if ext is not None and not _recording(x):
        y = ext.try_rotary(x, cos, sin)
        if y is not None:
            return y
    return reference.rotary(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up (each step rounded to the inputs' dtype)."""
    ext = extension()
    if ext is not None and not torch.is_grad_enabled():
        y = ext.try_silu_mul(gate, up)
        if y is not None:
            return y
    return F.silu(gate) * up


def _recording(*xs: torch.Tensor) -> bool:
    """Whether autograd records through any of `xs` (the kernels have no backward)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def rms_norm_1p(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], scale [D] float32 -> [..., D] in x's dtype: round(x * rsqrt(mean(x^2) + eps) * scale)."""
    ext = extension()
    if ext is not None and not _recording(x, scale):
        y = ext.try_rms_norm_1p(x, scale, eps)
        if y is not None:
            return y
    return reference.rms_norm_1p(x, scale, eps)


def _pointwise(x: torch.Tensor, op: int, fallback: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    ext = extension()
    if ext is not None and not _recording(x):
        y = ext.try_pointwise(x, op)
        if y is not None:
            return y
    return fallback(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(x, 0, torch.sigmoid)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(x, 1, F.silu)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(x, 2, F.softplus)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(x, 3, torch.exp)


def conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., C, L], weight [C, 1, K] -> [..., C, L - K + 1]: silu of the depthwise causal conv."""
    ext = extension()
    if ext is not None and not _recording(x, weight):
        y = ext.try_conv_silu(x, weight)
        if y is not None:
            return y
    return reference.conv_silu(x, weight)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 softmax over `dim`: the max (exact in any order), exp of the differences
    (`exp`), then their sum by elementwise adds in index order, one division. An element's
    bits depend only on its slice along `dim`."""
    xf = x.float()
    e = exp(xf - xf.amax(dim=dim, keepdim=True))
    parts = e.unbind(dim)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return e / total.unsqueeze(dim)
