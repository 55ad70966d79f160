"""Causal attention on CPU with one reduction order per query row
(kernels/csrc/cpu_attention.cpp): keys in fixed tiles of 16 from absolute position 0, one
online-softmax order, fp32 arithmetic. A row's result depends only on its query and the keys
and values it sees, so a prefill chunk of any length, a restore tail and a decode step give
the same bits for the same row (torch's SDPA and einsum paths change their blocking with
the shapes).

Shapes as kernels/ops.py: prefill_attention(q [T, Hq, D], k, v [S, Hkv, D], scale) with
query t at position S - T + t; decode_attention(q [Hq, D], k, v, scale);
decode_attention_batch(q [B, Hq, D], ks, vs, scale) for the decode steps of B sequences, each
against its own keys ks[b], vs[b] [S_b, Hkv, D], in one call (row b the same bits as
decode_attention(q[b], ks[b], vs[b], scale)). `window` > 0
limits a query at position p to keys p - window + 1 .. p. `offset` is the absolute position
of key row 0 (a sliding window's kept rows), so key tiles stay at absolute positions.
`extra_k`, `extra_v` [C, Hkv, D] with `extra_mask` [T, C] bool are keys each query sees where
its mask is set (DeepSeek V4's compressed rows), reduced after the window's tiles; `sinks`
[Hq] float32 adds one logit per head to the softmax denominator, last. `attention_reference`
is the same function in torch (fp32, not invariant). Falls back to the torch references
(not invariant) when the kernel is absent or the inputs do not fit it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch

from keepwarm.kernels import cpu_extension, reference

SOURCE = cpu_extension.CSRC / "cpu_attention.cpp"
EXTENSION_NAME = "keepwarm_cpu_attention"


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME)


def available() -> bool:
    return extension() is not None


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
) -> torch.Tensor | None:
    """q [T, Hq, D] against k, v [S, Hkv, D] -> [T, Hq, D], or None when the kernel cannot run."""
    ext = extension()
    xs = [t for t in (q, k, v, extra_k, extra_v, sinks) if t is not None]
    if ext is None or torch.is_grad_enabled() and any(t.requires_grad for t in xs):
        return None
    return ext.try_attention(q, k, v, scale, window, offset, extra_k, extra_v, extra_mask, sinks)


def attention_reference(
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
    """`attention` in torch, fp32 arithmetic, result in q's dtype (not invariant)."""
    t, hq, _ = q.shape
    s, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    q_pos = torch.arange(offset + s - t, offset + s)[:, None]
    k_pos = torch.arange(offset, offset + s)[None, :]
    allowed = k_pos <= q_pos
    if window > 0:
        allowed &= k_pos > q_pos - window
    keys, values = k.float(), v.float()
    if extra_k is not None and extra_v is not None and extra_mask is not None:
        keys, values = torch.cat([keys, extra_k.float()]), torch.cat([values, extra_v.float()])
        allowed = torch.cat([allowed, extra_mask.to(torch.bool)], dim=-1)
    keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)  # [S', Hq, D]
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, t, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[0]]
    return torch.einsum("hts,shd->thd", probs, values).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = attention(q, k, v, scale)
    return out if out is not None else reference.prefill_attention(q, k, v, scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = attention(q.unsqueeze(0), k, v, scale)
    return out[0] if out is not None else reference.decode_attention(q, k, v, scale)


def decode_attention_batch(
    q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """The decode steps of B sequences: q [B, Hq, D] against ks[b], vs[b] [S_b, Hkv, D] ->
    [B, Hq, D], one parallel region over (sequence, kv head) instead of B calls."""
    ext = extension()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *ks, *vs))
    out = None if ext is None or grad else ext.try_decode_batch(q, list(ks), list(vs), scale)
    if out is not None:
        return out
    return torch.stack([decode_attention(qb, k, v, scale) for qb, k, v in zip(q, ks, vs, strict=True)])
