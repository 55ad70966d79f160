"""Pure-torch reference implementations of the hot ops (see ops.py for shapes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from keepwarm.kernels.quant_weight import QuantWeight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' Llama/Qwen RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, cast to
    # x's dtype, then times weight. torch's fused kernel computes in float32 for 16-bit x.
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) with the weight's exact values, in float32, cast to x's dtype."""
    w = weight.dequantize(torch.float32).to(x.device)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_norm_1p(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: float32 normalize, times `scale` = 1 + weight (float32),
    then cast back (transformers: `(x_norm * (1 + w)).type_as(x)`)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale).to(x.dtype)


def conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., C, L], weight [C, 1, K] -> [..., C, L - K + 1]: silu(depthwise causal conv1d)."""
    lead = x.shape[:-2]
    y = F.conv1d(x.reshape(-1, *x.shape[-2:]), weight, groups=weight.shape[0])
    return F.silu(y).reshape(*lead, *y.shape[-2:])


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.softmax over `dim` in float32."""
    return torch.softmax(x, dim=dim, dtype=torch.float32)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim (which of equal values it returns is unspecified)."""
    return torch.topk(x, k, dim=-1)


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest over the last dim ranked by (value descending, index ascending): of equal
    values the lowest index wins, whatever else the call holds (a stable sort per row)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def no_kernel(*args: object, **kwargs: object) -> None:
    """An op the bundle has no kernel for: None, so the caller runs its own torch path."""
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(1)  # [T, 1, Dr]
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    start = s - t
    # [1, H, T|S, D]: SDPA takes its fused CPU/GPU kernels only for 4-D inputs
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(start, s, device=q.device).unsqueeze(1)
        pos_k = torch.arange(s, device=q.device).unsqueeze(0)
        mask = pos_k <= pos_q  # [T, S] bottom-right causal
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # In fp32 (a 16-bit cache is converted: on CPU that beats 16-bit batched matmuls here).
    hq, hkv = q.shape[0], k.shape[1]
    qg = q.reshape(hkv, hq // hkv, -1).float()  # [Hkv, G, D]
    scores = torch.einsum("hgd,shd->hgs", qg, k.float()) * scale
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgs,shd->hgd", probs, v.float())
    return out.reshape(hq, -1).to(q.dtype)
