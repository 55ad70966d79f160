"""A dense model's decode step through all its layers in one native call
(kernels/csrc/cpu_decode_step.cpp).

At a few hundred hidden units a decode step's arithmetic takes microseconds per operation, and
the per-operation cost of the framework (a Python call, a dispatch, a tensor allocation: ~10 us
each, a dozen a layer) was as large as the weight reading itself. `plan(shape, layers)` binds a
model's layers once; `DecodeStep.run` then runs a step of B sequences (one new token each) from
their embeddings to the last layer's output. The arithmetic is the CPU kernels' own compiled
code (cpu_linear, cpu_quant_linear, cpu_rowwise, cpu_attention), reached through their raw
entry points (kernels/csrc/raw_kernels.h), so every value has the bits of the per-operation
path (models/dense.py), which is its reference and its test.

Where it applies: bf16 activations on the CPU; each projection bf16 or in blocks of any kind
(kernels/quant_weight.py), biases bf16 or none; the rotary table as wide as a head; a head shape the attention
kernel takes; every extension built. `plan` answers None otherwise (the per-operation path runs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from keepwarm.kernels import cpu_attention, cpu_extension, cpu_linear, cpu_quant_linear, cpu_rowwise
from keepwarm.kernels.quant_weight import KINDS, QuantRows, QuantWeight, Weight

SOURCE = cpu_extension.CSRC / "cpu_decode_step.cpp"
EXTENSION_NAME = "keepwarm_cpu_decode_step"


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME)


@dataclass(frozen=True)
class DenseShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # attention's, head_dim ** -0.5


class DecodeStep(Protocol):
    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        """x [B, hidden] bf16 (the new tokens' embeddings), cos / sin [B, head_dim] (their
        positions' rotary rows), caches: per sequence its layers' K and V buffer addresses
        (`DenseBackend.state_addresses`), positions [B]: writes the K/V rows, returns the last
        layer's output [B, hidden]; None: not now (the caller runs the per-operation step)."""


@functools.cache
def _api() -> dict[str, int] | None:
    """The raw entry points of every extension the step calls, or None when one is missing."""
    exts = (
        cpu_rowwise.extension(),
        cpu_attention.extension(),
        cpu_quant_linear.extension(),
        cpu_linear.default().ext,
    )
    if any(e is None for e in exts):
        return None
    rowwise, attention, quant, linear = exts
    api = {**rowwise.raw_api(), **attention.raw_api()}
    api["quant_linear"] = quant.raw_api()["linear"]
    api["linear"] = linear.raw_api()["linear"]
    return api


def _bf16(t: torch.Tensor | None, *shape: int) -> bool:
    return t is None or (
        t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == shape
    )


def _parts(
    api: dict[str, int], w: Weight | None, n: int, k: int
) -> list[tuple[int, torch.Tensor, int, int]] | None:
    """A [n, k] weight's parts for the step: (the product's address, the tensor it reads, its
    rows, its variant) each, or None where the step has no product for it."""
    if isinstance(w, QuantRows):
        parts = [_parts(api, p, p.shape[0], k) for p in w.parts]
        if any(p is None for p in parts) or w.shape != (n, k):
            return None
        return [one for p in parts if p is not None for one in p]
    if isinstance(w, QuantWeight):
        if w.shape != (n, k) or w.device.type != "cpu" or not w.blocks.is_contiguous():
            return None
        return [(api["quant_linear"], w.blocks, n, KINDS.index(w.kind))]
    if w is None or not _bf16(w, n, k):
        return None
    return [(api["linear"], w, n, int(cpu_linear.default().prefill_form == "fma"))]


def plan(shape: DenseShape, layers: Sequence[Any], rotary_dim: int) -> DecodeStep | None:
    """The layers (models/dense.py `_Layer`s: norms, fused projections, their biases) bound into
    one native step, or None where it does not apply (module docstring)."""
    ext, api = extension(), _api()
    if ext is None or api is None or rotary_dim != shape.head_dim or shape.heads % shape.kv_heads:
        return None
    s = shape
    probe_kv = torch.empty(1, s.kv_heads, s.head_dim, dtype=torch.bfloat16)
    probe_q = torch.empty(1, s.heads, s.head_dim, dtype=torch.bfloat16)
    if not cpu_attention.extension().eligible(probe_q, probe_kv, probe_kv):  # type: ignore[union-attr]
        return None
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    step = ext.DecodeStep(api, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps, s.scale)
    for layer in layers:
        norms_ok = _bf16(layer.input_norm, s.hidden) and _bf16(layer.post_norm, s.hidden)
        qk_ok = (layer.q_norm is None) == (layer.k_norm is None) and all(
            _bf16(t, s.head_dim) for t in (layer.q_norm, layer.k_norm)
        )
        if not (norms_ok and qk_ok):
            return None
        step.add_layer(layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm)
        projs = (
            (layer.w_qkv, layer.b_qkv, qd + 2 * kvd, s.hidden),
            (layer.w_o, layer.b_o, s.hidden, qd),
            (layer.w_gate_up, layer.b_gate_up, 2 * s.intermediate, s.hidden),
            (layer.w_down, layer.b_down, s.hidden, s.intermediate),
        )
        for slot, (w, b, n, k) in enumerate(projs):
            parts = _parts(api, w, n, k)
            if parts is None or not _bf16(b, n):
                return None
            biases = b.split([rows for _, _, rows, _ in parts]) if b is not None else [None] * len(parts)
            for (fn, tensor, rows, variant), part_bias in zip(parts, biases, strict=True):
                step.add_part(slot, fn, tensor, rows, k, variant, part_bias)
    return step  # type: ignore[no-any-return]


def available() -> bool:
    return extension() is not None and _api() is not None
