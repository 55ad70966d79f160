"""Triton versions of the hot ops (shapes and semantics: kernels/ops.py; oracle: kernels/reference.py).

Each public function is a thin wrapper: it checks shapes, makes the operands the kernel
reads contiguous, allocates the output and launches. All reductions (norm variance,
softmax, attention accumulators) run in float32; outputs are cast back to the dtype the
reference returns. Non-power-of-two head dims and lengths are handled with masks.

Under TRITON_INTERPRET=1 (set before triton is imported) the same kernels run on CPU
tensors, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keepwarm.kernels import triton_quant_linear
from keepwarm.kernels.delta_rule import triton_chunk_gated_delta_rule, triton_gated_delta_rule
from keepwarm.kernels.ops import Ops
from keepwarm.kernels.triton_common import _check_dtype, _round

# Smallest tile side tl.dot accepts on a GPU; head dims and query groups are padded up to it.
_MIN_DOT = 16
# Decode splits the key range into at most this many chunks (flash-decoding), reduced by a second kernel.
_MAX_DECODE_SPLITS = 32


def _block(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 on the GPU: the reference is exact fp32.
    # 16-bit inputs upcast to fp32 are exact in tf32 (>= 10 mantissa bits), so "tf32" loses nothing.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softmax_tile(s, m_i, l_i, acc, v, NATIVE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile, exp2 domain: scores s [M, N] fp32 (-inf where
    not visible), running max m_i and sum l_i [M], output acc [M, Dv] fp32, values v [N, Dv].
    P is rounded to V's dtype for the second product (the flash-attention convention; a no-op
    for fp32 V). NATIVE_DOT off (the CPU interpreter, whose dot cannot multiply bf16): the
    operands are upcast first, the same exact products. Returns (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_v = _round(p, v.dtype)
    if NATIVE_DOT:
        pv = tl.dot(p_v, v, input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p_v.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    # One program per row of x [N, D] (contiguous). fp32 math; the normalized row is
    # rounded to x's dtype before the weight multiply, exactly as the reference does.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    normed = _round(xf * tl.rsqrt(var + eps), x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * normed
    tl.store(out_ptr + row * D + cols, _round(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in promote(weight.dtype, x.dtype), like `weight * normed`."""
    _check_dtype("rms_norm x", x)
    _check_dtype("rms_norm weight", weight)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({d},) to match x's last dim")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    x2 = x.reshape(-1, d).contiguous()  # [N, D]
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, d, float(eps), BLOCK_D=triton.next_power_of_2(d)
        )
    return out.view(x.shape)


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per position t; x/out [T, H, 2*HALF], cos/sin [T, 2*HALF], all contiguous.
    # Rotate-half: out[:h] = x1*cos1 - x2*sin1, out[h:] = x2*cos2 + x1*sin2.
    # Each product and the sum are rounded to the output dtype, as the reference's
    # separate torch ops round them, so bf16 results match it bit for bit.
    t = tl.program_id(0).to(tl.int64)
    dr = 2 * HALF
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    mask = (heads[:, None] < H) & cmask[None, :]
    offs = t * H * dr + heads[:, None] * dr + cols[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * dr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * dr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * dr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * dr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    ty = out_ptr.dtype.element_ty
    a1 = _round(x1 * c1, ty).to(tl.float32)
    b1 = _round(-x2 * s1, ty).to(tl.float32)
    a2 = _round(x2 * c2, ty).to(tl.float32)
    b2 = _round(x1 * s2, ty).to(tl.float32)
    tl.store(out_ptr + offs, _round(a1 + b1, ty), mask=mask)
    tl.store(out_ptr + offs + HALF, _round(a2 + b2, ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, Dr], cos/sin [T, Dr] -> [T, H, Dr] (rotate-half), dtype promote(x, cos, sin)."""
    for name, t in (("rotary x", x), ("rotary cos", cos), ("rotary sin", sin)):
        _check_dtype(name, t)
    if x.dim() != 3:
        raise ValueError(f"rotary: x must be [T, H, Dr], got shape {tuple(x.shape)}")
    t_len, h, dr = x.shape
    if cos.shape != (t_len, dr) or sin.shape != (t_len, dr):
        raise ValueError(
            f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be ({t_len}, {dr}) for x {tuple(x.shape)}"
        )
    if dr % 2 != 0:
        raise ValueError(f"rotary: rotary dim {dr} must be even")
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    out = torch.empty((t_len, h, dr), dtype=out_dtype, device=x.device)
    if out.numel() > 0:
        _rotary_kernel[(t_len,)](
            x.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            out,
            h,
            dr // 2,
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_HALF=triton.next_power_of_2(dr // 2),
        )
    return out


# --------------------------------------------------------------------------- prefill attention


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    T,
    S,
    HQ,
    HKV,
    D,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    # Grid (cdiv(T, BLOCK_M), HQ). q/out [T, HQ, D], k/v [S, HKV, D], contiguous.
    # NATIVE_DOT (GPU): 16-bit operands go to the tensor cores as they are. Off (the CPU
    # interpreter, whose dot cannot multiply bf16): operands are upcast to fp32 first, which
    # computes the same exact products, so both paths agree up to summation order.
    # Query row i sits at absolute position start + i and sees keys 0..start + i.
    # Online softmax in the exp2 domain (qk_scale already holds log2(e)); every row sees
    # key 0 in the first block, so the running max is finite after it.
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (HQ // HKV)
    start = S - T

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in 0..T-1
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    rmask = rows < T
    q_offs = rows[:, None].to(tl.int64) * (HQ * D) + h * D + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=rmask[:, None] & dmask[None, :], other=0.0)  # [M, Dp]

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    q_pos = start + rows  # [M] absolute positions
    hi = tl.minimum(S, start + (pid_m + 1) * BLOCK_M)  # last visible key + 1 for this block
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        kv_offs = cols[:, None].to(tl.int64) * (HKV * D) + kvh * D + dims[None, :]
        kv_mask = (cols[:, None] < S) & dmask[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)  # [N, Dp]
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N] fp32
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < S)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, NATIVE_DOT, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_offs, _round(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _check_attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_dims: int) -> None:
    for label, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(f"{name} {label}", t)
    if q.dim() != q_dims or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"{name}: expected q with {q_dims} dims and k, v of one shape [S, Hkv, D]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[1]
    if k.shape[2] != d or hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{name}: q heads {hq} must be a multiple of kv heads {hkv} and head dims must match "
            f"(q {d}, k {k.shape[2]})"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}")


_LOG2E = 1.4426950408889634


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] with S >= T -> [T, Hq, D] (bottom-right causal)."""
    _check_attention("prefill_attention", q, k, v, q_dims=3)
    t_len, hq, d = q.shape
    s_len, hkv = k.shape[0], k.shape[1]
    if s_len < t_len:
        raise ValueError(f"prefill_attention: k/v hold {s_len} rows, fewer than the {t_len} queries")
    out = torch.empty((t_len, hq, d), dtype=q.dtype, device=q.device)
    if t_len == 0:
        return out
    block_m = 16 if t_len <= 16 else 32
    grid = (triton.cdiv(t_len, block_m), hq)
    _prefill_attention_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out,
        t_len,
        s_len,
        hq,
        hkv,
        d,
        float(scale) * _LOG2E,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_D=_block(d),
        DOT_PRECISION=_dot_precision(q.dtype),
        NATIVE_DOT=q.is_cuda,
    )
    return out


# --------------------------------------------------------------------------- decode attention


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    S,
    HQ,
    HKV,
    D,
    qk_scale,
    SPLIT_SIZE,
    NUM_SPLITS,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid (HKV, NUM_SPLITS). One program: the G = HQ // HKV query heads sharing kv head
    # `kvh`, over keys [split * SPLIT_SIZE, min(S, (split + 1) * SPLIT_SIZE)) (never empty).
    # q [HQ, D], k/v [S, HKV, D] contiguous. Everything in fp32, as the reference.
    # Writes unnormalized acc [HQ, NUM_SPLITS, D], running max m and sum l [HQ, NUM_SPLITS]
    # (exp2 domain) for _decode_reduce_kernel.
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    g = HQ // HKV
    gi = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    gmask = gi < g
    dmask = dims < D
    heads = kvh * g + gi  # [G] query heads
    q = tl.load(
        q_ptr + heads[:, None] * D + dims[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
    ).to(tl.float32)  # [G, Dp]

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    lo = split * SPLIT_SIZE
    hi = tl.minimum(S, lo + SPLIT_SIZE)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        kv_offs = cols[:, None].to(tl.int64) * (HKV * D) + kvh * D + dims[None, :]
        kv_mask = cmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [N, Dp]
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [G, N]
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, True, "ieee")  # fp32 V: P unrounded

    stat_offs = heads * NUM_SPLITS + split  # [G]
    tl.store(m_ptr + stat_offs, m_i, mask=gmask)
    tl.store(l_ptr + stat_offs, l_i, mask=gmask)
    acc_offs = (heads[:, None] * NUM_SPLITS + split) * D + dims[None, :]
    tl.store(acc_ptr + acc_offs, acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    D,
    NUM_SPLITS,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid (HQ,). Merge the per-split partial softmaxes of one query head:
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
    h = tl.program_id(0)
    sp = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    dmask = dims < D
    m = tl.load(m_ptr + h * NUM_SPLITS + sp, mask=smask, other=float("-inf"))
    l_s = tl.load(l_ptr + h * NUM_SPLITS + sp, mask=smask, other=0.0)
    acc = tl.load(
        acc_ptr + (h * NUM_SPLITS + sp[:, None]) * D + dims[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )  # [SPLITS, Dp]
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)  # [SPLITS]; padded splits get 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + h * D + dims, _round(out, out_ptr.dtype.element_ty), mask=dmask)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D], k/v [S, Hkv, D] with S >= 1 -> [Hq, D]; split-K over S, fp32 math."""
    _check_attention("decode_attention", q, k, v, q_dims=2)
    hq, d = q.shape
    s_len, hkv = k.shape[0], k.shape[1]
    if s_len == 0:
        raise ValueError("decode_attention: k/v are empty; decode needs at least one cached row")
    block_n = 32
    # Split so that long caches spread over many programs; every split holds >= 1 row.
    split_size = max(block_n, triton.cdiv(triton.cdiv(s_len, _MAX_DECODE_SPLITS), block_n) * block_n)
    num_splits = triton.cdiv(s_len, split_size)
    assert (num_splits - 1) * split_size < s_len <= num_splits * split_size
    acc = torch.empty((hq, num_splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((hq, num_splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty((hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = _block(d)
    _decode_partial_kernel[(hkv, num_splits)](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        acc,
        m,
        l_sum,
        s_len,
        hq,
        hkv,
        d,
        float(scale) * _LOG2E,
        split_size,
        num_splits,
        BLOCK_G=_block(hq // hkv),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    out = torch.empty((hq, d), dtype=q.dtype, device=q.device)
    _decode_reduce_kernel[(hq,)](
        acc,
        m,
        l_sum,
        out,
        d,
        num_splits,
        BLOCK_SPLITS=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d,
    )
    return out


TRITON_OPS = Ops(
    name="triton",
    quant_linear=triton_quant_linear.linear,
    rms_norm=rms_norm,
    rotary=rotary,
    prefill_attention=prefill_attention,
    decode_attention=decode_attention,
    delta_rule_prefill=triton_chunk_gated_delta_rule,
    delta_rule_decode=triton_gated_delta_rule,
)
