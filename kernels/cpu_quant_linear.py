"""`linear(x, weight: QuantWeight, bias)`: the product with a weight kept in its GGUF blocks
(kernels/csrc/cpu_quant_linear.cpp), row-invariant like cpu_linear: a row's result is the same
bits whatever the number of rows, so a prefix restored from the cache computes exactly like
the uncached prefill on a quantized model too.

The weights are used exactly; the activations are quantized per block of 32 to int16 (15 bits
of a block's largest value, against bf16's 8 bits of each value: under the input's own
rounding), so each block's dot product is an exact integer (vpmaddwd), scaled by the block's d
times the activations' step (k-quants: the block's d * sc; Q6_K per half block), plus the
block's m times the activations' exact sum (Q4_0, Q4_1, Q4_K, Q5_K). The
result is the dense product with the exact weights to within about 1e-4 of the row's scale
(reference.quant_linear is that product in torch; the C++ file has the exact formula).

kernel when: the extension loaded (x86 with AVX2, FMA and F16C: every CPU either cpu_linear
build runs on; built at install like the others, kernels/build.py), x is a bf16 or fp32 CPU
tensor, the blocks are on the CPU, bias is None or of x's dtype, and no autograd graph is being
recorded. Otherwise the reference (dense weights made on every call: correct, slow)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from keepwarm.kernels import cpu_extension, reference
from keepwarm.kernels.quant_weight import KINDS, QuantWeight

SOURCE = cpu_extension.CSRC / "cpu_quant_linear.cpp"
EXTENSION_NAME = "keepwarm_cpu_quant_linear"
# One instruction set on every x86 build: the same bits on AVX-512 and AVX2 CPUs.
EXTRA_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_KIND_ID = {k: i for i, k in enumerate(KINDS)}  # the C++ enum's order


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME, extra_flags=EXTRA_FLAGS)


def available() -> bool:
    return extension() is not None


def _recording(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records through x or bias (the kernel has no backward)."""
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def uses_kernel(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` runs the kernel (its C++ entry decides: `try_quant_linear`)."""
    return (
        extension() is not None
        and not _recording(x, bias)
        and x.device.type == weight.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
    )


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias -> [..., N] in x's dtype."""
    ext = extension()
    if ext is not None and not _recording(x, bias):
        y = ext.try_quant_linear(x, weight.blocks, _KIND_ID[weight.kind], weight.in_features, bias)
        if y is not None:
            return y  # type: ignore[no-any-return]
    return reference.quant_linear(x, weight, bias)
