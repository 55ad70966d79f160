"""The hot ops a model calls, bundled so that one call site picks the implementation.

Shapes (one sequence, no batch dim):
  rms_norm(x [..., D], weight [D], eps) -> [..., D]
  rotary(x [T, H, Dr], cos [T, Dr], sin [T, Dr]) -> [T, H, Dr]   (rotate-half convention)
  prefill_attention(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [T, Hq, D]
      k, v hold rows 0..S-1 where S = start + T; query t sits at position start + t
      and sees keys 0..start + t (causal, bottom-right aligned).
  decode_attention(q [Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale) -> [Hq, D]
  decode_attention_batch(q [B, Hq, D], ks [S_b, Hkv, D] * B, vs, scale) -> [B, Hq, D]
      the decode steps of B sequences in one call, row b the same bits as
      decode_attention(q[b], ks[b], vs[b], scale) (default: that loop)
  linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]   (torch.nn.functional.linear)
  quant_linear(x [..., K], weight QuantWeight [N, K], bias [N] | None) -> [..., N]: the same
      with the weight kept in its GGUF blocks (kernels/quant_weight.py: CPU kernels/cpu_quant_linear.py,
      GPU kernels/triton_quant_linear.py); `project` calls whichever of the two the weight's type asks for
  silu_mul(gate [..., I], up [..., I]) -> [..., I]   (silu(gate) * up)
  rms_norm_1p(x [..., D], scale [D] float32, eps) -> [..., D]   (Qwen3.5: scale = 1 + weight)
  exp(x), sigmoid(x), silu(x), softplus(x) -> x's shape and dtype
  softmax(x, dim) -> float32 softmax over `dim` (invariant: max, exp, then a sum in index order)
  conv_silu(x [..., C, L], weight [C, 1, K]) -> [..., C, L-K+1]   (silu of a depthwise causal conv)
  topk(x [..., E], k) -> (values, indices) [..., k]   (invariant: ties to the lowest index)
  attention(q, k, v, scale, window=, offset=, extra_k=, extra_v=, extra_mask=, sinks=) -> [T, Hq, D]
      or None: kernels/cpu_attention.attention's contract (sliding window over kept rows,
      masked extra keys, sinks); None where the bundle has no such kernel (use torch)
  delta_rule_prefill / delta_rule_decode: the gated delta rule (kernels/delta_rule.py's contract)
      for a chunk of many tokens / one token
  decode_attention_table(q [B, Hq, D], k_table [B], v_table [B], positions [B], scale, num_kv_heads)
      -> [B, Hq, D] and write_rows(rows [B, ...], table [B], positions [B]): decode over caches
      named by address (int64 data_ptr tables) with positions read on the device, so a CUDA
      graph can capture a decode step; None where the bundle has none (kernels/triton_invariant.py)
  dense_decode_step(shape, layers, rotary_dim) -> a DecodeStep or None: a dense model's decode
      step through all its layers in one native call, the per-op path's bits
      (kernels/cpu_decode_step.py); the field None where the bundle has none
Hq is a multiple of Hkv (GQA/MQA).

Invariant mode (the CPU default): every op's result for a row (a token, a query) is the
same bits whatever else is in the call — batch composition, prefill chunk length, decode vs
prefill — so a prefix restored from the cache computes exactly like the uncached prefill.
The CPU bundle "cpu_invariant" uses the kernels of cpu_linear, cpu_rowwise, cpu_attention
and cpu_delta_rule (one token-serial recurrence for prefill and decode) behind the start-up
self-check (kernels/invariance.py), built for AVX-512 BF16 or, on x86 CPUs without it, for
AVX2 + FMA (kernels/csrc/avx512_compat.h); on CPUs with neither, the references (torch).
On a GPU the bundle "triton_invariant" (kernels/triton_invariant.py) keeps the same
property: fixed tiles whatever the row count, no split reductions, one attention kernel
for prefill and decode, the token-serial delta rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from keepwarm.kernels import reference
from keepwarm.kernels.delta_rule import DeltaRuleFn, chunk_gated_delta_rule, recurrent_gated_delta_rule
from keepwarm.kernels.quant_weight import QuantRows, QuantWeight, Weight

if TYPE_CHECKING:
    from keepwarm.kernels.cpu_decode_step import DecodeStep

DecodeBatchFn = Callable[[torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor], float], torch.Tensor]


def decode_each(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    scale: float,
    decode_attention: Callable[..., torch.Tensor] = reference.decode_attention,
) -> torch.Tensor:
    """decode_attention_batch as one decode_attention call per sequence (the default)."""
    return torch.stack([decode_attention(qb, k, v, scale) for qb, k, v in zip(q, ks, vs, strict=True)])


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    prefill_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    decode_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    linear: Callable[..., torch.Tensor] = F.linear
    quant_linear: Callable[..., torch.Tensor] = reference.quant_linear
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = reference.silu_mul
    rms_norm_1p: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = reference.rms_norm_1p
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp
    softmax: Callable[[torch.Tensor, int], torch.Tensor] = reference.softmax
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid
    silu: Callable[[torch.Tensor], torch.Tensor] = F.silu
    softplus: Callable[[torch.Tensor], torch.Tensor] = F.softplus
    conv_silu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = reference.conv_silu
    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = reference.topk
    delta_rule_prefill: DeltaRuleFn = chunk_gated_delta_rule
    delta_rule_decode: DeltaRuleFn = recurrent_gated_delta_rule
    attention: Callable[..., torch.Tensor | None] = reference.no_kernel
    decode_attention_batch: DecodeBatchFn = decode_each
    decode_attention_table: Callable[..., torch.Tensor] | None = None
    write_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    dense_decode_step: Callable[..., DecodeStep | None] | None = None

    def project(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias) for a dense weight or one kept in its blocks (a QuantRows: each
        part by its own kernel, the results side by side)."""
        if isinstance(weight, QuantWeight):
            return self.quant_linear(x, weight, bias)
        if isinstance(weight, QuantRows):
            sizes = [p.shape[0] for p in weight.parts]
            biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
            return torch.cat(
                [self.quant_linear(x, p, b) for p, b in zip(weight.parts, biases, strict=True)], dim=-1
            )
        return self.linear(x, weight, bias)

    def __post_init__(self) -> None:
        # Without a batched kernel: a loop over this bundle's own decode_attention (rebound
        # after replace(), so the loop always calls the bundle's current decode_attention).
        batch = self.decode_attention_batch
        if batch is decode_each or isinstance(batch, functools.partial) and batch.func is decode_each:
            bound = functools.partial(decode_each, decode_attention=self.decode_attention)
            object.__setattr__(self, "decode_attention_batch", bound)


TORCH_OPS = Ops(
    name="torch",
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    prefill_attention=reference.prefill_attention,
    decode_attention=reference.decode_attention,
)


def _decode_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The pre-invariance CPU path: the kernel for bf16 calls of <= 16 rows (decode), torch's
    GEMM above (whose per-row bits change with the row count)."""
    from keepwarm.kernels import cpu_linear

    if x.dtype == torch.bfloat16 and x.numel() <= cpu_linear.STREAM_ROWS * x.shape[-1]:
        return cpu_linear.linear(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.cache
def cpu_ops(invariant: bool = True) -> Ops:
    """The CPU bundle. invariant: the invariant kernels behind the self-check (one SelfCheck
    per process, so a refusal holds for every backend); else the references plus the
    decode GEMV. The kernels are cpu_linear's build for this CPU: AVX-512 BF16 where it has
    it, else the AVX2 build (avx2 + fma + f16c: the same kernels with the AVX-512 intrinsics
    emulated, equally invariant). Without either (or with a failed build) both are the
    references."""
    from keepwarm.kernels import (
        cpu_attention,
        cpu_decode_step,
        cpu_delta_rule,
        cpu_linear,
        cpu_quant_linear,
        cpu_rowwise,
    )

    if not cpu_linear.available():  # builds the extension once, here, not on the first call
        return TORCH_OPS
    # the block product is row-invariant where its kernel loaded, else the reference
    plain = replace(
        TORCH_OPS, name="torch+cpu_linear", linear=_decode_rows_linear, quant_linear=cpu_quant_linear.linear
    )
    kernels = (cpu_attention, cpu_rowwise, cpu_delta_rule)
    if not invariant or not all(k.available() for k in kernels):
        return plain
    from keepwarm.kernels.invariance import SelfCheck

    fast = Ops(
        name="cpu_invariant",
        rms_norm=cpu_rowwise.rms_norm,
        rotary=cpu_rowwise.rotary,  # elementwise: invariant as it is, the reference's bits
        prefill_attention=cpu_attention.prefill_attention,
        decode_attention=cpu_attention.decode_attention,
        decode_attention_batch=cpu_attention.decode_attention_batch,
        linear=cpu_linear.linear,
        quant_linear=cpu_quant_linear.linear,
        silu_mul=cpu_rowwise.silu_mul,
        rms_norm_1p=cpu_rowwise.rms_norm_1p,
        exp=cpu_rowwise.exp,
        softmax=cpu_rowwise.softmax,
        sigmoid=cpu_rowwise.sigmoid,
        silu=cpu_rowwise.silu,
        softplus=cpu_rowwise.softplus,
        conv_silu=cpu_rowwise.conv_silu,
        topk=reference.stable_topk,
        delta_rule_prefill=cpu_delta_rule.gated_delta_rule,  # token-serial: chunk == decode
        delta_rule_decode=cpu_delta_rule.gated_delta_rule,
        attention=cpu_attention.attention,
        dense_decode_step=cpu_decode_step.plan if cpu_decode_step.available() else None,
    )
    return SelfCheck(fast, plain).ops()


@functools.cache
def kernel_sources_digest() -> str:
    """16 hex over the kernels' sources (kernels/*.py, kernels/csrc/*): the arithmetic a bundle's
    ops run, so that a snapshot never outlives the code that computed it (an upgrade that
    changes a kernel's bits starts a new snapshot namespace)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *(root / "csrc").glob("*")]):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def kernels_id(ops: Ops) -> str:
    """What a snapshot's bits depend on in the ops: the bundle (e.g. `cpu_invariant`, or the
    non-invariant `torch+cpu_linear`), for a bundle of CPU kernels the build this CPU runs (the
    AVX2 build's bf16 products need not have the AVX-512 build's bits: engines on two kinds of
    CPU sharing one cache folder keep apart), and the kernels' sources' digest."""
    name = ops.name
    if "cpu" in name:
        from keepwarm.kernels import cpu_linear

        name += f"[{cpu_linear.kernel_isa(cpu_linear.cpu_flags())}]"
    return f"{name}:{kernel_sources_digest()}"


def ops_for(device: torch.device, use_triton: bool | None = None, invariant: bool = True) -> Ops:
    """The ops to run on `device`: on a GPU, when Triton imports, the invariant Triton bundle
    "triton_invariant" (kernels/triton_invariant.py) or, with invariant=False, the faster
    "triton" one (torch GEMMs, split-KV decode, chunked delta rule); on a CPU
    `cpu_ops(invariant)`. `use_triton` forces the choice."""
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return cpu_ops(invariant) if device.type == "cpu" else TORCH_OPS
    try:
        if invariant:
            from keepwarm.kernels import triton_invariant

            return triton_invariant.TRITON_INVARIANT_OPS
        from keepwarm.kernels import triton_ops
    except ImportError:
        return TORCH_OPS
    return triton_ops.TRITON_OPS
