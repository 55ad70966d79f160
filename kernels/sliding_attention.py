"""Causal attention with an optional sliding window and optional attention sinks, one
sequence (no batch dim), for the sliding families (laguna, gpt_oss).

  prefill(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale, window, sinks) -> [T, Hq, D]
      S >= T; query t sits at row S - T + t of k/v and sees the rows j with
      S - T + t - window < j <= S - T + t (window None: every earlier row).
  decode(q [Hq, D], k [R, Hkv, D], v [R, Hkv, D], scale, position, window, sinks) -> [Hq, D]
      k/v is a ring: absolute position a lives at row a % R. The query at `position` sees
      the n = min(position + 1, window) positions position - n + 1 .. position (n <= R).
      A full-attention cache is the ring with R = capacity > position (no wrap).
  sinks [Hq] float32 or None: per-head logit of a virtual key whose value is zero (gpt-oss):
      softmax over [scores, sink], then the sink's column is dropped.
Hq is a multiple of Hkv (key head h // (Hq // Hkv) serves query head h). Softmax and
accumulators run in float32; outputs are in q's dtype.

Two implementations with one signature: the torch references (`torch_prefill`,
`torch_decode`) and Triton kernels (`triton_prefill`, `triton_decode`: flash-attention
prefill with the window's key range skipped, split-K decode reading the ring in place).
The kernels are defined on first use (importing this module never needs Triton, and
TRITON_INTERPRET, read when a kernel is decorated, may be set after import).
`sliding_attention_for(device)` picks the bundle at one call site.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PrefillFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None", "torch.Tensor | None"], torch.Tensor
]
DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int, "int | None", "torch.Tensor | None"], torch.Tensor
]

_LOG2E = 1.4426950408889634
_Q_BLOCK = 256  # queries per block of the explicit (sinks) reference: bounds the [H, B, S] scores


def _check(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> None:
    hq, d = q.shape[-2], q.shape[-1]
    if k.dim() != 3 or k.shape != v.shape or k.shape[2] != d or hq % k.shape[1]:
        raise ValueError(
            f"{name}: need k, v [S, Hkv, {d}] with Hkv dividing {hq} query heads; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None and (sinks.shape != (hq,) or sinks.dtype != torch.float32):
        raise ValueError(f"{name}: sinks must be float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")


def _window_ok(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 (or None for full attention), got {window}")


# -- torch references ------------------------------------------------------------
def torch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    _check("prefill", q, k, v, sinks)
    _window_ok(window)
    t, s = q.shape[0], k.shape[0]
    if s < t:
        raise ValueError(f"prefill: k/v hold {s} rows, fewer than the {t} queries")
    start = s - t
    pos_q = torch.arange(start, s, device=q.device).unsqueeze(1)
    pos_k = torch.arange(s, device=q.device).unsqueeze(0)
    visible = pos_k <= pos_q  # [T, S] bottom-right causal
    if window is not None:
        visible &= pos_k > pos_q - window
    if sinks is None:
        # [1, H, T|S, D]: SDPA takes its fused kernels only for 4-D inputs
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if start == 0 and (window is None or window >= s):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    # Sinks: explicit float32 softmax with the sink's logit in the denominator, by query block.
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(0, t, _Q_BLOCK):
        qb = q[b : b + _Q_BLOCK].float().transpose(0, 1)  # [Hq, B, D]
        scores = (qb @ kf.transpose(1, 2)) * scale  # [Hq, B, S]
        scores = scores.masked_fill(~visible[b : b + _Q_BLOCK], float("-inf"))
        out[b : b + _Q_BLOCK] = (_softmax_with_sinks(scores, sinks) @ vf).transpose(0, 1).to(q.dtype)
    return out


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """scores [Hq, ..., S] float32 -> probabilities over S with sinks[h] as one more logit."""
    sink = sinks.view(-1, *([1] * (scores.dim() - 1)))  # [Hq, 1.., 1]
    m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(scores - m)
    return p / (p.sum(dim=-1, keepdim=True) + torch.exp(sink - m))


def ring_rows(k: torch.Tensor, position: int, n: int) -> torch.Tensor:
    """The rows of positions position - n + 1 .. position of ring `k` [R, ...], in position order
    (a view when they do not wrap)."""
    r = k.shape[0]
    lo = position - n + 1
    if position < r:
        return k[lo : position + 1]
    idx = torch.arange(lo, position + 1, device=k.device) % r
    return k.index_select(0, idx)


def torch_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    position: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    _check("decode", q, k, v, sinks)
    _window_ok(window)
    n = position + 1 if window is None else min(position + 1, window)
    if not 0 <= position or n > k.shape[0]:
        raise ValueError(f"decode: position {position} needs {n} rows, the ring holds {k.shape[0]}")
    kk, vv = ring_rows(k, position, n), ring_rows(v, position, n)
    hq, hkv = q.shape[0], k.shape[1]
    qg = q.reshape(hkv, hq // hkv, -1).float()  # [Hkv, G, D]
    scores = torch.einsum("hgd,shd->hgs", qg, kk.float()) * scale
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_with_sinks(scores.reshape(hq, -1), sinks).reshape(scores.shape)
    out = torch.einsum("hgs,shd->hgd", probs, vv.float())
    return out.reshape(hq, -1).to(q.dtype)


# -- Triton ----------------------------------------------------------------------
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_DOT = 16  # smallest tile side tl.dot accepts on a GPU
_MAX_DECODE_SPLITS = 32


def _block(n: int) -> int:
    import triton

    return max(_MIN_DOT, triton.next_power_of_2(n))


def _triton_check(name: str, q: torch.Tensor) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {q.dtype} is not supported; pass float32, bfloat16 or float16")


def triton_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flash-attention prefill; same contract as `torch_prefill`."""
    import triton

    _check("prefill", q, k, v, sinks)
    _window_ok(window)
    _triton_check("prefill", q)
    t, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    if s < t:
        raise ValueError(f"prefill: k/v hold {s} rows, fewer than the {t} queries")
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block_m = 16 if t <= 16 else 32
    sink_arg = sinks.contiguous() if sinks is not None else q  # not read without HAS_SINKS
    _kernels().prefill[(triton.cdiv(t, block_m), hq)](
        q.contiguous(), k.contiguous(), v.contiguous(), sink_arg, out,
        t, s, hq, hkv, d, window or 0, float(scale) * _LOG2E,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=_block(d),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NATIVE_DOT=q.is_cuda,
    )  # fmt: skip
    return out


def triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    position: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-K decode over the ring in place; same contract as `torch_decode`."""
    import triton

    _check("decode", q, k, v, sinks)
    _window_ok(window)
    _triton_check("decode", q)
    hq, d = q.shape
    r, hkv = k.shape[0], k.shape[1]
    n = position + 1 if window is None else min(position + 1, window)
    if not 0 <= position or n > r:
        raise ValueError(f"decode: position {position} needs {n} rows, the ring holds {r}")
    block_n = 32
    split = max(block_n, triton.cdiv(triton.cdiv(n, _MAX_DECODE_SPLITS), block_n) * block_n)
    num_splits = triton.cdiv(n, split)
    acc = torch.empty((hq, num_splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((hq, num_splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty((hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = _block(d)
    kern = _kernels()
    kern.decode_partial[(hkv, num_splits)](
        q.contiguous(), k.contiguous(), v.contiguous(), acc, m, l_sum,
        n, position - n + 1, r, hq, hkv, d, float(scale) * _LOG2E, split, num_splits,
        BLOCK_G=_block(hq // hkv), BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    out = torch.empty((hq, d), dtype=q.dtype, device=q.device)
    sink_arg = sinks.contiguous() if sinks is not None else m  # not read without HAS_SINKS
    kern.decode_reduce[(hq,)](
        acc, m, l_sum, sink_arg, out, d, num_splits,
        HAS_SINKS=sinks is not None, BLOCK_SPLITS=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class _Kernels:
    """The jitted kernels (triton.JITFunction: launched as kernel[grid](...))."""

    prefill: Any
    decode_partial: Any
    decode_reduce: Any


@functools.cache
def _kernels() -> _Kernels:  # type: ignore[no-untyped-def]
    # The kernels call the shared rounding and online-softmax helpers; the interpreter resolves
    # names in the module's globals (not closures), so it is bound there.
    global _round, _softmax_tile
    import triton
    import triton.language as tl

    from keepwarm.kernels.triton_common import _round
    from keepwarm.kernels.triton_ops import _softmax_tile

    @triton.jit
    def prefill_kernel(
        q_ptr, k_ptr, v_ptr, sink_ptr, out_ptr,
        T, S, HQ, HKV, D, WINDOW, qk_scale,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr,
    ):  # fmt: skip
        # Grid (cdiv(T, BLOCK_M), HQ). q/out [T, HQ, D], k/v [S, HKV, D] contiguous. Query row i
        # sits at position start + i and sees keys (start + i - WINDOW, start + i] (all without HAS_WINDOW).
        # Online softmax in the exp2 domain (qk_scale holds log2(e)). With sinks the running
        # max starts at the sink's logit and the running sum at 1 (its exp2(0)): the sink is one
        # more key with value zero. Key blocks wholly left of the block's window are skipped.
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // (HQ // HKV)
        start = S - T
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < D
        rmask = rows < T
        q_offs = rows[:, None].to(tl.int64) * (HQ * D) + h * D + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=rmask[:, None] & dmask[None, :], other=0.0)
        if HAS_SINKS:
            # a -inf sink (no sink) must not make the running max -inf: exp2(-inf - -inf) is NaN
            sink = tl.maximum(tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634, -1.0e30)
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        else:
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        q_pos = start + rows
        hi = tl.minimum(S, start + (pid_m + 1) * BLOCK_M)
        lo = 0
        if HAS_WINDOW:
            lo = (tl.maximum(0, start + pid_m * BLOCK_M - WINDOW + 1) // BLOCK_N) * BLOCK_N
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            kv_offs = cols[:, None].to(tl.int64) * (HKV * D) + kvh * D + dims[None, :]
            kv_mask = (cols[:, None] < S) & dmask[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            if NATIVE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            else:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
            s = s * qk_scale
            visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < S)
            if HAS_WINDOW:
                visible = visible & (cols[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, NATIVE_DOT, DOT_PRECISION)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_offs, _round(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :]
        )

    @triton.jit
    def decode_partial_kernel(
        q_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr,
        N, LO, R, HQ, HKV, D, qk_scale, SPLIT_SIZE, NUM_SPLITS,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Grid (HKV, NUM_SPLITS). Key index j in [split * SPLIT_SIZE, min(N, ...)) is absolute
        # position LO + j, stored at ring row (LO + j) % R. q [HQ, D], k/v [R, HKV, D]; fp32 math.
        # Writes unnormalized acc [HQ, NUM_SPLITS, D], max m and sum l [HQ, NUM_SPLITS] (exp2).
        kvh = tl.program_id(0)
        split = tl.program_id(1)
        g = HQ // HKV
        gi = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        gmask = gi < g
        dmask = dims < D
        heads = kvh * g + gi
        q = tl.load(
            q_ptr + heads[:, None] * D + dims[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        lo = split * SPLIT_SIZE
        hi = tl.minimum(N, lo + SPLIT_SIZE)
        for n0 in range(lo, hi, BLOCK_N):
            idx = n0 + tl.arange(0, BLOCK_N)
            cmask = idx < hi
            rows = ((LO + idx) % R).to(tl.int64)
            kv_offs = rows[:, None] * (HKV * D) + kvh * D + dims[None, :]
            kv_mask = cmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            s = tl.where(cmask[None, :], s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, m_i, l_i, acc, v, True, "ieee")  # fp32 V: P unrounded
        stat_offs = heads * NUM_SPLITS + split
        tl.store(m_ptr + stat_offs, m_i, mask=gmask)
        tl.store(l_ptr + stat_offs, l_i, mask=gmask)
        acc_offs = (heads[:, None] * NUM_SPLITS + split) * D + dims[None, :]
        tl.store(acc_ptr + acc_offs, acc, mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def decode_reduce_kernel(
        acc_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, D, NUM_SPLITS,
        HAS_SINKS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Grid (HQ,). out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)),
        # M = max(max_s m_s, sink); without sinks the last term is absent.
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
        )
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        w = tl.exp2(m - m_max)
        denom = tl.sum(l_s * w, axis=0)
        if HAS_SINKS:
            denom += tl.exp2(sink - m_max)
        out = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(out_ptr + h * D + dims, _round(out, out_ptr.dtype.element_ty), mask=dmask)

    return _Kernels(prefill_kernel, decode_partial_kernel, decode_reduce_kernel)


# -- selection -------------------------------------------------------------------
@dataclass(frozen=True)
class SlidingAttentionOps:
    """The attention implementations a sliding family calls: `prefill` for chunks,
    `decode` for one token against a (ring) cache."""

    name: str
    prefill: PrefillFn
    decode: DecodeFn


TORCH_SLIDING = SlidingAttentionOps("torch", torch_prefill, torch_decode)
TRITON_SLIDING = SlidingAttentionOps("triton", triton_prefill, triton_decode)


def sliding_attention_for(device: torch.device, use_triton: bool | None = None) -> SlidingAttentionOps:
    """Triton on a GPU when Triton imports, the torch reference otherwise; `use_triton` forces it."""
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return TORCH_SLIDING
    try:
        import triton  # noqa: F401
    except ImportError:
        return TORCH_SLIDING
    return TRITON_SLIDING
