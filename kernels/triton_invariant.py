"""Batch- and chunk-invariant Triton kernels: the GPU bundle "triton_invariant" (kernels/ops.py
`ops_for(cuda, invariant=True)`; shapes and semantics as kernels/ops.py, oracles in
kernels/reference.py).

Invariant means: an output row (a token of a matrix product, a query of attention, a row of
a norm or softmax, a token of the delta rule) is the same bits whatever else the call holds
— the row count M, the batch's composition, the prefill chunk it sits in, decode vs prefill.
The rules every kernel here follows:
  - Tile shapes (BLOCK_* constexprs), warps and stages are fixed per dtype and model shape
    (K, N, D), never chosen from the row count; row counts, sequence lengths and offsets are
    `do_not_specialize`, so one compiled binary serves every M, T and S (Triton would
    otherwise compile a separate variant for a count of 1 or a multiple of 16).
  - Programs split rows and output columns, never a reduction: a row's sum over K (linear),
    over D (norms) or over keys (attention) is one program's loop in increasing tiles from 0,
    fp32 accumulation, one rounding at the end. No split-K, no split-KV partials.
  - A row's result inside a tile does not depend on its neighbours in the tile: tl.dot
    computes each output element from its own row and column (on a GPU the MMA instruction
    sums a fixed K-order per element; under the interpreter the tile product is one numpy
    matmul of a fixed shape), and masked padding rows are zeros that are never stored.
  - Attention: key tiles of BLOCK_N at fixed absolute positions (tile j holds keys
    BLOCK_N j .. BLOCK_N j + BLOCK_N - 1, `offset` counted in), online softmax in increasing
    tile order, then the extra keys in tiles from extra row 0, then the sink. A program may
    visit tiles a row cannot see (its block spans several queries); such a tile is an exact
    no-op for that row (scores -inf: weight 0, m unchanged, alpha = 2^0 = 1), so a decode
    row, the same row in a prefill chunk of any length and in a one-shot prefill all reduce
    the same keys in the same order with the same instructions (one kernel for all three).
  - The gated delta rule is one token-serial recurrence for prefill and decode, the L2 norms
    of q and k computed in the kernel per token (torch's reductions on a GPU pick their
    blocking from the tensor's shape), the state carried in fp32 between calls.
Elementwise ops (rotary, silu_mul, exp, sigmoid, silu, softplus) are invariant as they are on
a GPU (one functor per element, no reduction); top-k is reference.stable_topk, whose result
(value descending, index ascending) is a function of the row alone.

Under TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors
(tests/kernels/test_triton_invariant.py). The interpreter's tl.dot cannot multiply bf16, so
off a GPU 16-bit operands are upcast to fp32 first (exact products, fp32 sums): the same
values, summed in numpy's order instead of the MMA's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from keepwarm.kernels import reference, triton_ops, triton_quant_linear
from keepwarm.kernels.ops import Ops, decode_each
from keepwarm.kernels.triton_common import _check_dtype, _out_tile, _round, _store_out_tile
from keepwarm.kernels.triton_ops import _block, _dot_precision, _softmax_tile

_LOG2E = 1.4426950408889634

# linear tiles (BLOCK_M, BLOCK_N, BLOCK_K) per dtype: fixed, whatever M is.
_LINEAR_TILES: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float32: (32, 32, 32),
    torch.bfloat16: (64, 64, 64),
    torch.float16: (64, 64, 64),
}
# attention: BLOCK_M packed (query, head-in-group) rows, BLOCK_N keys per tile.
_ATTN_BLOCK_M = 16
_ATTN_BLOCK_N = 32
_NUM_WARPS = 4
_NUM_STAGES = 2
_SOFTMAX_MAX_BLOCK = 1024
_CONV_BLOCK_L = 64
_DELTA_MAX_BLOCK_V = 64


def _launch_opts() -> dict[str, int]:
    return {"num_warps": _NUM_WARPS, "num_stages": _NUM_STAGES}


# --------------------------------------------------------------------------- linear


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). x [M, K] contiguous, w [N, K] strided,
    # out [M, N]. out[m, n] = round(sum_k x[m, k] w[n, k] + b[n]): K in tiles of BLOCK_K from
    # 0 upward into one fp32 accumulator, the bias added after the last tile, one rounding.
    rows, cols, rmask, cmask = _out_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )  # [BM, BK]
        b = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )  # [BK, BN]
        if NATIVE_DOT:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    _store_out_tile(out_ptr, acc, b_ptr, rows, cols, rmask, cmask, N, HAS_BIAS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] | None -> [..., N] in x's dtype (F.linear), one fixed
    K-order per output whatever the row count."""
    _check_dtype("linear x", x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear: weight shape {tuple(weight.shape)} must be [N, {x.shape[-1]}] to match x's last dim"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"linear: x dtype {x.dtype} and weight dtype {weight.dtype} must match")
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias shape {tuple(bias.shape)} must be ({n},)")
    x2 = x.reshape(-1, k).contiguous()  # [M, K]; a copy changes no value
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        bm, bn, bk = _LINEAR_TILES[x.dtype]
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2,
            weight,
            bias if bias is not None else x2,  # a dummy pointer when HAS_BIAS is off
            out,
            m,
            n,
            k,
            weight.stride(0),
            weight.stride(1),
            HAS_BIAS=bias is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            DOT_PRECISION=_dot_precision(x.dtype),
            NATIVE_DOT=x.is_cuda,
            **_launch_opts(),
        )
    return out.view(*x.shape[:-1], n)


# --------------------------------------------------------------------------- row-local norms, softmax


@triton.jit
def _rms_norm_1p_kernel(x_ptr, scale_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr):
    # One program per row of x [R, D] (contiguous): round(x * rsqrt(mean(x^2) + eps) * scale),
    # fp32 math, the row's sum of squares one tl.sum over a fixed BLOCK_D.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xf = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    s = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(var + eps) * s
    tl.store(out_ptr + row * D + cols, _round(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm_1p(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], scale [D] float32 -> [..., D] in x's dtype (reference.rms_norm_1p)."""
    _check_dtype("rms_norm_1p x", x)
    d = x.shape[-1]
    if scale.shape != (d,):
        raise ValueError(
            f"rms_norm_1p: scale shape {tuple(scale.shape)} must be ({d},) to match x's last dim"
        )
    x2 = x.reshape(-1, d).contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_1p_kernel[(x2.shape[0],)](
            x2, scale.contiguous(), out, d, float(eps), BLOCK_D=triton.next_power_of_2(d), **_launch_opts()
        )
    return out.view(x.shape)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # One program per row of x [R, N] (contiguous) -> fp32 out [R, N]. The row in tiles of
    # BLOCK from 0: a lane-wise running max, then lane-wise sums of exp(x - max), each reduced
    # once by a fixed tree; BLOCK depends only on N.
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        xs = tl.load(x_ptr + row * N + c0 + lanes, mask=c0 + lanes < N, other=float("-inf")).to(tl.float32)
        m_vec = tl.maximum(m_vec, xs)
    m = tl.max(m_vec, axis=0)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        xs = tl.load(x_ptr + row * N + c0 + lanes, mask=c0 + lanes < N, other=float("-inf")).to(tl.float32)
        s_vec += tl.exp(xs - m)
    total = tl.sum(s_vec, axis=0)
    for c0 in range(0, N, BLOCK):
        cmask = c0 + lanes < N
        xs = tl.load(x_ptr + row * N + c0 + lanes, mask=cmask, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * N + c0 + lanes, tl.exp(xs - m) / total, mask=cmask)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 softmax over `dim` (reference.softmax); an element's bits depend only on its
    slice along `dim`."""
    _check_dtype("softmax x", x)
    xt = x.movedim(dim, -1)
    n = xt.shape[-1]
    x2 = xt.reshape(-1, n).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if out.numel() > 0:
        block = min(triton.next_power_of_2(n), _SOFTMAX_MAX_BLOCK)
        _softmax_kernel[(x2.shape[0],)](x2, out, n, BLOCK=block, **_launch_opts())
    return out.view(xt.shape).movedim(-1, dim)


# --------------------------------------------------------------------------- conv + silu


@triton.jit(do_not_specialize=["L", "L_OUT"])
def _conv_silu_kernel(x_ptr, w_ptr, out_ptr, C, L, L_OUT, KW, BLOCK_L: tl.constexpr):
    # Grid (B * C, cdiv(L_OUT, BLOCK_L)). x [B, C, L], w [C, KW], out [B, C, L_OUT], contiguous.
    # out[l] = silu(round(sum_j x[l + j] w[j])) rounded: taps j = 0 .. KW - 1 in order, fp32.
    bc = tl.program_id(0).to(tl.int64)
    c = bc % C
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = ls < L_OUT
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(0, KW):
        xs = tl.load(x_ptr + bc * L + ls + j, mask=lmask, other=0.0).to(tl.float32)
        acc += xs * tl.load(w_ptr + c * KW + j).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    y = _round(acc, ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + bc * L_OUT + ls, _round(y, ty), mask=lmask)


def conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., C, L], weight [C, 1, K] -> [..., C, L - K + 1] (reference.conv_silu)."""
    _check_dtype("conv_silu x", x)
    c, l_in = x.shape[-2], x.shape[-1]
    if weight.dim() != 3 or weight.shape[0] != c or weight.shape[1] != 1:
        raise ValueError(
            f"conv_silu: weight shape {tuple(weight.shape)} must be ({c}, 1, K) to match x's channels"
        )
    kw = weight.shape[2]
    l_out = l_in - kw + 1
    if l_out < 0:
        raise ValueError(f"conv_silu: x holds {l_in} positions, fewer than the {kw} taps minus one")
    x3 = x.reshape(-1, c, l_in).contiguous()
    out = torch.empty((x3.shape[0], c, l_out), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        grid = (x3.shape[0] * c, triton.cdiv(l_out, _CONV_BLOCK_L))
        _conv_silu_kernel[grid](
            x3,
            weight.reshape(c, kw).contiguous(),
            out,
            c,
            l_in,
            l_out,
            kw,
            BLOCK_L=_CONV_BLOCK_L,
            **_launch_opts(),
        )
    return out.view(*x.shape[:-2], c, l_out)


# --------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["T", "S", "C", "OFFSET", "WINDOW"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    xk_ptr,
    xv_ptr,
    xmask_ptr,
    sink_ptr,
    out_ptr,
    pos_ptr,
    T,
    S,
    C,
    HQ,
    HKV,
    D,
    DV,
    OFFSET,
    WINDOW,
    qk_scale,
    HAS_EXTRA: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    TABLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    # Grid (cdiv(T * G, BLOCK_M), HKV), G = HQ // HKV. q [T, HQ, D], k [S, HKV, D],
    # v [S, HKV, DV], xk [C, HKV, D], xv [C, HKV, DV], xmask [T, C] int8, sinks [HQ] fp32,
    # out [T, HQ, DV]; all contiguous. Row r of the block is query t = r // G of head
    # kvh * G + r % G. Query t sits at absolute position p = OFFSET + S - T + t, key row i at
    # OFFSET + i; p sees keys max(OFFSET, p - WINDOW + 1) .. p (WINDOW 0: from OFFSET).
    # Exp2 domain: qk_scale holds scale * log2(e).
    # TABLE: one decode query per sequence b of a batch whose caches sit anywhere (no host
    # value depends on the batch, so a CUDA graph can replay it): grid axis 0 is (b, row
    # block); k_ptr / v_ptr hold each sequence's cache address [B] int64, pos_ptr its query's
    # position [B] int64 (S = position + 1 rows), q [B, HQ, D], out [B, HQ, DV]. Everything
    # after this block is the same code, so row b has the bits of that query alone.
    kvh = tl.program_id(1)
    g = HQ // HKV
    if TABLE:
        num_blocks = tl.cdiv(g, BLOCK_M)
        b = tl.program_id(0) // num_blocks
        pid_m = tl.program_id(0) % num_blocks
        k_ptr = tl.load(k_ptr + b).to(tl.pointer_type(q_ptr.dtype.element_ty))
        v_ptr = tl.load(v_ptr + b).to(tl.pointer_type(q_ptr.dtype.element_ty))
        q_ptr += b.to(tl.int64) * HQ * D
        out_ptr += b.to(tl.int64) * HQ * DV
        S = tl.load(pos_ptr + b).to(tl.int32) + 1
        T = 1
    else:
        pid_m = tl.program_id(0)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < T * g
    t = r // g
    head = kvh * g + r % g
    dims = tl.arange(0, BLOCK_D)
    dvs = tl.arange(0, BLOCK_DV)
    dmask = dims < D
    dvmask = dvs < DV
    q = tl.load(
        q_ptr + (t[:, None].to(tl.int64) * HQ + head[:, None]) * D + dims[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BM, BD]
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    q_pos = OFFSET + S - T + t  # [BM]

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Key tiles at absolute positions: from the tile holding the block's first row's first
    # visible key to the tile holding its last row's own position.
    t_lo = (pid_m * BLOCK_M) // g
    t_hi = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // g)
    first = tl.where(WINDOW > 0, tl.maximum(OFFSET, OFFSET + S - T + t_lo - WINDOW + 1), OFFSET)
    hi = OFFSET + S - T + t_hi + 1
    for a0 in range((first // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        k_pos = a0 + tl.arange(0, BLOCK_N)  # [BN] absolute
        k_row = k_pos - OFFSET
        kmask = (k_row >= 0) & (k_row < S)
        k = tl.load(
            k_ptr + (k_row[:, None].to(tl.int64) * HKV + kvh) * D + dims[None, :],
            mask=kmask[:, None] & dmask[None, :],
            other=0.0,
        )  # [BN, BD]
        v = tl.load(
            v_ptr + (k_row[:, None].to(tl.int64) * HKV + kvh) * DV + dvs[None, :],
            mask=kmask[:, None] & dvmask[None, :],
            other=0.0,
        )  # [BN, BDV]
        if not NATIVE_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN] fp32
        in_window = (WINDOW == 0) | (k_pos[None, :] > q_pos[:, None] - WINDOW)
        visible = kmask[None, :] & (k_pos[None, :] <= q_pos[:, None]) & in_window
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, NATIVE_DOT, DOT_PRECISION)

    if HAS_EXTRA:
        # Extra keys (compressed rows), in tiles from extra row 0, visible where xmask[t, c].
        for c0 in range(0, C, BLOCK_N):
            cs = c0 + tl.arange(0, BLOCK_N)
            cmask = cs < C
            k = tl.load(
                xk_ptr + (cs[:, None].to(tl.int64) * HKV + kvh) * D + dims[None, :],
                mask=cmask[:, None] & dmask[None, :],
                other=0.0,
            )
            v = tl.load(
                xv_ptr + (cs[:, None].to(tl.int64) * HKV + kvh) * DV + dvs[None, :],
                mask=cmask[:, None] & dvmask[None, :],
                other=0.0,
            )
            if not NATIVE_DOT:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            seen = tl.load(
                xmask_ptr + t[:, None].to(tl.int64) * C + cs[None, :],
                mask=rmask[:, None] & cmask[None, :],
                other=0,
            )
            s = tl.where(seen != 0, s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, NATIVE_DOT, DOT_PRECISION)

    if HAS_SINKS:
        # One more logit per head in the denominator only, last.
        sink = tl.load(sink_ptr + head, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (t[:, None].to(tl.int64) * HQ + head[:, None]) * DV + dvs[None, :],
        _round(out, out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dvmask[None, :],
    )


def _attention_tiles(q: torch.Tensor, d: int, dv: int) -> dict[str, object]:
    """The attention kernel's tiles and launch options: one set for every call (prefill,
    decode, address-table decode), so each reduces a row's keys the same way."""
    return {
        "BLOCK_M": _ATTN_BLOCK_M,
        "BLOCK_N": _ATTN_BLOCK_N,
        "BLOCK_D": _block(d),
        "BLOCK_DV": _block(dv),
        "DOT_PRECISION": _dot_precision(q.dtype),
        "NATIVE_DOT": q.is_cuda,
        **_launch_opts(),
    }


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    offset: int = 0,
    extra_k: torch.Tensor | None = None,
    extra_v: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, Hq, Dv] in q's dtype:
    cpu_attention.attention's contract (sliding `window` over rows at absolute positions
    `offset` + i, masked `extra_*` keys, `sinks` [Hq]); oracle cpu_attention.attention_reference."""
    for label, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(f"attention {label}", x)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"attention: expected q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    t_len, hq, d = q.shape
    s_len, hkv = k.shape[0], k.shape[1]
    dv = v.shape[2]
    if k.shape[2] != d or hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"attention: q heads {hq} must be a multiple of kv heads {hkv} and head dims must match "
            f"(q {d}, k {k.shape[2]})"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention: q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}")
    if s_len < t_len:
        raise ValueError(f"attention: k/v hold {s_len} rows, fewer than the {t_len} queries")
    if window < 0 or offset < 0:
        raise ValueError(f"attention: window {window} and offset {offset} must be >= 0")
    has_extra = extra_k is not None
    if has_extra != (extra_v is not None) or has_extra != (extra_mask is not None):
        raise ValueError("attention: pass extra_k, extra_v and extra_mask together, or none of them")
    c_len = 0
    if extra_k is not None and extra_v is not None and extra_mask is not None:
        c_len = extra_k.shape[0]
        if extra_k.shape != (c_len, hkv, d) or extra_v.shape != (c_len, hkv, dv):
            raise ValueError(
                f"attention: extra_k {tuple(extra_k.shape)} must be ({c_len}, {hkv}, {d}) and "
                f"extra_v {tuple(extra_v.shape)} ({c_len}, {hkv}, {dv})"
            )
        if extra_mask.shape != (t_len, c_len):
            raise ValueError(f"attention: extra_mask {tuple(extra_mask.shape)} must be ({t_len}, {c_len})")
        if extra_k.dtype != q.dtype or extra_v.dtype != q.dtype:
            raise ValueError(f"attention: extra_k/extra_v dtype must be q's ({q.dtype})")
        has_extra = c_len > 0
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"attention: sinks shape {tuple(sinks.shape)} must be ({hq},)")
    out = torch.empty((t_len, hq, dv), dtype=q.dtype, device=q.device)
    if t_len == 0:
        return out
    qc = q.contiguous()
    xk = extra_k.contiguous() if has_extra and extra_k is not None else qc
    xv = extra_v.contiguous() if has_extra and extra_v is not None else qc
    xm = extra_mask.to(torch.int8).contiguous() if has_extra and extra_mask is not None else qc
    sk = sinks.to(torch.float32).contiguous() if sinks is not None else qc
    g = hq // hkv
    grid = (triton.cdiv(t_len * g, _ATTN_BLOCK_M), hkv)
    _attention_kernel[grid](
        qc,
        k.contiguous(),
        v.contiguous(),
        xk,
        xv,
        xm,
        sk,
        out,
        qc,  # no position table
        t_len,
        s_len,
        c_len,
        hq,
        hkv,
        d,
        dv,
        offset,
        window,
        float(scale) * _LOG2E,
        HAS_EXTRA=has_extra,
        HAS_SINKS=sinks is not None,
        TABLE=False,
        **_attention_tiles(q, d, dv),
    )
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] with S >= T -> [T, Hq, D] (bottom-right causal)."""
    return attention(q, k, v, scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D], k/v [S, Hkv, D] with S >= 1 -> [Hq, D]: the prefill kernel for one query,
    so a decode row is the same bits as that row inside any prefill chunk."""
    if q.dim() != 2:
        raise ValueError(f"decode_attention: q must be [Hq, D], got shape {tuple(q.shape)}")
    if k.shape[0] == 0:
        raise ValueError("decode_attention: k/v are empty; decode needs at least one cached row")
    return attention(q.unsqueeze(0), k, v, scale)[0]


def _check_table(
    name: str, q: torch.Tensor, tables: tuple[torch.Tensor, ...], positions: torch.Tensor
) -> int:
    """B, after checking that every per-sequence table is [B] int64, contiguous, on q's device."""
    b = q.shape[0]
    for t in (*tables, positions):
        if t.shape != (b,) or t.dtype != torch.int64 or t.device != q.device or not t.is_contiguous():
            raise ValueError(
                f"{name}: address and position tables must be contiguous [{b}] int64 on {q.device}; "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    return b


def decode_attention_table(
    q: torch.Tensor,
    k_table: torch.Tensor,
    v_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    num_kv_heads: int,
) -> torch.Tensor:
    """The decode attention of B sequences whose caches sit anywhere: q [B, Hq, D]; k_table[b] /
    v_table[b] the address (data_ptr) of sequence b's contiguous cache rows [>= p_b + 1,
    num_kv_heads, D] in q's dtype; positions [B] int64, p_b the query's position, so it sees
    rows 0 .. p_b. -> [B, Hq, D]. Row b has the bits of decode_attention(q[b], k_b[: p_b + 1],
    v_b[: p_b + 1]): the same kernel. Nothing here reads a device value on the host, so a CUDA
    graph can capture the call and replay it for other caches, positions and lengths."""
    _check_dtype("decode_attention_table q", q)
    b = _check_table("decode_attention_table", q, (k_table, v_table), positions)
    hq, d = q.shape[1], q.shape[2]
    if q.dim() != 3 or num_kv_heads <= 0 or hq % num_kv_heads != 0:
        raise ValueError(
            f"decode_attention_table: q {tuple(q.shape)} must be [B, Hq, D] with Hq a multiple of "
            f"num_kv_heads {num_kv_heads}"
        )
    out = torch.empty_like(q)
    if b == 0:
        return out
    qc = q.contiguous()
    g = hq // num_kv_heads
    grid = (b * triton.cdiv(g, _ATTN_BLOCK_M), num_kv_heads)
    _attention_kernel[grid](
        qc,
        k_table,
        v_table,
        qc,
        qc,
        qc,
        qc,
        out,
        positions,
        1,
        1,  # S and T are read per sequence from `positions`
        0,
        hq,
        num_kv_heads,
        d,
        d,
        0,
        0,
        float(scale) * _LOG2E,
        HAS_EXTRA=False,
        HAS_SINKS=False,
        TABLE=True,
        **_attention_tiles(q, d, d),
    )
    return out


def decode_attention_batch(
    q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """q [B, Hq, D] against ks[b], vs[b] [S_b, Hkv, D] -> [B, Hq, D]: one launch of the
    address-table kernel for the B decode rows (row b the bits of decode_attention(q[b], ks[b],
    vs[b], scale)). Rows must be contiguous; otherwise one call per sequence."""
    if not all(t.is_contiguous() and t.dtype == q.dtype and t.shape[0] > 0 for t in (*ks, *vs)):
        return decode_each(q, ks, vs, scale, decode_attention)
    hkv = ks[0].shape[1]
    for k, v in zip(ks, vs, strict=True):
        if k.shape != v.shape or k.shape[1:] != (hkv, q.shape[2]):
            raise ValueError(
                f"decode_attention_batch: every k/v must be [S, {hkv}, {q.shape[2]}]; got {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
    host = torch.tensor(
        [[k.data_ptr() for k in ks], [v.data_ptr() for v in vs], [k.shape[0] - 1 for k in ks]]
    )
    tables = host.to(q.device)
    return decode_attention_table(q, tables[0], tables[1], tables[2], scale, hkv)


@triton.jit
def _write_rows_kernel(src_ptr, table_ptr, pos_ptr, ROW, BLOCK: tl.constexpr):
    # Grid (B, cdiv(ROW, BLOCK)): src [B, ROW] contiguous; row b goes to row pos[b] of the
    # [*, ROW] buffer at address table[b].
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    dst = tl.load(table_ptr + b).to(tl.pointer_type(src_ptr.dtype.element_ty))
    pos = tl.load(pos_ptr + b)
    row = tl.load(src_ptr + b.to(tl.int64) * ROW + offs, mask=mask)
    tl.store(dst + pos * ROW + offs, row, mask=mask)


_WRITE_BLOCK = 1024


def write_rows(rows: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> None:
    """rows [B, ...] -> row positions[b] of the contiguous buffer [*, ...] (same row shape and
    dtype) at address table[b]: each decoding sequence's new K or V row, in one launch and
    without a host value (CUDA-graph capturable)."""
    _check_dtype("write_rows rows", rows)
    b = _check_table("write_rows", rows, (table,), positions)
    if b == 0:
        return
    src = rows.contiguous().view(b, -1)
    row = src.shape[1]
    _write_rows_kernel[(b, triton.cdiv(row, _WRITE_BLOCK))](src, table, positions, row, BLOCK=_WRITE_BLOCK)


# --------------------------------------------------------------------------- gated delta rule


@triton.jit(do_not_specialize=["T"])
def _delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    s_ptr,
    o_ptr,
    T,
    HK,
    HV,
    DK,
    DV,
    q_scale,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Grid (HV, cdiv(DV, BLOCK_V)). q, k [T, HK, DK], v [T, HV, DV], g, beta [T, HV] (any
    # float dtype, contiguous), s [HV, DK, DV] fp32 (in: initial state, out: final state),
    # o [T, HV, DV] in q's dtype. Per token, in order: q, k L2-normalized (eps 1e-6) here,
    # q scaled; S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
    h = tl.program_id(0)
    vb = tl.program_id(1)
    hk = h // (HV // HK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_ptrs = s_ptr + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)  # [BK, BV]
    for t in range(T):
        qk_row = (t * HK + hk).to(tl.int64)  # row of q, k [T * HK, DK]
        v_row = (t * HV + h).to(tl.int64)  # row of v, o [T * HV, DV] and index into g, beta
        q_t = tl.load(q_ptr + qk_row * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k_t = tl.load(k_ptr + qk_row * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v_t = tl.load(v_ptr + v_row * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        g_t = tl.load(g_ptr + v_row).to(tl.float32)
        b_t = tl.load(beta_ptr + v_row).to(tl.float32)
        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, axis=0) + 1e-6)
        q_t = q_t * q_scale
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t, axis=0) + 1e-6)
        s = s * tl.exp(g_t)
        kv_mem = tl.sum(s * k_t[:, None], axis=0)  # [BV]
        delta = (v_t - kv_mem) * b_t
        s = s + k_t[:, None] * delta[None, :]
        o_t = tl.sum(s * q_t[:, None], axis=0)
        tl.store(o_ptr + v_row * DV + offs_v, _round(o_t, o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptrs, s, mask=mask_s)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/delta_rule.py's contract, token-serial for any T: a span gives the same bits in
    one call, in chunks of any length or token by token (the state stays fp32), and a value
    head's bits do not depend on the other heads in the call."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != t or hk == 0 or hv % hk != 0:
        raise ValueError(
            f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)} must match and v {tuple(v.shape)} "
            f"hold the same T with value heads a multiple of key heads"
        )
    if g.shape != (t, hv) or beta.shape != (t, hv) or state.shape != (hv, dk, dv):
        raise ValueError(
            f"gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be ({t}, {hv}), "
            f"state {tuple(state.shape)} ({hv}, {dk}, {dv})"
        )
    s = state.to(torch.float32).contiguous().clone()  # updated in place by the kernel
    out = torch.empty((t, hv, dv), dtype=q.dtype, device=q.device)
    block_v = min(triton.next_power_of_2(dv), _DELTA_MAX_BLOCK_V)
    _delta_rule_kernel[(hv, triton.cdiv(dv, block_v))](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        s,
        out,
        t,
        hk,
        hv,
        dk,
        dv,
        dk**-0.5,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        **_launch_opts(),
    )
    return out, s


TRITON_INVARIANT_OPS = Ops(
    name="triton_invariant",
    rms_norm=triton_ops.rms_norm,  # one program per row, BLOCK_D from D only: row-local already
    rotary=triton_ops.rotary,  # elementwise per position
    prefill_attention=prefill_attention,
    decode_attention=decode_attention,
    decode_attention_batch=decode_attention_batch,
    linear=linear,
    quant_linear=triton_quant_linear.linear,  # fixed tiles, K in blocks of 32 from 0: row-invariant
    rms_norm_1p=rms_norm_1p,
    softmax=softmax,
    conv_silu=conv_silu,
    topk=reference.stable_topk,
    delta_rule_prefill=gated_delta_rule,  # token-serial: a chunk == its tokens decoded one by one
    delta_rule_decode=gated_delta_rule,
    attention=attention,
    decode_attention_table=decode_attention_table,
    write_rows=write_rows,
)
