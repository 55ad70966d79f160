"""`linear(x, weight: QuantWeight, bias)` on a GPU: the block weights (kernels/quant_weight.py,
every kind, in the kernel row layout the CPU kernel reads) dequantized in registers, one block
of 32 weights at a time, never written out as a dense matrix.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K in blocks of 32 from 0
upward: it forms the block's weights exactly as `QuantWeight.dequantize` does (d q, d q + m,
(d sc) q - dmin m, (d sc) (q - 32): the multiplies exact in fp32, the one add or subtract
rounded once), multiplies them with the activations upcast to fp32 by `tl.dot` in IEEE fp32,
and accumulates in fp32; the bias is added after the last block, one rounding to x's dtype.
The tiles are fixed (BLOCK_M, BLOCK_N from nothing but the dtype), M is not specialized, and a
program never splits a row's reduction, so a row's bits do not depend on how many rows the
call has (the rules of kernels/triton_invariant.py). The result is the product with the exact
weights to fp32 rounding: unlike the CPU kernel, the activations are not quantized.

Under TRITON_INTERPRET=1 it runs on CPU tensors (tests/kernels/test_triton_quant_linear.py);
the `gpu`-marked tests there run it on a lent device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keepwarm.kernels.quant_weight import KINDS, QuantWeight, row_bytes
from keepwarm.kernels.triton_common import _check_dtype, _out_tile, _store_out_tile

_KIND_ID = {k: i for i, k in enumerate(KINDS)}  # the same enum as the CPU kernel's
_TILES: dict[torch.dtype, tuple[int, int]] = {  # (BLOCK_M, BLOCK_N), fixed whatever M is
    torch.float32: (16, 32),
    torch.bfloat16: (16, 64),
    torch.float16: (16, 64),
}


@triton.jit
def _f16(ptr, mask):
    """The f16 stored (little-endian) at byte pointers `ptr`, as fp32 (0 where not `mask`)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_weights(w_ptr, cols, cmask, b, NB, ROW_BYTES, KIND: tl.constexpr):
    """Block b of rows `cols`: their 32 weights [32, BLOCK_N] in fp32, the dequantized values
    (kinds as kernels/quant_weight.py KINDS: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q5_K, 5 Q6_K,
    6 Q5_0, 7 Q5_1)."""
    j = tl.arange(0, 32)[:, None]  # weight index in the block
    row = w_ptr + cols[None, :].to(tl.int64) * ROW_BYTES  # [1, BN] byte pointers
    m2 = cmask[None, :]
    nsb = NB // 8
    if KIND == 0:  # Q8_0: every d, then 32 int8 per block
        q8 = tl.load(row + 2 * NB + b * 32 + j, mask=m2, other=0).to(tl.int8, bitcast=True)
        w = _f16(row + 2 * b, m2) * q8.to(tl.float32)
    elif KIND == 5:  # Q6_K: every d, 16 int8 scales per super-block, then 24 bytes per block
        sc = tl.load(row + 2 * nsb + 16 * (b // 8) + 8 * (j // 16) + (b % 8), mask=m2, other=0)
        qb = row + 18 * nsb + b * 24
        low = (tl.load(qb + (j % 16), mask=m2, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        high = (tl.load(qb + 16 + (j % 8), mask=m2, other=0).to(tl.int32) >> (2 * (j // 8))) & 3
        q6 = (low | (high << 4)) - 32
        w = (_f16(row + 2 * (b // 8), m2) * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q6.to(tl.float32)
    else:  # the nibble kinds: 16 bytes a block, Q5_0 / Q5_1 / Q5_K 4 more of fifth bits
        if KIND == 3 or KIND == 4:
            head = 4 * nsb + 2 * NB
        elif KIND == 2 or KIND == 7:
            head = 4 * NB
        else:
            head = 2 * NB
        if KIND == 4 or KIND == 6 or KIND == 7:
            qb = row + head + b * 20
            q = (tl.load(qb + (j % 16), mask=m2, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
            q = q | (((tl.load(qb + 16 + (j % 4), mask=m2, other=0).to(tl.int32) >> (j // 4)) & 1) << 4)
        else:
            qb = row + head + b * 16
            q = (tl.load(qb + (j % 16), mask=m2, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        qf = q.to(tl.float32)
        if KIND == 3 or KIND == 4:  # (d sc) q - dmin m
            sc = tl.load(row + 4 * nsb + b, mask=m2, other=0).to(tl.float32)
            mn = tl.load(row + 4 * nsb + NB + b, mask=m2, other=0).to(tl.float32)
            w = (_f16(row + 2 * (b // 8), m2) * sc) * qf - _f16(row + 2 * nsb + 2 * (b // 8), m2) * mn
        elif KIND == 2 or KIND == 7:  # d q + m
            w = _f16(row + 2 * b, m2) * qf + _f16(row + 2 * NB + 2 * b, m2)
        elif KIND == 1:  # d (q - 8)
            w = _f16(row + 2 * b, m2) * (qf - 8.0)
        else:  # Q5_0: d (q - 16)
            w = _f16(row + 2 * b, m2) * (qf - 16.0)
    return w


@triton.jit(do_not_specialize=["M"])
def _quant_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    ROW_BYTES,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); x [M, K] contiguous, out [M, N].
    rows, cols, rmask, cmask = _out_tile(M, N, BLOCK_M, BLOCK_N)
    nb = K // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, nb):
        ks = b * 32 + tl.arange(0, 32)
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None], other=0.0)
        w = _block_weights(w_ptr, cols, cmask, b, nb, ROW_BYTES, KIND)  # [32, BN]
        w = tl.where(cmask[None, :], w, 0.0)
        acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
    _store_out_tile(out_ptr, acc, b_ptr, rows, cols, rmask, cmask, N, HAS_BIAS)


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, the weight in its blocks."""
    _check_dtype("quant_linear x", x)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x's last dim {x.shape[-1]} must be the weight's K {k}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"quant_linear: bias must be ({n},) of x's dtype {x.dtype}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        bm, bn = _TILES[x.dtype]
        _quant_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2,
            weight.blocks,
            bias if bias is not None else x2,  # a dummy pointer when HAS_BIAS is off
            out,
            m,
            n,
            k,
            row_bytes(weight.kind, k),
            KIND=_KIND_ID[weight.kind],
            HAS_BIAS=bias is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
