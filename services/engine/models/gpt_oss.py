"""gpt-oss family (`model_type` gpt_oss), matching transformers' GptOssForCausalLM: sliding
and full attention layers (`layer_types`, `sliding_window`, by default alternating) with a
learned per-head attention sink, q/k/v/o biases, YaRN RoPE, and a MoE MLP in every layer:
a top-k router with bias (softmax over the k chosen logits) and experts with a clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`, `(up + 1) * gate * sigmoid(alpha * gate)`), with biases.

State and snapshots: models/sliding.py (full layers every row, sliding layers min(p, W) rows).
Every config.json field is implemented, known to be inert at inference, or refused by name;
quantized (MXFP4) checkpoints are refused: dequantize to bf16 first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.config_fields import refuse_unknown_fields
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope, rope_parameters
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

# Fields with no effect on inference outputs (training, generation defaults, metadata;
# `initial_context_length` is the original OpenAI name of the YaRN original length).
_INERT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits",
    "router_aux_loss_coef", "attention_dropout", "_name_or_path", "auto_map", "tokenizer_class",
    "initial_context_length",
}  # fmt: skip
_IMPLEMENTED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
    "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "sliding_window",
    "layer_types", "attention_bias", "num_local_experts", "num_experts", "num_experts_per_tok",
    "experts_per_token", "swiglu_alpha", "swiglu_limit",
}  # fmt: skip
# transformers' GptOssConfig default rope (when config.json has none)
DEFAULT_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
}  # fmt: skip


@dataclass(frozen=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> GptOssConfig:
        refuse_unknown_fields(
            {k: v for k, v in cfg.items() if k != "quantization_config"}, _INERT | _IMPLEMENTED, "gpt_oss"
        )
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise CheckpointError(
                f"config.json: quantization_config ({method}) is not supported: use a bf16 checkpoint "
                "(dequantized experts under mlp.experts.gate_up_proj / down_proj)"
            )
        try:
            n = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e
        window = cfg.get("sliding_window", 128)
        default_types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        layer_types = check_layer_types(cfg.get("layer_types") or default_types, n, window)
        kv = cfg.get("num_key_value_heads", 8)
        kv = heads if kv is None else int(kv)
        experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 128)))
        top_k = int(cfg.get("num_experts_per_tok", 4))
        if "experts_per_token" in cfg and int(cfg["experts_per_token"]) != top_k:
            raise CheckpointError(
                f"config.json: experts_per_token {cfg['experts_per_token']} disagrees with num_experts_per_tok {top_k}"
            )
        if (
            "num_experts" in cfg
            and "num_local_experts" in cfg
            and cfg["num_experts"] != cfg["num_local_experts"]
        ):
            raise CheckpointError("config.json: num_experts disagrees with num_local_experts")
        if heads % kv:
            raise CheckpointError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if not 0 < top_k <= experts:
            raise CheckpointError("config.json: num_experts_per_tok must be in 1..num_local_experts")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported "
                "(gpt-oss experts use their clamped SwiGLU; transformers' config says 'silu')"
            )
        head_dim = cfg.get("head_dim", 64)
        return GptOssConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 2880)),
            layer_types=layer_types,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=hidden // heads if head_dim is None else int(head_dim),
            sliding_window=int(window) if SLIDING in layer_types else int(window or 1),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", True)),
            num_experts=experts,
            num_experts_per_tok=top_k,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden] float32 (transformers keeps norms in float32)
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    b_qkv: torch.Tensor | None
    sinks: torch.Tensor  # [Hq] float32
    w_o: torch.Tensor  # [hidden, Hq D]
    b_o: torch.Tensor | None
    post_norm: torch.Tensor
    router: torch.Tensor  # [E, hidden]
    router_bias: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [E, 2 I, hidden]: gate rows then up rows (de-interleaved at load)
    gate_up_bias: torch.Tensor  # [E, 2 I]
    down: torch.Tensor  # [E, hidden, I]
    down_bias: torch.Tensor  # [E, hidden]


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: Ops) -> torch.Tensor:
    """GptOssRMSNorm: (weight * normalized) in float32, then cast back (not Llama's order).
    The sum of squares goes through ops.linear against a ones row: one reduction order per
    row in the invariant bundle, whatever the row count."""
    xf = x.float()
    ones = torch.ones((1, xf.shape[-1]), dtype=torch.float32, device=xf.device)
    xf = xf * torch.rsqrt(ops.linear(xf.square(), ones) / xf.shape[-1] + eps)
    return (weight * xf).to(x.dtype)


class GptOssBackend(SlidingKvBackend[_Layer]):
    family = "gpt_oss"

    def __init__(
        self,
        cfg: GptOssConfig,
        rope: Rope,
        ends: Ends,
        layers: list[_Layer],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        super().__init__(cfg, dict.fromkeys((FULL, SLIDING), rope), ends, layers, placement, dtype, ops)
        self.cfg = cfg
        self.scale = cfg.head_dim**-0.5

    def _hidden(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor:
        c, ops = self.cfg, self.ops
        x = F.embedding(tokens, self.embed)  # [N, hidden]
        n, d = x.shape[0], c.head_dim
        cos_sin = self._cos_sin(batch)
        q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
        for i, layer in enumerate(self.layers):
            x, cos_sin = self._to_stage(i, x, cos_sin)
            cos, sin = cos_sin[c.layer_types[i]]
            h = rms_norm_f32(x, layer.input_norm, c.rms_norm_eps, ops)
            q, k, v = ops.linear(h, layer.w_qkv, layer.b_qkv).split([q_size, kv_size, kv_size], dim=-1)
            q = ops.rotary(q.reshape(n, c.num_heads, d), cos, sin)
            k = ops.rotary(k.reshape(n, c.num_kv_heads, d), cos, sin)
            v = v.reshape(n, c.num_kv_heads, d).contiguous()
            out = batch.attend(i, q, k, v, self.scale, layer.sinks)  # [N, Hq, D]
            x = x + ops.linear(out.reshape(n, q_size), layer.w_o, layer.b_o)
            x = x + self._moe(layer, rms_norm_f32(x, layer.post_norm, c.rms_norm_eps, ops))
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm_f32(h, self.final_norm, self.cfg.rms_norm_eps, self.ops)
        return self.ops.linear(h, self.lm_head).float()

    def _moe(self, w: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] (every token of every sequence) -> [N, hidden], as GptOssMLP. Router
        and experts through ops.linear, router ties to the lowest expert (ops.topk), each token's
        experts added in ascending order: a token's bits do not depend on its neighbours."""
        c, ops = self.cfg, self.ops
        logits = ops.linear(h, w.router, w.router_bias)  # [N, E]
        top_v, top_i = ops.topk(logits, c.num_experts_per_tok)
        top_w = ops.softmax(top_v, 1).to(top_v.dtype)
        out = torch.zeros_like(h)
        lim = c.swiglu_limit
        for e in top_i.unique().tolist():  # only the experts some token routed to, ascending
            tok, slot = torch.where(top_i == e)
            gate, up = ops.linear(h[tok], w.gate_up[e], w.gate_up_bias[e]).chunk(2, dim=-1)
            gate = gate.clamp(max=lim)
            up = up.clamp(min=-lim, max=lim)
            act = (up + 1) * (gate * ops.sigmoid(gate * c.swiglu_alpha))
            y = ops.linear(act, w.down[e], w.down_bias[e]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def build(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> GptOssBackend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm and the head on the last."""
    cfg = GptOssConfig.from_dict(ckpt.config)
    placement = Placement.of(where, cfg.num_layers)
    w = Loader(ckpt, placement, dtype)
    hid, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    e_n, inter = cfg.num_experts, cfg.intermediate_size

    if any(n.endswith(("_blocks", "_scales")) for n in ckpt.name_to_file):
        raise CheckpointError(
            f"{ckpt.path}: MXFP4 expert weights (*_blocks, *_scales) are not supported; use bf16"
        )
    layers: list[_Layer] = []
    for i in range(cfg.num_layers):
        w.at_layer(i)
        p = f"model.layers.{i}."
        sa, mp = p + "self_attn.", p + "mlp."
        b_qkv = b_o = None
        if cfg.attention_bias:
            b_qkv = w.qkv(sa, q_size, kv_size)
            b_o = w(sa + "o_proj.bias", (hid,))
        # experts as stored: gate_up [E, hidden, 2I] with gate and up interleaved in the last
        # dim (even: gate, odd: up), down [E, I, hidden]; kept as F.linear weights
        gu = w(mp + "experts.gate_up_proj", (e_n, hid, 2 * inter))
        gu_b = w(mp + "experts.gate_up_proj_bias", (e_n, 2 * inter))
        gate_up = torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        del gu
        layers.append(
            _Layer(
                input_norm=w(p + "input_layernorm.weight", (hid,), torch.float32),
                w_qkv=w.qkv(sa, q_size, kv_size, hid),
                b_qkv=b_qkv,
                sinks=w(sa + "sinks", (cfg.num_heads,)).float(),  # runtime dtype, then float32
                w_o=w(sa + "o_proj.weight", (hid, q_size)),
                b_o=b_o,
                post_norm=w(p + "post_attention_layernorm.weight", (hid,), torch.float32),
                router=w(mp + "router.weight", (e_n, hid)),
                router_bias=w(mp + "router.bias", (e_n,)),
                gate_up=gate_up,
                gate_up_bias=torch.cat([gu_b[:, 0::2], gu_b[:, 1::2]], dim=-1).contiguous(),
                down=w(mp + "experts.down_proj", (e_n, inter, hid)).transpose(1, 2).contiguous(),
                down_bias=w(mp + "experts.down_proj_bias", (e_n, hid)),
            )
        )
    embed, lm_head = w.ends(w, "model.embed_tokens.weight", cfg.vocab_size, hid, cfg.tie_word_embeddings)
    raw = dict(ckpt.config)
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        raw["rope_parameters"] = dict(DEFAULT_ROPE)
    if float(rope_parameters(raw).get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(
            "config.json: rope partial_rotary_factor must be 1.0 for gpt_oss (every dim rotates)"
        )
    rope = build_rope(raw, d, placement.first)
    final_norm = w("model.norm.weight", (hid,), torch.float32)  # on the last stage, float32
    ends = Ends(embed, final_norm, lm_head)
    return GptOssBackend(cfg, rope, ends, layers, placement, dtype, ops)
