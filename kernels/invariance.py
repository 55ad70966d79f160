"""The start-up self-check of invariant mode: on the first use of a kernel for a shape
bucket, a few rows computed alone are compared bitwise with the same rows computed inside
batches (and, for attention, a decode step and prefill chunks with the one-shot prefill).
If any differ, invariant mode is refused for the process: one ERROR log line says which op
and shape failed, and every later call (including the failing one) runs the fallback bundle.

Buckets: linear by (dtype, N, K, bias); quant_linear by (block kind, x's dtype, N, K, bias); rms_norm and rms_norm_1p by (dtype, D); silu_mul by
(dtype, I); exp / sigmoid / silu / softplus by (dtype, last dim); conv_silu by (dtype, C, K);
attention by (dtype, Hq, Hkv, D), and the general `attention` (a window over kept rows at an
offset, masked extra keys, sinks) by the same once more; the delta rule by (dtype, Hk, Hv,
Dk, Dv): chunks and single tokens against one call, and a head alone against the same head
folded among others. The row count is what the probe varies: 1..PROBE_ROWS rows, so it
crosses the linear kernel's streaming/tiled switch (16 rows) and the attention key tiles (16)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from keepwarm.kernels.cpu_decode_step import DecodeStep
from keepwarm.kernels.ops import Ops
from keepwarm.kernels.quant_weight import QuantWeight

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


def probe_quant_linear(
    quant_linear: Callable[..., torch.Tensor], w: QuantWeight, b: torch.Tensor | None, dtype: torch.dtype
) -> str | None:
    g = torch.Generator().manual_seed(0)
    x = _rand((PROBE_ROWS, w.in_features), dtype, g, w.device)
    return _rows_differ(lambda r: quant_linear(r, w, b), x, f"quant_linear {w.shape} {w.kind} {dtype}")


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


ARGS_OFFSET = 21  # absolute position of key row 0: key tiles (16) do not start at row 0
ARGS_WINDOW = 19  # crosses a key tile boundary for every query past the first few
ARGS_EXTRA = 24  # masked extra keys: one full tile of 16 and a partial one


def probe_attention_args(
    attention: Callable[..., torch.Tensor | None],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    """`attention` with its newer arguments (sinks; a window over kept rows at an offset;
    masked extra keys): decode steps and prefill chunks, each given only the key rows its
    window keeps (as a sliding ring or DeepSeek V4's window buffer holds them), against one
    call over all PROBE_ROWS queries. None when the bundle has no kernel for these inputs."""
    g = torch.Generator().manual_seed(8)
    s = PROBE_ROWS
    q, k, v = (_rand((s, h, d), dtype, g, device) for h in (hq, hkv, hkv))
    extra_k, extra_v = (_rand((ARGS_EXTRA, hkv, d), dtype, g, device) for _ in range(2))
    extra_mask = (torch.rand((s, ARGS_EXTRA), generator=g) < 0.5).to(device)
    extra_mask[0] = False  # a query that sees no extra key
    extra_mask[ALONE[-1]] = True  # and one that sees them all
    sinks = torch.randn((hq,), generator=g).to(device)  # float32: one logit per head
    variants: tuple[tuple[int, int, bool, bool], ...] = (  # (window, offset, extra keys, sinks)
        (0, 0, False, True),  # full attention with sinks (gpt-oss)
        (ARGS_WINDOW, ARGS_OFFSET, False, False),  # a sliding ring
        (ARGS_WINDOW, ARGS_OFFSET, True, True),  # DeepSeek V4: window, compressed rows, sinks
    )

    def call(
        a: int, b: int, window: int, offset: int, with_extra: bool, with_sinks: bool
    ) -> torch.Tensor | None:
        """Queries a..b-1 against the key rows their window keeps (every row before b without one)."""
        lo = max(0, a - window + 1) if window > 0 else 0
        more: dict[str, torch.Tensor] = {}
        if with_extra:
            more = {"extra_k": extra_k, "extra_v": extra_v, "extra_mask": extra_mask[a:b]}
        if with_sinks:
            more["sinks"] = sinks
        return attention(q[a:b], k[lo:b], v[lo:b], d**-0.5, window=window, offset=offset + lo, **more)

    spans = [(t, t + 1, f"decode at position {t}") for t in ALONE]
    spans += [(a, b, f"a prefill chunk of rows {a}..{b - 1}") for a, b in BATCHES if (a, b) != (0, s)]
    for variant in variants:
        window, offset, with_extra, with_sinks = variant
        what = (
            f"attention(window={window}, offset={offset}, extra keys={ARGS_EXTRA if with_extra else 0}, "
            f"sinks={with_sinks}) Hq={hq} Hkv={hkv} D={d} {dtype}"
        )
        full = call(0, s, *variant)
        if full is None:
            continue
        for a, b, name in spans:
            out = call(a, b, *variant)
            if out is None or not torch.equal(out, full[a:b]):
                got = "no kernel" if out is None else "different bits"
                return f"{what}: {name} gives {got} against the same rows of a {s}-query call"
    return None


def probe_rms_norm_1p(
    rms_norm_1p: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    scale: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> str | None:
    g = torch.Generator().manual_seed(4)
    x = _rand((PROBE_ROWS, scale.shape[0]), dtype, g, scale.device)
    return _rows_differ(lambda r: rms_norm_1p(r, scale, eps), x, f"rms_norm_1p D={scale.shape[0]} {dtype}")


def probe_pointwise(name: str, fn: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor) -> str | None:
    g = torch.Generator().manual_seed(5)
    x = _rand((PROBE_ROWS, like.shape[-1]), like.dtype, g, like.device) * 8
    return _rows_differ(fn, x, f"{name} last dim {like.shape[-1]} {like.dtype}")


def probe_conv_silu(
    conv_silu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: torch.Tensor
) -> str | None:
    """Each output of one long window against the same output from its own K-long window."""
    g = torch.Generator().manual_seed(6)
    c, k = weight.shape[0], weight.shape[-1]
    x = _rand((c, PROBE_ROWS + k - 1), weight.dtype, g, weight.device)
    full = conv_silu(x, weight)  # [C, PROBE_ROWS]
    for t in ALONE:
        if not torch.equal(conv_silu(x[None, :, t : t + k], weight)[0, :, 0], full[:, t]):
            return f"conv_silu C={c} K={k} {weight.dtype}: output {t} differs alone and in a {PROBE_ROWS}-long call"
    return None


def probe_delta_rule(
    ops: Ops, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """A span in one prefill call, in chunks, and token by token through decode; and a sequence
    folded with two others into the head dim of one decode call."""
    g = torch.Generator().manual_seed(7)
    t = 19
    q, k = (_rand((t, hk, dk), dtype, g, device) for _ in range(2))
    v = _rand((t, hv, dv), dtype, g, device)
    gate = -torch.rand((t, hv), generator=g).to(device)
    beta = torch.rand((t, hv), generator=g).to(device=device, dtype=dtype)
    s0 = _rand((hv, dk, dv), torch.float32, g, device)
    what = f"delta rule Hk={hk} Hv={hv} Dk={dk} Dv={dv} {dtype}"
    full, s_full = ops.delta_rule_prefill(q, k, v, gate, beta, s0)
    for step, fn in ((7, ops.delta_rule_prefill), (1, ops.delta_rule_decode)):
        s, outs = s0, []
        for i in range(0, t, step):
            o, s = fn(
                q[i : i + step], k[i : i + step], v[i : i + step], gate[i : i + step], beta[i : i + step], s
            )
            outs.append(o)
        if not (torch.equal(torch.cat(outs), full) and torch.equal(s, s_full)):
            return f"{what}: {step}-token calls differ from one {t}-token call"
    alone, s_alone = ops.delta_rule_decode(q[:1], k[:1], v[:1], gate[:1], beta[:1], s0)
    folded, s_folded = ops.delta_rule_decode(
        q[:3].reshape(1, 3 * hk, dk),
        k[:3].reshape(1, 3 * hk, dk),
        v[:3].reshape(1, 3 * hv, dv),
        gate[:3].reshape(1, 3 * hv),
        beta[:3].reshape(1, 3 * hv),
        torch.cat([s0, s0.flip(0), s0 * 0.5]),
    )
    if not (torch.equal(folded[0, :hv], alone[0]) and torch.equal(s_folded[:hv], s_alone)):
        return f"{what}: a sequence alone differs from the same sequence folded into a 3-sequence decode"
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

    def quant_linear(
        self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        key = ("quant_linear", weight.kind, x.dtype, weight.shape, bias is not None)
        return self._check(
            key, lambda: probe_quant_linear(self.fast.quant_linear, weight, bias, x.dtype)
        ).quant_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        key = ("rms_norm", weight.dtype, weight.shape[0])
        return self._check(key, lambda: probe_rms_norm(self.fast.rms_norm, weight, eps)).rms_norm(
            x, weight, eps
        )

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        key = ("silu_mul", gate.dtype, gate.shape[-1])
        return self._check(key, lambda: probe_silu_mul(self.fast.silu_mul, gate)).silu_mul(gate, up)

    def rms_norm_1p(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        key = ("rms_norm_1p", x.dtype, scale.shape[0])
        return self._check(
            key, lambda: probe_rms_norm_1p(self.fast.rms_norm_1p, scale, eps, x.dtype)
        ).rms_norm_1p(x, scale, eps)

    def _pointwise(self, name: str, x: torch.Tensor) -> torch.Tensor:
        key = (name, x.dtype, x.shape[-1])
        fn = getattr(self._check(key, lambda: probe_pointwise(name, getattr(self.fast, name), x)), name)
        return fn(x)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise("exp", x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise("sigmoid", x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise("silu", x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise("softplus", x)

    def conv_silu(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        key = ("conv_silu", weight.dtype, weight.shape[0], weight.shape[-1])
        return self._check(key, lambda: probe_conv_silu(self.fast.conv_silu, weight)).conv_silu(x, weight)

    def _delta_rule_ops(self, q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> Ops:
        # a decode call folds B sequences into the heads: bucket by one sequence's heads is not
        # knowable here, so the bucket is the head dims and the dtype; the probe folds 3.
        hk, hv = q.shape[1], v.shape[1]
        unit = math.gcd(hk, hv)  # smallest (Hk, Hv) with this grouping
        key = ("delta_rule", q.dtype, hk // unit, hv // unit, q.shape[2], v.shape[2])
        return self._check(
            key,
            lambda: probe_delta_rule(
                self.fast, hk // unit, hv // unit, q.shape[2], v.shape[2], q.dtype, q.device
            ),
        )

    def delta_rule_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._delta_rule_ops(q, v, state).delta_rule_prefill(q, k, v, g, beta, state)

    def delta_rule_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._delta_rule_ops(q, v, state).delta_rule_decode(q, k, v, g, beta, state)

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

    def decode_attention_batch(
        self, q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scale: float
    ) -> torch.Tensor:
        return self._attention_ops(q, ks[0]).decode_attention_batch(q, ks, vs, scale)

    def attention(self, q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        self._attention_ops(q, k)  # the plain causal form first: prefill_attention shares the kernel
        hq, hkv, d = q.shape[-2], k.shape[1], q.shape[-1]
        key = ("attention_args", q.dtype, hq, hkv, d)
        ops = self._check(
            key, lambda: probe_attention_args(self.fast.attention, hq, hkv, d, q.dtype, q.device)
        )
        return ops.attention(q, k, *args, **kwargs)

    def dense_decode_step(self, *args: Any) -> _CheckedStep | None:
        assert self.fast.dense_decode_step is not None
        step = self.fast.dense_decode_step(*args)
        return None if step is None else _CheckedStep(step, self)

    def ops(self) -> Ops:
        """The checked bundle (named after the fast one)."""
        return replace(
            self.fast,
            dense_decode_step=None if self.fast.dense_decode_step is None else self.dense_decode_step,
            attention=self.attention,
            rms_norm=self.rms_norm,
            rotary=self.rotary,
            prefill_attention=self.prefill_attention,
            decode_attention=self.decode_attention,
            decode_attention_batch=self.decode_attention_batch,
            linear=self.linear,
            quant_linear=self.quant_linear,
            silu_mul=self.silu_mul,
            rms_norm_1p=self.rms_norm_1p,
            exp=self.exp,
            sigmoid=self.sigmoid,
            silu=self.silu,
            softplus=self.softplus,
            conv_silu=self.conv_silu,
            delta_rule_prefill=self.delta_rule_prefill,
            delta_rule_decode=self.delta_rule_decode,
        )


class _CheckedStep:
    """A fused decode step (kernels/cpu_decode_step.py) behind the self-check: its first step
    answers None, so the per-operation path runs it and probes every kernel at these shapes (the
    probes' keys do not depend on the row count); later steps run fused while invariant mode
    holds, and answer None for good once it is refused."""

    def __init__(self, step: DecodeStep, check: SelfCheck) -> None:
        self.step, self.check, self.warm = step, check, False

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        if self.check.refused is not None or not self.warm:
            self.warm = True
            return None
        return self.step.run(x, cos, sin, caches, positions)
