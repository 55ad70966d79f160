"""The hot ops a model calls, bundled so that one call site picks the implementation.

Shapes (one sequence, no batch dim):
  rms_norm(x [..., D], weight [D], eps) -> [..., D]
  rotary(x [T, H, Dr], cos [T, Dr], sin [T, Dr]) -> [T, H, Dr]   (rotate-half convention)
  prefill_attention(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [T, Hq, D]
      k, v hold rows 0..S-1 where S = start + T; query t sits at position start + t
      and sees keys 0..start + t (causal, bottom-right aligned).
  decode_attention(q [Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [Hq, D]
  linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]   (torch.nn.functional.linear)
Hq is a multiple of Hkv (GQA/MQA).
"""

from __future__ import annotations

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


TORCH_OPS = Ops(
    name="torch",
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    prefill_attention=reference.prefill_attention,
    decode_attention=reference.decode_attention,
)


def ops_for(device: torch.device, use_triton: bool | None = None) -> Ops:
    """The ops to run on `device`: Triton kernels on a GPU when Triton imports; on a
    CPU the references plus the AVX512-BF16 decode GEMV when this CPU and compiler
    allow it (it falls back to torch by itself otherwise). `use_triton` forces the choice."""
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        if device.type == "cpu":
            from keepwarm.kernels import cpu_linear

            if cpu_linear.available():  # builds the extension once, here, not on the first decode
                return replace(TORCH_OPS, name="torch+cpu_linear", linear=cpu_linear.linear)
        return TORCH_OPS
    try:
        from keepwarm.kernels import triton_ops
    except ImportError:
        return TORCH_OPS
    return triton_ops.TRITON_OPS
