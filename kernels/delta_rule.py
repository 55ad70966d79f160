"""The gated delta rule (Gated DeltaNet linear attention, as in Qwen3.5), one sequence.

Per value head h and step t, with the state S [Dk, Dv] (float32):
    S <- S * exp(g_t)                                  (gated decay, g_t <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T             (delta-rule write)
    o_t = S^T q_t
where q_t, k_t are L2-normalized (eps 1e-6) and q_t is scaled by Dk^-0.5, exactly as
transformers' Qwen3.5 (`use_qk_l2norm_in_kernel=True`). Key head j // (Hv // Hk)
serves value head j (grouped value attention, repeat_interleave order).

Shapes (no batch dim):
  q, k   [T, Hk, Dk]   any float dtype
  v      [T, Hv, Dv]
  g      [T, Hv]       float32, log decay
  beta   [T, Hv]
  state  [Hv, Dk, Dv]  float32, the state before the first token (never written)
returns (out [T, Hv, Dv] in q's dtype, new_state [Hv, Dk, Dv] float32 — a new tensor).

Four implementations with one signature: `chunk_gated_delta_rule` (pure torch, the
WY/UT-transform chunked form used for prefill), `recurrent_gated_delta_rule` (pure torch,
token by token, used for decode and as the oracle), `triton_gated_delta_rule` (a fused
recurrent Triton kernel: one program per (value head, Dv block), the state in registers),
and `triton_chunk_gated_delta_rule` (the chunked form as one Triton kernel, same grid; the
Triton bundle's prefill).
`delta_rule_for(device)` picks the bundle at one call site.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DeltaRuleFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32, heads first: q, k [Hv, T, Dk] (normalized, q scaled), v [Hv, T, Dv], g, beta [Hv, T]."""
    t, hk, dk = k.shape
    hv = v.shape[1]
    assert q.shape == k.shape and v.shape[0] == t, (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    )
    assert hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}"
    assert g.shape == (t, hv) and beta.shape == (t, hv), f"g {tuple(g.shape)}, beta {tuple(beta.shape)}"
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    qf, kf, vf, bf, gf = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    qf = l2norm(qf)
    kf = l2norm(kf)
    qf = qf * (dk**-0.5)
    return qf, kf, vf, gf, bf


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference (transformers' torch_recurrent_gated_delta_rule)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    s = state.to(torch.float32)  # [Hv, Dk, Dv]
    out = torch.empty_like(vf)  # [Hv, T, Dv]
    for i in range(vf.shape[1]):
        s = s * gf[:, i].exp()[:, None, None]
        kv_mem = (s * kf[:, i, :, None]).sum(dim=-2)  # [Hv, Dv]
        delta = (vf[:, i] - kv_mem) * bf[:, i, None]
        s = s + kf[:, i, :, None] * delta[:, None, :]
        out[:, i] = (s * qf[:, i, :, None]).sum(dim=-2)
    return out.transpose(0, 1).to(q.dtype).contiguous(), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form (transformers' torch_chunk_gated_delta_rule, batch dim dropped):
    within a chunk the delta-rule updates are condensed by a unit-lower-triangular solve,
    across chunks the state is carried sequentially. The sequence is zero-padded to a
    multiple of `chunk_size` (padding has g = 0, beta = 0, so it leaves the state alone)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    hv, t, dk = kf.shape
    dv = vf.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size
    qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
    bf, gf = (F.pad(x, (0, pad)) for x in (bf, gf))
    n = (t + pad) // chunk_size
    v_beta = vf * bf[..., None]
    k_beta = kf * bf[..., None]
    # [Hv, N, C, D]
    qc, kc, kbc, vbc = (x.reshape(hv, n, chunk_size, x.shape[-1]) for x in (qf, kf, k_beta, v_beta))
    cum = gf.reshape(hv, n, chunk_size).cumsum(dim=-1)  # [Hv, N, C] log decay from chunk start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=qf.device).triu(1)
    # pairwise[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (kbc @ kc.transpose(-1, -2)) * pairwise  # [Hv, N, C, C], unit lower after solve
    intra = (qc @ kc.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, vbc, upper=False, unitriangular=True)  # [Hv, N, C, Dv]
    k_cumdecay = torch.linalg.solve_triangular(
        ut, kbc * cum.exp()[..., None], upper=False, unitriangular=True
    )  # [Hv, N, C, Dk]
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    s = state.to(torch.float32)
    out = torch.empty(hv, n, chunk_size, dv, dtype=torch.float32, device=qf.device)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s  # [Hv, C, Dv]
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(hv, n * chunk_size, dv)[:, :t]
    return out.transpose(0, 1).to(q.dtype).contiguous(), s


# -- Triton -------------------------------------------------------------------
def triton_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused recurrent Triton kernel; same contract as `recurrent_gated_delta_rule`: the
    invariant bundle's token-serial kernel (kernels/triton_invariant.py, normalization in the
    kernel), one program per (value head, Dv block), the state in registers."""
    from keepwarm.kernels import triton_invariant

    return triton_invariant.gated_delta_rule(q, k, v, g, beta, state)


def triton_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Triton kernel; same contract as `chunk_gated_delta_rule` (the prefill path).
    One program per (value head, Dv block) walks the chunks in order with its state columns
    in registers; within a chunk it does the WY/UT form of the torch reference, the
    unit-lower-triangular inverse built by forward substitution over the C rows.
    Normalization (L2, q scale) happens here in torch, in float32, as in the reference."""
    import triton

    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size {chunk_size}: use a power of two >= 16 (tl.dot's smallest tile)")
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)  # heads first, float32, contiguous
    hv, t, dk = kf.shape
    dv = vf.shape[-1]
    s = state.to(torch.float32).contiguous().clone()  # updated in place by the kernel
    out = torch.empty_like(vf)
    block_k = max(triton.next_power_of_2(dk), 16)
    block_v = max(min(triton.next_power_of_2(dv), 64), 16)
    grid = (hv, triton.cdiv(dv, block_v))
    _chunk_kernel()[grid](
        qf, kf, vf, gf, bf, s, out, t, dk, dv, CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v
    )
    return out.transpose(0, 1).to(q.dtype).contiguous(), s


@functools.cache
def _chunk_kernel():  # type: ignore[no-untyped-def]
    """The jitted chunked kernel, defined on first use (see `_kernel`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_gated_delta_rule_fwd(
        q_ptr,  # [Hv, T, Dk] float32, normalized and scaled
        k_ptr,  # [Hv, T, Dk] float32, normalized
        v_ptr,  # [Hv, T, Dv] float32
        g_ptr,  # [Hv, T] float32
        beta_ptr,  # [Hv, T] float32
        s_ptr,  # [Hv, Dk, Dv], in: initial state, out: final state
        o_ptr,  # [Hv, T, Dv] float32
        T,
        DK,
        DV,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # All dots are "ieee": the operands are fp32 (tf32 would cost ~1e-3 relative), and the
        # interpreter's dot needs fp32 operands anyway.
        h = tl.program_id(0)
        vb = tl.program_id(1)
        offs_c = tl.arange(0, CHUNK)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        s_ptrs = s_ptr + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(s_ptrs, mask=mask_k[:, None] & mask_v[None, :], other=0.0)  # [BK, BV]
        lower = offs_c[:, None] >= offs_c[None, :]  # [C, C], diagonal included
        strict = offs_c[:, None] > offs_c[None, :]
        eye = (offs_c[:, None] == offs_c[None, :]).to(tl.float32)
        for c0 in range(0, T, CHUNK):
            rows = c0 + offs_c
            mask_c = rows < T
            # The ragged tail loads as zeros: g = 0 keeps the decay, beta = 0 and k = 0 keep
            # the state, exactly like the reference's zero padding; its outputs are not stored.
            q = tl.load(
                q_ptr + (h * T + rows)[:, None] * DK + offs_k[None, :],
                mask=mask_c[:, None] & mask_k[None, :],
                other=0.0,
            )  # [C, BK]
            k = tl.load(
                k_ptr + (h * T + rows)[:, None] * DK + offs_k[None, :],
                mask=mask_c[:, None] & mask_k[None, :],
                other=0.0,
            )  # [C, BK]
            v = tl.load(
                v_ptr + (h * T + rows)[:, None] * DV + offs_v[None, :],
                mask=mask_c[:, None] & mask_v[None, :],
                other=0.0,
            )  # [C, BV]
            g = tl.load(g_ptr + h * T + rows, mask=mask_c, other=0.0)  # [C]
            b = tl.load(beta_ptr + h * T + rows, mask=mask_c, other=0.0)  # [C]
            cum = tl.cumsum(g, axis=0)  # [C] log decay from the chunk start, <= 0
            cum_last = tl.sum(g, axis=0)  # the tail adds 0, so this is cum at the last real row
            # pairwise[i, j] = exp(cum_i - cum_j) for j <= i, else exp(-inf) = 0 (no overflow)
            pairwise = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))  # [C, C]
            kk = tl.dot(k, tl.trans(k), input_precision="ieee")  # [C, C]
            a = tl.where(strict, kk * b[:, None] * pairwise, 0.0)  # strict lower part of UT
            # x = (I + a)^-1 by forward substitution: row i = e_i - sum_{j<i} a_ij x_j. Rows
            # below i still hold e_j, but a_ij = 0 there, so the full-row sum is exact.
            x = eye
            for i in range(1, CHUNK):
                a_i = tl.sum(tl.where(offs_c[:, None] == i, a, 0.0), axis=0)  # [C], row i of a
                x_i = tl.where(offs_c == i, 1.0, 0.0) - tl.sum(a_i[:, None] * x, axis=0)
                x = tl.where(offs_c[:, None] == i, x_i[None, :], x)
            u = tl.dot(x, v * b[:, None], input_precision="ieee")  # [C, BV]
            w = tl.dot(x, k * (b * tl.exp(cum))[:, None], input_precision="ieee")  # [C, BK]
            v_new = u - tl.dot(w, s, input_precision="ieee")  # [C, BV]
            intra = tl.dot(q, tl.trans(k), input_precision="ieee") * pairwise  # [C, C]
            o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee")
            o += tl.dot(intra, v_new, input_precision="ieee")  # [C, BV]
            tl.store(
                o_ptr + (h * T + rows)[:, None] * DV + offs_v[None, :],
                o,
                mask=mask_c[:, None] & mask_v[None, :],
            )
            k_dec = k * tl.exp(cum_last - cum)[:, None]  # [C, BK]
            s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_dec), v_new, input_precision="ieee")
        tl.store(s_ptrs, s, mask=mask_k[:, None] & mask_v[None, :])

    return chunk_gated_delta_rule_fwd


@dataclass(frozen=True)
class DeltaRuleOps:
    """The delta-rule implementations a model calls: `prefill` for chunks of many tokens,
    `decode` for one token."""

    name: str
    prefill: DeltaRuleFn
    decode: DeltaRuleFn


TORCH_DELTA_RULE = DeltaRuleOps("torch", chunk_gated_delta_rule, recurrent_gated_delta_rule)
TRITON_DELTA_RULE = DeltaRuleOps("triton", triton_chunk_gated_delta_rule, triton_gated_delta_rule)


def delta_rule_for(device: torch.device, use_triton: bool | None = None) -> DeltaRuleOps:
    """Triton on a GPU when Triton imports, the torch reference otherwise; `use_triton` forces it."""
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return TORCH_DELTA_RULE
    try:
        import triton  # noqa: F401
    except ImportError:
        return TORCH_DELTA_RULE
    return TRITON_DELTA_RULE
