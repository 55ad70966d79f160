"""The softmax top-k mixture of experts shared by qwen3_5 (Qwen3.5-MoE: with a gated shared
expert) and the dense family's qwen3_moe (Qwen3-MoE: without one), the gated MLP (also
laguna's dense layers and shared expert), and the loading of experts in both checkpoint
layouts (laguna's too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from keepwarm.kernels.ops import Ops


@dataclass(frozen=True)
class Mlp:
    w_gate_up: torch.Tensor  # [2 I, hidden]
    w_down: torch.Tensor  # [hidden, I]


@dataclass(frozen=True)
class Moe:
    """Top-k softmax router (weights renormalized over the k when `normalize`), experts, and
    optionally a shared expert scaled by sigmoid(shared_gate . h)."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    top_k: int
    normalize: bool = True  # Qwen3-MoE's norm_topk_prob; Qwen3.5-MoE always renormalizes
    shared: Mlp | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]


def mlp(w: Mlp, h: torch.Tensor, ops: Ops) -> torch.Tensor:
    gate, up = ops.linear(h, w.w_gate_up).chunk(2, dim=-1)
    return ops.linear(ops.silu_mul(gate, up), w.w_down)


def moe(w: Moe, h: torch.Tensor, ops: Ops) -> torch.Tensor:
    """h [T, hidden] -> [T, hidden], as transformers' Qwen3_5MoeSparseMoeBlock and
    Qwen3MoeSparseMoeBlock. Per token: ties in the router go to the lowest expert id
    (ops.topk), the k weights are summed in rank order, and experts add into the output in
    increasing id order. The routing weights are float32 until cast to the runtime dtype."""
    linear = ops.linear
    router_logits = linear(h, w.router)  # [T, E]
    probs = ops.softmax(router_logits.float(), -1)  # row-local, one summation order (GPU too)
    top_w, top_i = ops.topk(probs, w.top_k)  # [T, k]
    if w.normalize:
        total = top_w[:, 0]
        for j in range(1, w.top_k):  # elementwise adds: the same bits whatever T
            total = total + top_w[:, j]
        top_w = top_w / total[:, None]
    top_w = top_w.to(router_logits.dtype)
    out = torch.zeros_like(h)
    for e in top_i.unique().tolist():  # only the experts some token routed to
        tok, slot = torch.where(top_i == e)
        gate, up = linear(h[tok], w.gate_up[e]).chunk(2, dim=-1)
        y = linear(ops.silu_mul(gate, up), w.down[e]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    if w.shared is not None:
        assert w.shared_gate is not None
        out = out + ops.sigmoid(linear(h, w.shared_gate)) * mlp(w.shared, h, ops)
    return out


def load_experts(
    has: Callable[[str], bool],
    w: Callable[[str, tuple[int, ...]], torch.Tensor],
    mp: str,
    num_experts: int,
    inter: int,
    hidden: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts under `mp` (`...mlp.`) as gate_up [E, 2 I, hidden] and down [E, hidden, I],
    from the fused 3-D layout (`experts.gate_up_proj` / `experts.down_proj`, transformers'
    runtime form) or the per-expert one (`experts.{e}.gate_proj.weight` ..., the hub's form).
    `has` tells whether a name (as passed to `w`) is in the checkpoint."""
    if has(mp + "experts.gate_up_proj"):
        gate_up = w(mp + "experts.gate_up_proj", (num_experts, 2 * inter, hidden))
        down = w(mp + "experts.down_proj", (num_experts, hidden, inter))
        return gate_up, down
    ex = [f"{mp}experts.{e}." for e in range(num_experts)]
    gate_up = torch.stack(
        [
            torch.cat([w(x + "gate_proj.weight", (inter, hidden)), w(x + "up_proj.weight", (inter, hidden))])
            for x in ex
        ]
    )
    down = torch.stack([w(x + "down_proj.weight", (hidden, inter)) for x in ex])
    return gate_up, down
