"""Helpers the Triton kernels share: the dtypes they take and the round-to-nearest-even cast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; pass float32, bfloat16 or float16")


@triton.jit
def _round(x, ty: tl.constexpr):
    """Cast fp32 `x` to `ty` rounding to nearest even. bf16 is rounded by hand (add half
    an ulp with ties to even, drop the low 16 bits) because the Triton interpreter's
    fp32 -> bf16 cast truncates; on a GPU this equals the native RTNE cast. NaN stays NaN."""
    if ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        r = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return r.to(ty)
    else:
        return x.to(ty)


@triton.jit
def _out_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A matrix product program's output tile on a (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) grid:
    its rows, its columns and their masks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _store_out_tile(out_ptr, acc, b_ptr, rows, cols, rmask, cmask, N, HAS_BIAS: tl.constexpr):
    """out[rows, cols] = round(acc + bias[cols]) (out [M, N] contiguous; the bias in fp32)."""
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out_offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out_ptr + out_offs, _round(acc, out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
