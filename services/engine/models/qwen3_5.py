"""Hybrid recurrent family `qwen3_5` (Qwen3.5 text: Gated DeltaNet linear-attention layers
interleaved with gated full-attention layers), matching transformers' Qwen3_5ForCausalLM
and, with a sparse MoE MLP, Qwen3_5MoeForCausalLM.

Loads `qwen3_5_text` / `qwen3_5_moe_text` checkpoints (ForCausalLM: `model.layers.*`) and
`qwen3_5` / `qwen3_5_moe` ones (ForConditionalGeneration: config under `text_config`,
weights under `model.language_model.*`; the vision tower and `mtp.*` weights are ignored).

State, by canonical name (docs/architecture.md, 'The backend contract'):
  linear layer i:    `layers.{i}.conv`      [conv_dim, K-1]   runtime dtype: the last K-1
                                            pre-conv q|k|v inputs (zeros before the start)
                     `layers.{i}.recurrent` [Hv, Dk, Dv]      float32 delta-rule state
  attention layer i: `layers.{i}.k` / `.v`  [capacity, Hkv, D] rows 0..position-1 valid
  `sidecar.logits`   [vocab] float32
Invariant: fixed-size state tensors are replaced by new tensors at every step, never
written in place, and K/V rows below `position` are never rewritten; so an exported
snapshot (views, no copy) stays valid while the live state moves on. (After a batched
step the decoded sequences' conv and recurrent tensors are views of one tensor per layer,
which nothing writes either.)

A step (`step`, and `prefill` / `decode` as a step of one sequence) runs every matrix
product over all its tokens at once; each sequence's conv window, delta-rule state and
K/V rows are its own, and all one-token sequences share one conv and one delta-rule call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.backend import State
from keepwarm.engine.models.config_fields import refuse_quantized, require_silu
from keepwarm.engine.models.geometry import Geometry, SnapshotMismatch, TensorSpec, all_rows
from keepwarm.engine.models.moe import Mlp as _Mlp
from keepwarm.engine.models.moe import Moe as _Moe
from keepwarm.engine.models.moe import load_experts
from keepwarm.engine.models.moe import mlp as _mlp
from keepwarm.engine.models.moe import moe as _moe
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope
from keepwarm.engine.models.step import BatchedForward, Step
from keepwarm.engine.models.weights import Loader
from keepwarm.kernels.delta_rule import DeltaRuleOps
from keepwarm.kernels.ops import Ops

LINEAR = "linear_attention"
FULL = "full_attention"
Linear = Callable[..., torch.Tensor]  # F.linear or a drop-in for it (Ops.linear)


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    conv_kernel: int  # K
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    num_experts: int  # 0: dense MLP; else sparse MoE with a gated shared expert
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> Qwen35Config:
        """`cfg` is the text config (config.json itself, or its `text_config`)."""
        try:
            n = int(cfg["num_hidden_layers"])
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                interval = int(cfg.get("full_attention_interval", 4))
                layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
            layer_types = tuple(str(t) for t in layer_types)
            num_heads = int(cfg["num_attention_heads"])
            out = Qwen35Config(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                # a MoE config has no dense MLP and may omit intermediate_size
                intermediate_size=int(
                    cfg.get("intermediate_size") or 0 if cfg.get("num_experts") else cfg["intermediate_size"]
                ),
                layer_types=layer_types,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
                num_experts=int(cfg.get("num_experts") or 0),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e
        if len(out.layer_types) != n:
            raise CheckpointError(
                f"config.json: layer_types has {len(out.layer_types)} entries, num_hidden_layers is {n}"
            )
        bad = sorted({t for t in out.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise CheckpointError(f"config.json: layer_types {bad} unknown (use {LINEAR!r} or {FULL!r})")
        if out.linear_num_value_heads % out.linear_num_key_heads:
            raise CheckpointError(
                "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        if out.num_heads % out.num_kv_heads:
            raise CheckpointError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if out.num_experts and not 0 < out.num_experts_per_tok <= out.num_experts:
            raise CheckpointError("config.json: num_experts_per_tok must be in 1..num_experts")
        if out.conv_kernel < 1:
            raise CheckpointError("config.json: linear_conv_kernel_dim must be >= 1")
        require_silu(cfg)
        if cfg.get("attention_bias"):
            raise CheckpointError(
                "config.json: attention_bias is true (q/k/v/o projection biases in the attention layers), "
                "which this engine does not implement for qwen3_5"
            )
        refuse_quantized(cfg)
        return out


@dataclass(frozen=True)
class _Linear:
    """Gated DeltaNet token mixer."""

    w_in: torch.Tensor  # [conv_dim + value_dim + 2 Hv, hidden]: in_proj_qkv | z | b | a fused
    conv: torch.Tensor  # [conv_dim, 1, K] depthwise causal conv
    a_log: torch.Tensor  # [Hv] runtime dtype (as transformers keeps it)
    dt_bias: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [Dv] gated RMSNorm weight (plain scale)
    w_out: torch.Tensor  # [hidden, value_dim]


@dataclass(frozen=True)
class _Attention:
    """Gated full attention: q_proj yields per head [query D | gate D]."""

    w_q: torch.Tensor  # [Hq * 2D, hidden]
    w_kv: torch.Tensor  # [2 Hkv D, hidden]: k | v fused
    q_norm: torch.Tensor  # [D] float32, already 1 + weight
    k_norm: torch.Tensor  # [D] float32, already 1 + weight
    w_o: torch.Tensor  # [hidden, Hq D]


@dataclass(frozen=True)
class _Layer:
    kind: str
    input_norm: torch.Tensor  # [hidden] float32, already 1 + weight
    mixer: _Linear | _Attention
    post_norm: torch.Tensor  # [hidden] float32, already 1 + weight
    mlp: _Mlp | _Moe


def rms_norm_1p(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: float32 normalize, times `scale` = 1 + weight (float32),
    then cast back (transformers: `(x_norm * (1 + w)).type_as(x)`)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale).to(x.dtype)


class Qwen35Backend(BatchedForward):
    family = "qwen3_5"

    def __init__(
        self,
        cfg: Qwen35Config,
        rope: Rope,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        layers: list[_Layer],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
        delta_rule: DeltaRuleOps,
    ) -> None:
        assert len(layers) == cfg.num_layers
        self.cfg = cfg
        self.rope = rope
        self.embed = embed
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.layers = layers
        self.placement = placement
        self.device = placement.first  # where tokens enter; logits come out on placement.last
        self.dtype = dtype
        self.ops = ops
        self.delta_rule = delta_rule
        self.vocab_size = cfg.vocab_size
        self.scale = cfg.head_dim**-0.5
        self.geometry = geometry_of(cfg, dtype)

    # -- state ---------------------------------------------------------------
    def new_state(self, capacity: int) -> State:
        if capacity < 1:
            raise ValueError(f"state capacity must be >= 1 token, got {capacity}")
        tensors: dict[str, torch.Tensor] = {}
        for s in self.geometry.specs:
            if s.name == LOGITS:
                continue
            shape, device = s.shape_at(capacity), self.placement.device_for(s.name)  # the layer's stage
            if s.length_dim is None:
                tensors[s.name] = torch.zeros(shape, dtype=s.dtype, device=device)
            else:
                tensors[s.name] = torch.empty(shape, dtype=s.dtype, device=device)
        return State(capacity=capacity, tensors=tensors)

    def export(self, state: State) -> Snapshot:
        assert state.logits is not None, "export needs at least one token of state"
        p = state.position
        out: dict[str, torch.Tensor] = {}
        for s in self.geometry.specs:
            if s.name == LOGITS:
                continue
            t = state.tensors[s.name]
            out[s.name] = t if s.length_dim is None else t.narrow(s.length_dim, 0, p)
        out[LOGITS] = state.logits
        return Snapshot(p, out)

    def adopt(self, snapshot: Snapshot, capacity: int, into: State | None = None) -> State:
        # `into` (a spent state whose buffers could be reused) is not used: this family
        # replaces its fixed-size tensors per step, so there is little to reuse.
        p = snapshot.position
        if p > capacity:
            raise SnapshotMismatch(
                f"snapshot covers {p} tokens, capacity is {capacity}: allocate a larger state"
            )
        self.geometry.validate(snapshot.tensors, p)  # raises before anything is written
        state = self.new_state(capacity)
        for s in self.geometry.specs:
            src = snapshot.tensors[s.name]
            if s.name == LOGITS:
                state.logits = src.to(self.placement.last, torch.float32, copy=True)
            elif s.length_dim is None:
                state.tensors[s.name] = src.to(self.placement.device_for(s.name), s.dtype, copy=True)
            else:
                state.tensors[s.name].narrow(s.length_dim, 0, p).copy_(src)
        state.position = p
        return state

    # -- compute -------------------------------------------------------------
    @torch.inference_mode()
    def _forward(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Advance each `states[b]` by `chunks[b]` [n_b] in one pass over T = sum(n_b) tokens:
        projections, MLP/MoE and the head over all T at once; conv windows, delta-rule states
        and attention per sequence (the decodes of a step share one conv and one delta-rule
        call). Logits [sum(heads), vocab] float32: after each chunk's last `heads[b]` tokens
        (its last token when `heads` is None)."""
        c = self.cfg
        step = Step.of(states, chunks, heads)
        tokens = torch.cat([ch.reshape(-1) for ch in chunks]).to(self.device)
        x = F.embedding(tokens, self.embed)  # [T, hidden]
        cos, sin = self.rope.cos_sin_at(step.positions(self.device), self.dtype)  # [T, R]
        for i, layer in enumerate(self.layers):
            dev = self.placement.device_of(i)
            if x.device != dev:  # a stage boundary: the hidden state and positions move on
                x, cos, sin = x.to(dev), cos.to(dev), sin.to(dev)
            h = self.ops.rms_norm_1p(x, layer.input_norm, c.rms_norm_eps)
            if isinstance(layer.mixer, _Linear):
                x = x + self._linear(i, layer.mixer, h, states, step)
            else:
                x = x + self._attention(i, layer.mixer, h, states, step, cos, sin)
            h = self.ops.rms_norm_1p(x, layer.post_norm, c.rms_norm_eps)
            x = x + self._mlp(layer.mlp, h)
        x = x[step.head_rows]
        normed = self.ops.rms_norm_1p(x, self.final_norm, c.rms_norm_eps)
        logits = self.ops.linear(normed, self.lm_head).float()
        for b, st in enumerate(states):
            st.position = step.starts[b] + step.lengths[b]
            st.logits = logits[step.head_last[b]].clone()
        return logits

    def _linear(
        self, i: int, w: _Linear, h: torch.Tensor, states: Sequence[State], step: Step
    ) -> torch.Tensor:
        """Gated DeltaNet over h [T, hidden] -> [T, hidden]; replaces each sequence's conv and
        recurrent state tensors of this layer."""
        c = self.cfg
        t = h.shape[0]
        hk, hv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        mixed, z, b, a = self.ops.linear(h, w.w_in).split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
        beta = self.ops.sigmoid(b)
        g = -w.a_log.float().exp() * self.ops.softplus(a.float() + w.dt_bias)  # [T, Hv] float32 log decay
        conv_name, rec_name = f"layers.{i}.conv", f"layers.{i}.recurrent"
        keep = c.conv_kernel - 1
        out = h.new_empty((t, hv, dv))  # delta-rule output per token
        if step.decodes:
            # All one-token sequences at once: a batched conv window, and one delta-rule call
            # with the sequences folded into the head dim (value head b Hv + j reads key head
            # b Hk + j // (Hv / Hk): the same grouping as within one sequence).
            rows, nd = step.decode_rows, len(step.decodes)
            carried = torch.stack([states[s].tensors[conv_name] for s in step.decodes])  # [Bd, conv_dim, K-1]
            window = torch.cat([carried, mixed[rows].unsqueeze(-1)], dim=-1)  # [Bd, conv_dim, K]
            conv = self.ops.conv_silu(window, w.conv)[..., -1]  # [Bd, conv_dim]
            q, k, v = conv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
            recurrent = torch.cat([states[s].tensors[rec_name] for s in step.decodes])  # [Bd Hv, Dk, Dv]
            o, new_rec = self.delta_rule.decode(
                q.reshape(1, nd * hk, dk),
                k.reshape(1, nd * hk, dk),
                v.reshape(1, nd * hv, dv),
                g[rows].reshape(1, nd * hv),
                beta[rows].reshape(1, nd * hv),
                recurrent,
            )
            out[rows] = o.view(nd, hv, dv)
            new_conv = window[..., window.shape[-1] - keep :].contiguous()
            for j, s in enumerate(step.decodes):
                states[s].tensors[conv_name] = new_conv[j]
                states[s].tensors[rec_name] = new_rec[j * hv : (j + 1) * hv]
        for s in step.prefills:
            st, o0, n = states[s], step.offsets[s], step.lengths[s]
            # Causal depthwise conv over [the K-1 carried inputs | this chunk]: a chunk boundary
            # inside a conv window sees exactly the inputs a one-shot run would.
            window = torch.cat([st.tensors[conv_name], mixed[o0 : o0 + n].t()], dim=1)  # [conv_dim, K-1+n]
            st.tensors[conv_name] = window[:, window.shape[1] - keep :].contiguous()
            conv = self.ops.conv_silu(window, w.conv).t()  # [n, conv_dim]
            q, k, v = conv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
            out[o0 : o0 + n], st.tensors[rec_name] = self.delta_rule.prefill(
                q.reshape(n, hk, dk),
                k.reshape(n, hk, dk),
                v.reshape(n, hv, dv),
                g[o0 : o0 + n],
                beta[o0 : o0 + n],
                st.tensors[rec_name],
            )
        # Gated RMSNorm per value head: norm(out) * w, then * silu(z) in float32, cast back.
        normed = self.ops.rms_norm(out, w.norm, c.rms_norm_eps)
        gated = (normed * self.ops.silu(z.reshape(t, hv, dv).float())).to(h.dtype)
        return self.ops.linear(gated.reshape(t, c.value_dim), w.w_out)

    def _attention(
        self,
        i: int,
        w: _Attention,
        h: torch.Tensor,
        states: Sequence[State],
        step: Step,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Gated full attention over h [T, hidden] -> [T, hidden]; writes each sequence's K/V
        rows start..start+n-1 and attends over its own rows 0..start+n-1."""
        c, ops = self.cfg, self.ops
        t, d = h.shape[0], c.head_dim
        qg = self.ops.linear(h, w.w_q).view(t, c.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, c.num_heads * d)
        k, v = self.ops.linear(h, w.w_kv).split([c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        q = ops.rms_norm_1p(q, w.q_norm, c.rms_norm_eps)
        k = ops.rms_norm_1p(k.view(t, c.num_kv_heads, d), w.k_norm, c.rms_norm_eps)
        v = v.view(t, c.num_kv_heads, d)
        r = cos.shape[-1]  # partial RoPE: only the first R dims of each head rotate
        q = torch.cat([ops.rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([ops.rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        outs = []
        for st, start, n, o in zip(states, step.starts, step.lengths, step.offsets, strict=False):
            end = start + n
            k_cache, v_cache = st.tensors[f"layers.{i}.k"], st.tensors[f"layers.{i}.v"]
            k_cache[start:end] = k[o : o + n]
            v_cache[start:end] = v[o : o + n]
            if n == 1:
                outs.append(ops.decode_attention(q[o], k_cache[:end], v_cache[:end], self.scale).unsqueeze(0))
            else:
                outs.append(ops.prefill_attention(q[o : o + n], k_cache[:end], v_cache[:end], self.scale))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.ops.linear(attn.reshape(t, c.num_heads * d) * ops.sigmoid(gate), w.w_o)

    def _mlp(self, w: _Mlp | _Moe, h: torch.Tensor) -> torch.Tensor:
        return _mlp(w, h, self.ops) if isinstance(w, _Mlp) else _moe(w, h, self.ops)


def geometry_of(cfg: Qwen35Config, dtype: torch.dtype) -> Geometry:
    specs: list[TensorSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            specs.append(TensorSpec(f"layers.{i}.conv", dtype, (cfg.conv_dim, cfg.conv_kernel - 1)))
            specs.append(
                TensorSpec(
                    f"layers.{i}.recurrent",
                    torch.float32,
                    (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                )
            )
        else:
            kv = (-1, cfg.num_kv_heads, cfg.head_dim)
            specs.append(TensorSpec(f"layers.{i}.k", dtype, kv, length_dim=0, rows=all_rows))
            specs.append(TensorSpec(f"layers.{i}.v", dtype, kv, length_dim=0, rows=all_rows))
    specs.append(TensorSpec(LOGITS, torch.float32, (cfg.vocab_size,)))
    return Geometry(tuple(specs))


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model config: `text_config` of a multimodal `qwen3_5` config.json,
    the file itself for `qwen3_5_text`."""
    sub = cfg.get("text_config")
    if isinstance(sub, dict):
        merged = dict(sub)
        merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return merged
    return cfg


def build(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> Qwen35Backend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm and the head on the last."""
    raw = text_config(ckpt.config)
    cfg = Qwen35Config.from_dict(raw)
    placement = Placement.of(where, cfg.num_layers)
    prefix = "model.language_model." if ckpt.has("model.language_model.embed_tokens.weight") else "model."
    w = Loader(ckpt, placement, dtype, prefix)
    hid, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hv = cfg.linear_num_value_heads

    layers: list[_Layer] = []
    for i, kind in enumerate(cfg.layer_types):
        w.at_layer(i)
        p = f"layers.{i}."
        mixer: _Linear | _Attention
        if kind == LINEAR:
            la = p + "linear_attn."
            w_in = torch.cat(
                [
                    w(la + "in_proj_qkv.weight", (cfg.conv_dim, hid)),
                    w(la + "in_proj_z.weight", (cfg.value_dim, hid)),
                    w(la + "in_proj_b.weight", (hv, hid)),
                    w(la + "in_proj_a.weight", (hv, hid)),
                ],
                dim=0,
            )
            mixer = _Linear(
                w_in=w_in,
                conv=w(la + "conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel)),
                a_log=w(la + "A_log", (hv,)),
                dt_bias=w(la + "dt_bias", (hv,)),
                norm=w(la + "norm.weight", (cfg.linear_value_head_dim,)),
                w_out=w(la + "out_proj.weight", (hid, cfg.value_dim)),
            )
        else:
            sa = p + "self_attn."
            kv = cfg.num_kv_heads * d
            mixer = _Attention(
                w_q=w(sa + "q_proj.weight", (cfg.num_heads * d * 2, hid)),
                w_kv=torch.cat(
                    [w(sa + "k_proj.weight", (kv, hid)), w(sa + "v_proj.weight", (kv, hid))], dim=0
                ),
                q_norm=w.norm_1p(sa + "q_norm.weight", d),
                k_norm=w.norm_1p(sa + "k_norm.weight", d),
                w_o=w(sa + "o_proj.weight", (hid, cfg.num_heads * d)),
            )
        mp = p + "mlp."
        mlp: _Mlp | _Moe
        if cfg.num_experts:
            e_n, e_i, s_i = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            gate_up, down = load_experts(w.has, w, mp, e_n, e_i, hid)
            mlp = _Moe(
                router=w(mp + "gate.weight", (e_n, hid)),
                gate_up=gate_up,
                down=down,
                shared=_Mlp(*w.gate_up_down(mp + "shared_expert.", hid, s_i)),
                shared_gate=w(mp + "shared_expert_gate.weight", (1, hid)),
                top_k=cfg.num_experts_per_tok,
            )
        else:
            mlp = _Mlp(*w.gate_up_down(mp, hid, inter))
        layers.append(
            _Layer(
                kind=kind,
                input_norm=w.norm_1p(p + "input_layernorm.weight", hid),
                mixer=mixer,
                post_norm=w.norm_1p(p + "post_attention_layernorm.weight", hid),
                mlp=mlp,
            )
        )
    embed, lm_head = w.ends(w, "embed_tokens.weight", cfg.vocab_size, hid, cfg.tie_word_embeddings)
    rope = build_rope(raw, d, placement.first)
    if rope.rotary_dim > d:
        raise CheckpointError(f"config.json: rotary dim {rope.rotary_dim} exceeds head_dim {d}")
    return Qwen35Backend(
        cfg,
        rope,
        embed,
        lm_head,
        w.norm_1p("norm.weight", hid),  # on the last stage
        layers,
        placement,
        dtype,
        ops,
        # the delta rule comes with the ops bundle (invariant mode: one token-serial form)
        DeltaRuleOps(ops.name, ops.delta_rule_prefill, ops.delta_rule_decode),
    )
