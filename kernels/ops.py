"""The hot ops a model calls, bundled so that one call site picks the implementation.

Shapes (one sequence, no batch dim):
  rms_norm(x [..., D], weight [D], eps) -> [..., D]
  rotary(x [T, H, Dr], cos [T, Dr], sin [T, Dr]) -> [T, H, Dr]   (rotate-half convention)
  prefill_attention(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [T, Hq, D]
      k, v hold rows 0..S-1 where S = start + T; query t sits at position start + t
      and sees keys 0..start + t (causal, bottom-right aligned).
  decode_attention(q [Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [Hq, D]
  linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]   (torch.nn.functional.linear)
  silu_mul(gate [..., I], up [..., I]) -> [..., I]   (silu(gate) * up)
Hq is a multiple of Hkv (GQA/MQA).

Invariant mode (the CPU default): every op's result for a row (a token, a query) is the
same bits whatever else is in the call — batch composition, prefill chunk length, decode vs
prefill — so a prefix restored from the cache computes exactly like the uncached prefill.
The CPU bundle "cpu_invariant" uses the kernels of cpu_linear, cpu_rowwise and
cpu_attention behind the start-up self-check (kernels/invariance.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from keepwarm.kernels import reference


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    prefill_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    decode_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    linear: Callable[..., torch.Tensor] = F.linear
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = reference.silu_mul


TORCH_OPS = Ops(
    name="torch",
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    prefill_attention=reference.prefill_attention,
    decode_attention=reference.decode_attention,
)


def _decode_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The pre-invariance CPU path: the kernel for bf16 calls of <= 16 rows (decode), torch's
    GEMM above (whose per-row bits change with the row count)."""
    from keepwarm.kernels import cpu_linear

    if x.dtype == torch.bfloat16 and x.numel() <= cpu_linear.STREAM_ROWS * x.shape[-1]:
        return cpu_linear.linear(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.cache
def cpu_ops(invariant: bool = True) -> Ops:
    """The CPU bundle. invariant: the invariant kernels behind the self-check (one SelfCheck
    per process, so a refusal holds for every backend); else the references plus the
    decode GEMV. Without AVX-512 BF16 (or with a failed build) both are the references."""
    from keepwarm.kernels import cpu_attention, cpu_linear, cpu_rowwise

    if not cpu_linear.available():  # builds the extension once, here, not on the first call
        return TORCH_OPS
    plain = replace(TORCH_OPS, name="torch+cpu_linear", linear=_decode_rows_linear)
    if not invariant or not (cpu_attention.available() and cpu_rowwise.available()):
        return plain
    from keepwarm.kernels.invariance import SelfCheck

    fast = Ops(
        name="cpu_invariant",
        rms_norm=cpu_rowwise.rms_norm,
        rotary=reference.rotary,  # elementwise: invariant as it is
        prefill_attention=cpu_attention.prefill_attention,
        decode_attention=cpu_attention.decode_attention,
        linear=cpu_linear.linear,
        silu_mul=cpu_rowwise.silu_mul,
    )
    return SelfCheck(fast, plain).ops()


def ops_for(device: torch.device, use_triton: bool | None = None, invariant: bool = True) -> Ops:
    """The ops to run on `device`: Triton kernels on a GPU when Triton imports (not
    invariant yet); on a CPU `cpu_ops(invariant)`. `use_triton` forces the choice."""
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return cpu_ops(invariant) if device.type == "cpu" else TORCH_OPS
    try:
        from keepwarm.kernels import triton_ops
    except ImportError:
        return TORCH_OPS
    return triton_ops.TRITON_OPS
