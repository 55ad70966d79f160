"""The start-up self-check of invariant mode: on the first use of a kernel for a shape
bucket, a few rows computed alone are compared bitwise with the same rows computed inside
batches (and, for attention, a decode step and prefill chunks with the one-shot prefill).
If any differ, invariant mode is refused for the process: one ERROR log line says which op
and shape failed, and every later call (including the failing one) runs the fallback bundle.

Buckets: linear by (dtype, N, K, bias); rms_norm by (dtype, D); silu_mul by (dtype, I);
attention by (dtype, Hq, Hkv, D). The row count is what the probe varies: 1..PROBE_ROWS
rows, so it crosses the linear kernel's streaming/tiled switch (16 rows) and the attention
key tiles (16)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from keepwarm.kernels.ops import Ops

log = logging.getLogger(__name__)

PROBE_ROWS = 40
ALONE = (0, 1, 15, 16, 17, 39)  # rows compared alone vs in every batch that holds them
BATCHES = ((0, 2), (0, 17), (0, 40), (1, 37), (15, 33))  # [start, end) row ranges


def _rand(
    shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: torch.device
) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _rows_differ(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, what: str) -> str | None:
    """fn maps rows [M, ...] -> [M, ...]; each ALONE row must be the same bits in every batch."""
    alone = {i: fn(x[i : i + 1])[0] for i in ALONE}
    for a, b in BATCHES:
        out = fn(x[a:b])
        for i, row in alone.items():
            if a <= i < b and not torch.equal(out[i - a], row):
                return f"{what}: row {i} alone differs from the same row in a batch of {b - a} rows"
    return None


def probe_linear(linear: Callable[..., torch.Tensor], w: torch.Tensor, b: torch.Tensor | None) -> str | None:
    g = torch.Generator().manual_seed(0)
    x = _rand((PROBE_ROWS, w.shape[1]), w.dtype, g, w.device)
    return _rows_differ(lambda r: linear(r, w, b), x, f"linear {tuple(w.shape)} {w.dtype}")


def probe_rms_norm(
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], w: torch.Tensor, eps: float
) -> str | None:
    g = torch.Generator().manual_seed(1)
    x = _rand((PROBE_ROWS, w.shape[0]), w.dtype, g, w.device)
    return _rows_differ(lambda r: rms_norm(r, w, eps), x, f"rms_norm D={w.shape[0]} {w.dtype}")


def probe_silu_mul(
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], like: torch.Tensor
) -> str | None:
    g = torch.Generator().manual_seed(2)
    n = like.shape[-1]
    x = _rand((PROBE_ROWS, 2 * n), like.dtype, g, like.device)
    return _rows_differ(lambda r: silu_mul(*r.chunk(2, dim=-1)), x, f"silu_mul I={n} {like.dtype}")


def probe_attention(
    ops: Ops, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Decode steps and prefill chunks against the one-shot prefill of PROBE_ROWS tokens."""
    g = torch.Generator().manual_seed(3)
    s = PROBE_ROWS
    q, k, v = (_rand((s, h, d), dtype, g, device) for h in (hq, hkv, hkv))
    scale = d**-0.5
    what = f"attention Hq={hq} Hkv={hkv} D={d} {dtype}"
    full = ops.prefill_attention(q, k, v, scale)
    for t in ALONE:
        if not torch.equal(ops.decode_attention(q[t], k[: t + 1], v[: t + 1], scale), full[t]):
            return f"{what}: decode at position {t} differs from the same row of a {s}-token prefill"
    for a, b in BATCHES:
        if b - a < 2:
            continue
        if not torch.equal(ops.prefill_attention(q[a:b], k[:b], v[:b], scale), full[a:b]):
            return f"{what}: a prefill chunk of rows {a}..{b - 1} differs from the one-shot prefill"
    return None


class SelfCheck:
    """Wraps an invariant Ops bundle: probes each bucket once, and after a failed probe runs
    `fallback` for good. `refused` holds the failure (None while invariant mode holds)."""

    def __init__(self, fast: Ops, fallback: Ops) -> None:
        self.fast = fast
        self.fallback = fallback
        self.refused: str | None = None
        self.checked: set[tuple[object, ...]] = set()
        self.lock = threading.Lock()

    def _check(self, key: tuple[object, ...], probe: Callable[[], str | None]) -> Ops:
        if self.refused is None and key not in self.checked:
            with self.lock:
                if self.refused is None and key not in self.checked:
                    with torch.inference_mode():
                        failure = probe()
                    self.checked.add(key)
                    if failure is not None:
                        self.refused = failure
                        log.error(
                            "invariant mode refused: %s (the %s kernels are not batch-invariant on this "
                            "platform); running %s instead, whose results can change with batch "
                            "composition and prefill chunking",
                            failure,
                            self.fast.name,
                            self.fallback.name,
                        )
        return self.fallback if self.refused is not None else self.fast

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        key = ("linear", weight.dtype, tuple(weight.shape), bias is not None)
        return self._check(key, lambda: probe_linear(self.fast.linear, weight, bias)).linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        key = ("rms_norm", weight.dtype, weight.shape[0])
        return self._check(key, lambda: probe_rms_norm(self.fast.rms_norm, weight, eps)).rms_norm(
            x, weight, eps
        )

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        key = ("silu_mul", gate.dtype, gate.shape[-1])
        return self._check(key, lambda: probe_silu_mul(self.fast.silu_mul, gate)).silu_mul(gate, up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # elementwise products and sums: each element one IEEE operation whatever the shape
        return (self.fallback if self.refused is not None else self.fast).rotary(x, cos, sin)

    def _attention_ops(self, q: torch.Tensor, k: torch.Tensor) -> Ops:
        hq, hkv, d = q.shape[-2], k.shape[1], q.shape[-1]
        key = ("attention", q.dtype, hq, hkv, d)
        return self._check(key, lambda: probe_attention(self.fast, hq, hkv, d, q.dtype, q.device))

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self._attention_ops(q, k).prefill_attention(q, k, v, scale)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self._attention_ops(q, k).decode_attention(q, k, v, scale)

    def ops(self) -> Ops:
        """The checked bundle (named after the fast one)."""
        return replace(
            self.fast,
            rms_norm=self.rms_norm,
            rotary=self.rotary,
            prefill_attention=self.prefill_attention,
            decode_attention=self.decode_attention,
            linear=self.linear,
            silu_mul=self.silu_mul,
        )
