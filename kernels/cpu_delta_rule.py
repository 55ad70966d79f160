"""The gated delta rule on CPU as a token-serial recurrence with one fixed order per value
head (kernels/csrc/cpu_delta_rule.cpp): a span gives the same bits processed in one call, in
chunks of any length or token by token, and a head's bits do not depend on what else shares
the call (qwen3_5 folds a step's decoding sequences into the head dim of one call). The
chunked WY form (delta_rule.chunk_gated_delta_rule) and the torch recurrence differ from each
other, and from themselves across chunkings, in the last bits.

Same contract as kernels/delta_rule.py: q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] fp32,
beta [T, Hv], state [Hv, Dk, Dv] fp32 -> (out [T, Hv, Dv] in q's dtype, new state fp32).
Falls back to the torch recurrence (not invariant) when the kernel is absent or the inputs
do not fit it (not CPU, not bf16/fp32)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from keepwarm.kernels import cpu_extension
from keepwarm.kernels.delta_rule import recurrent_gated_delta_rule

SOURCE = cpu_extension.CSRC / "cpu_delta_rule.cpp"
EXTENSION_NAME = "keepwarm_cpu_delta_rule"


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME)


def available() -> bool:
    return extension() is not None


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    ext = extension()
    if ext is not None and not (
        torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state))
    ):
        res = ext.try_gated_delta_rule(q, k, v, g, beta, state)
        if res is not None:
            return res
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)
