"""Laguna family (`model_type` laguna), matching transformers' LagunaForCausalLM: sliding-window
and full attention layers (`layer_types`, `sliding_window`) with per-layer query head counts
(`num_attention_heads_per_layer`), q/k RMSNorm, partial RoPE per layer type, a softplus output
gate per head or per element (`gating`), and dense or sparse MLPs (`mlp_layer_types`): a
sigmoid top-k router with a selection bias (`e_score_correction_bias`), optional tanh
softcapping, renormalized weights, `moe_routed_scaling_factor`, and a shared expert.

State and snapshots: models/sliding.py (full layers every row, sliding layers min(p, W) rows).
Every config.json field is implemented, known to be inert at inference, or refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.config_fields import refuse_unknown_fields, require_silu
from keepwarm.engine.models.moe import Mlp as _Mlp
from keepwarm.engine.models.moe import load_experts
from keepwarm.engine.models.moe import mlp as _mlp
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope
from keepwarm.engine.models.sliding import (
    FULL,
    SLIDING,
    Batch,
    Ends,
    SlidingKvBackend,
    check_layer_types,
)
from keepwarm.engine.models.weights import Loader
from keepwarm.kernels.ops import Ops

DENSE, SPARSE = "dense", "sparse"

# Fields with no effect on inference outputs (training, generation defaults, metadata).
_INERT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits",
    "router_aux_loss_coef", "attention_dropout", "_name_or_path", "auto_map", "tokenizer_class",
}  # fmt: skip
_IMPLEMENTED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "sliding_window", "layer_types", "head_dim", "attention_bias", "gating",
    "num_attention_heads_per_layer", "mlp_layer_types", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "moe_routed_scaling_factor",
    "moe_apply_router_weight_on_input", "moe_router_logit_softcapping",
    "max_position_embeddings",  # read by the rope types that need it (yarn, llama3)
}  # fmt: skip
# transformers' LagunaConfig defaults, used where config.json omits a field
DEFAULT_ROPE = {
    FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


@dataclass(frozen=True)
class LagunaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    heads_per_layer: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    gate_per_head: bool
    rope_parameters: dict[str, dict[str, Any]]  # per layer type
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    routed_scaling: float
    router_softcap: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> LagunaConfig:
        refuse_unknown_fields(cfg, _INERT | _IMPLEMENTED, "laguna")
        try:
            n = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e
        window = cfg.get("sliding_window", 512)
        layer_types = check_layer_types(cfg.get("layer_types") or [FULL] * n, n, window)
        mlp_types = tuple(cfg.get("mlp_layer_types") or [DENSE] + [SPARSE] * (n - 1))
        if len(mlp_types) != n or any(t not in (DENSE, SPARSE) for t in mlp_types):
            raise CheckpointError(
                f"config.json: mlp_layer_types must list {n} entries of {DENSE!r} or {SPARSE!r}, got {list(mlp_types)}"
            )
        per_layer = tuple(int(h) for h in (cfg.get("num_attention_heads_per_layer") or [heads] * n))
        kv_heads = int(cfg.get("num_key_value_heads") or 8)
        if len(per_layer) != n or any(h < 1 or h % kv_heads for h in per_layer):
            raise CheckpointError(
                f"config.json: num_attention_heads_per_layer must list {n} multiples of "
                f"num_key_value_heads ({kv_heads}), got {list(per_layer)}"
            )
        gating = cfg.get("gating", True)
        if gating not in (True, "per-head", "per-element"):
            raise CheckpointError(
                f"config.json: gating {gating!r} is not supported (use true, 'per-head' or 'per-element')"
            )
        if cfg.get("moe_apply_router_weight_on_input", False):
            raise CheckpointError(
                "config.json: moe_apply_router_weight_on_input true is not supported "
                "(transformers has no reference for it either); set it to false"
            )
        require_silu(cfg)
        rope = cfg.get("rope_parameters") or DEFAULT_ROPE
        if not isinstance(rope, dict) or any(not isinstance(rope.get(t), dict) for t in set(layer_types)):
            raise CheckpointError(
                "config.json: rope_parameters must map each layer type "
                f"({sorted(set(layer_types))}) to its rope settings"
            )
        out = LagunaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 8192)),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            heads_per_layer=per_layer,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or 128),
            sliding_window=int(window) if SLIDING in layer_types else int(window or 1),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            gate_per_head=gating in (True, "per-head"),
            rope_parameters={t: dict(rope[t]) for t in set(layer_types)},
            num_experts=int(cfg.get("num_experts", 256)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
            routed_scaling=float(cfg.get("moe_routed_scaling_factor", 1.0)),
            router_softcap=float(cfg.get("moe_router_logit_softcapping", 0.0)),
        )
        if SPARSE in mlp_types and not 0 < out.num_experts_per_tok <= out.num_experts:
            raise CheckpointError("config.json: num_experts_per_tok must be in 1..num_experts")
        return out


@dataclass(frozen=True)
class _Attention:
    num_heads: int
    w_qkvg: torch.Tensor  # [Hq D + 2 Hkv D + G, hidden]: q | k | v | gate (G = Hq or Hq D) fused
    b_qkvg: torch.Tensor | None  # attention_bias: q, k, v biases, zeros for the gate
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    w_o: torch.Tensor  # [hidden, Hq D]
    b_o: torch.Tensor | None


@dataclass(frozen=True)
class _Moe:
    router: torch.Tensor  # [E, hidden]
    select_bias: torch.Tensor  # [E] float32: added to the scores for selection only
    gate_up: torch.Tensor  # [E, 2 I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    shared: _Mlp


@dataclass(frozen=True)
class _Layer:
    kind: str
    input_norm: torch.Tensor
    attn: _Attention
    post_norm: torch.Tensor
    mlp: _Mlp | _Moe


class LagunaBackend(SlidingKvBackend[_Layer]):
    family = "laguna"

    def __init__(
        self,
        cfg: LagunaConfig,
        ropes: dict[str, Rope],
        ends: Ends,
        layers: list[_Layer],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        super().__init__(cfg, ropes, ends, layers, placement, dtype, ops)
        self.cfg = cfg
        self.scale = cfg.head_dim**-0.5

    def _hidden(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor:
        c, ops = self.cfg, self.ops
        x = F.embedding(tokens, self.embed)  # [N, hidden]
        n, d, hkv = x.shape[0], c.head_dim, c.num_kv_heads
        cos_sin = self._cos_sin(batch)
        for i, layer in enumerate(self.layers):
            x, cos_sin = self._to_stage(i, x, cos_sin)
            a = layer.attn
            h = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
            gate_dim = a.num_heads if c.gate_per_head else a.num_heads * d
            q, k, v, g = ops.linear(h, a.w_qkvg, a.b_qkvg).split(
                [a.num_heads * d, hkv * d, hkv * d, gate_dim], dim=-1
            )
            q = ops.rms_norm(q.reshape(n, a.num_heads, d), a.q_norm, c.rms_norm_eps)
            k = ops.rms_norm(k.reshape(n, hkv, d), a.k_norm, c.rms_norm_eps)
            cos, sin = cos_sin[layer.kind]
            r = cos.shape[-1]  # partial RoPE: the first r dims of each head rotate
            q = torch.cat([ops.rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
            k = torch.cat([ops.rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
            out = batch.attend(i, q, k, v.reshape(n, hkv, d).contiguous(), self.scale)  # [N, Hq, D]
            gate = ops.softplus(g.float()).to(out.dtype)  # row-local (torch's tail path differs)
            if c.gate_per_head:
                out = out * gate.unsqueeze(-1)
            else:
                out = out.reshape(n, a.num_heads * d) * gate
            x = x + ops.linear(out.reshape(n, a.num_heads * d), a.w_o, a.b_o)
            h = ops.rms_norm(x, layer.post_norm, c.rms_norm_eps)
            x = x + (_mlp(layer.mlp, h, self.ops) if isinstance(layer.mlp, _Mlp) else self._moe(layer.mlp, h))
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(
            self.ops.rms_norm(h, self.final_norm, self.cfg.rms_norm_eps), self.lm_head
        ).float()

    def route(self, w: _Moe, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, hidden] -> (expert ids [N, k], weights [N, k] in h's dtype), as
        LagunaSparseMoeBlock's router. Each token's bits do not depend on its neighbours:
        ops.linear / ops.sigmoid / ops.topk are invariant (ties to the lowest id); the softcap
        is elementwise (division, tanh, product: torch's tanh runs one vectorised function over
        every element, partial vectors included, so a value's bits do not depend on its offset
        or the tensor's length); the k weights are summed by elementwise adds in rank order."""
        c, ops = self.cfg, self.ops
        logits = ops.linear(h, w.router).float()  # [N, E]
        if c.router_softcap > 0.0:
            logits = torch.tanh(logits / c.router_softcap) * c.router_softcap
        scores = ops.sigmoid(logits)
        _, top_i = ops.topk(scores + w.select_bias, c.num_experts_per_tok)  # [N, k]
        top_w = scores.gather(-1, top_i)
        total = top_w[:, 0]
        for j in range(1, top_w.shape[1]):  # a fixed order whatever N (a torch sum may block by shape)
            total = total + top_w[:, j]
        return top_i, (top_w / total[:, None]).to(h.dtype)

    def _moe(self, w: _Moe, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] (every token of every sequence) -> [N, hidden], as LagunaSparseMoeBlock."""
        c, ops = self.cfg, self.ops
        top_i, top_w = self.route(w, h)
        routed = torch.zeros_like(h)
        for e in top_i.unique().tolist():  # only the experts some token routed to, ascending
            tok, slot = torch.where(top_i == e)
            gate, up = ops.linear(h[tok], w.gate_up[e]).chunk(2, dim=-1)
            y = ops.linear(ops.silu_mul(gate, up), w.down[e]) * top_w[tok, slot, None]
            routed.index_add_(0, tok, y.to(routed.dtype))
        return routed * c.routed_scaling + _mlp(w.shared, h, self.ops)


def build(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> LagunaBackend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm and the head on the last."""
    cfg = LagunaConfig.from_dict(ckpt.config)
    placement = Placement.of(where, cfg.num_layers)
    hid, d, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    w = Loader(ckpt, placement, dtype)

    def first(names: list[str]) -> str:
        for n in names:
            if w.has(n):
                return n
        return names[0]  # missing: the load names it

    layers: list[_Layer] = []
    for i, kind in enumerate(cfg.layer_types):
        w.at_layer(i)
        p = f"model.layers.{i}."
        sa = p + "self_attn."
        hq = cfg.heads_per_layer[i]
        gate_dim = hq if cfg.gate_per_head else hq * d
        w_qkvg = torch.cat([w.qkv(sa, hq * d, hkv * d, hid), w(sa + "g_proj.weight", (gate_dim, hid))])
        b_qkvg = b_o = None
        if cfg.attention_bias:
            b_qkvg = torch.cat(
                [w.qkv(sa, hq * d, hkv * d), torch.zeros(gate_dim, dtype=dtype, device=w.device)]
            )
            b_o = w(sa + "o_proj.bias", (hid,))
        attn = _Attention(
            num_heads=hq,
            w_qkvg=w_qkvg,
            b_qkvg=b_qkvg,
            q_norm=w(sa + "q_norm.weight", (d,)),
            k_norm=w(sa + "k_norm.weight", (d,)),
            w_o=w(sa + "o_proj.weight", (hid, hq * d)),
            b_o=b_o,
        )
        mp = p + "mlp."
        mlp: _Mlp | _Moe
        if cfg.mlp_layer_types[i] == DENSE:
            mlp = _Mlp(*w.gate_up_down(mp, hid, cfg.intermediate_size))
        else:
            e_n, e_i = cfg.num_experts, cfg.moe_intermediate_size
            gate_up, down = load_experts(w.has, w, mp, e_n, e_i, hid)
            # save_pretrained's names first, then the module names transformers runs with
            bias = first([mp + "experts.e_score_correction_bias", mp + "gate.e_score_correction_bias"])
            shared = first([mp + "shared_expert.gate_proj.weight", mp + "shared_experts.gate_proj.weight"])
            mlp = _Moe(
                router=w(mp + "gate.weight", (e_n, hid)),
                select_bias=w(bias, (e_n,)).float(),  # runtime dtype, then float32 (as transformers)
                gate_up=gate_up,
                down=down,
                shared=_Mlp(
                    *w.gate_up_down(
                        shared.removesuffix("gate_proj.weight"), hid, cfg.shared_expert_intermediate_size
                    )
                ),
            )
        layers.append(
            _Layer(
                kind=kind,
                input_norm=w(p + "input_layernorm.weight", (hid,)),
                attn=attn,
                post_norm=w(p + "post_attention_layernorm.weight", (hid,)),
                mlp=mlp,
            )
        )
    embed, lm_head = w.ends(w, "model.embed_tokens.weight", cfg.vocab_size, hid, cfg.tie_word_embeddings)
    ropes = {}
    for kind, params in cfg.rope_parameters.items():
        ropes[kind] = build_rope({**ckpt.config, "rope_parameters": params}, d, placement.first)
        if ropes[kind].rotary_dim > d:
            raise CheckpointError(
                f"config.json: {kind} rotary dim {ropes[kind].rotary_dim} exceeds head_dim {d}"
            )
    ends = Ends(embed, w("model.norm.weight", (hid,)), lm_head)  # the final norm on the last stage
    return LagunaBackend(cfg, ropes, ends, layers, placement, dtype, ops)
