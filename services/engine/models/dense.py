"""Dense attention family: llama, qwen2, qwen3 (GQA/MQA, RoPE with scaling,
qk-norm for qwen3, q/k/v bias for qwen2, tied or untied embeddings), and qwen3_moe: qwen3's
attention with a softmax top-k mixture of experts (models/moe.py) as the MLP of its sparse
layers (transformers' Qwen3MoeForCausalLM).

State per layer: preallocated K and V rows, `layers.{i}.k` / `layers.{i}.v`
[capacity, num_kv_heads, head_dim] on the layer's stage device; a snapshot is the first
`position` rows (contiguous views, no copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from keepwarm.engine.cache.snapshot_file import Alloc
from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.backend import State
from keepwarm.engine.models.config_fields import refuse_quantized, require_silu
from keepwarm.engine.models.moe import Moe, load_experts, moe
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope
from keepwarm.engine.models.sliding import KvLayout, KvStateBackend
from keepwarm.engine.models.step import BatchedForward, head_rows
from keepwarm.engine.models.weights import Loader
from keepwarm.kernels.cpu_decode_step import DecodeStep, DenseShape
from keepwarm.kernels.ops import Ops
from keepwarm.kernels.quant_weight import Weight, cat_rows, embedding


@dataclass(frozen=True)
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool = False  # q/k/v projections have a bias (qwen2 always; llama, qwen3: attention_bias)
    o_bias: bool = False  # o_proj has a bias (llama, qwen3: attention_bias)
    mlp_bias: bool = False  # gate/up/down have a bias (llama: mlp_bias)
    # qwen3_moe: which layers' MLP is the mixture of experts, and its shape
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def is_sparse(self, i: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[i]

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> DenseConfig:
        refuse_unsupported_fields(cfg)
        mt = cfg.get("model_type")
        attention_bias = bool(cfg.get("attention_bias", False))
        moe = mt == "qwen3_moe"
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            return DenseConfig(
                model_type=str(cfg["model_type"]),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                # Qwen3MoeConfig's default when absent (a config of only sparse layers never reads it)
                intermediate_size=int(
                    cfg.get("intermediate_size", 6144) if moe else cfg["intermediate_size"]
                ),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=mt in ("qwen3", "qwen3_moe"),
                qkv_bias=mt == "qwen2" or attention_bias,
                o_bias=mt != "qwen2" and attention_bias,
                mlp_bias=mt == "llama" and bool(cfg.get("mlp_bias", False)),
                **(_moe_fields(cfg, num_layers) if moe else {}),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e


def _moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """qwen3_moe's sparse layers as transformers' Qwen3MoeDecoderLayer picks them: layer i is
    sparse unless listed in mlp_only_layers, when num_experts > 0 and (i + 1) is a multiple of
    decoder_sparse_step (defaults: Qwen3MoeConfig's)."""
    # transformers 5 saves num_experts as num_local_experts (its attribute_map), which wins over both
    num_experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 128)))
    step = int(cfg.get("decoder_sparse_step", 1))
    mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    if num_experts > 0 and step <= 0:
        raise CheckpointError(f"config.json: decoder_sparse_step {step} must be a positive integer")
    top_k = int(cfg.get("num_experts_per_tok", 8))
    sparse = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    if any(sparse) and not 1 <= top_k <= num_experts:
        raise CheckpointError(
            f"config.json: num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}"
        )
    return dict(
        sparse_layers=sparse,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


# Every field of transformers' LlamaConfig, Qwen2Config, Qwen3Config and Qwen3MoeConfig, by what this
# family does with it (tests/engine/models/test_config_fields.py keeps the lists complete).
HONOURED_FIELDS = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
        "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "attention_bias",
        "mlp_bias", "hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
        "decoder_sparse_step", "mlp_only_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "norm_topk_prob", "num_local_experts",
    }
)  # fmt: skip
# Fields that do not change inference math (training, generation defaults, bookkeeping).
NO_MATH_FIELDS = frozenset(
    {
        "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
        "attention_dropout", "pretraining_tp", "dtype", "torch_dtype", "transformers_version",
        "architectures", "_name_or_path", "router_aux_loss_coef", "output_router_logits",
    }
)  # fmt: skip


def refuse_unsupported_fields(cfg: dict[str, Any]) -> None:
    """Raise CheckpointError naming the config.json field when it asks for math this family
    does not implement (transformers would compute something else)."""
    mt = cfg.get("model_type")
    require_silu(cfg)
    refuse_quantized(cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    layer_types = cfg.get("layer_types")
    if layer_types is None and mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        # transformers' derivation: sliding from layer max_window_layers on
        window_from = int(cfg.get("max_window_layers", 28))
        windowed = cfg.get("sliding_window", 4096) is not None
        layer_types = [
            "sliding_attention" if windowed and i >= window_from else "full_attention" for i in range(n)
        ]
    elif layer_types is None and mt == "qwen3_moe" and cfg.get("use_sliding_window"):
        # transformers' Qwen3Moe: every layer slides when sliding_window is set (no max_window_layers)
        windowed = cfg.get("sliding_window", 4096) is not None
        layer_types = ["sliding_attention" if windowed else "full_attention" for _ in range(n)]
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        raise CheckpointError(
            f"config.json: use_sliding_window / layer_types make layers {sliding} "
            f"{sorted({t for t in layer_types if t != 'full_attention'})} (sliding_window "
            f"{cfg.get('sliding_window')}), which this engine does not implement: only 'full_attention' "
            "layers are; set use_sliding_window to false only if the model was trained without it"
        )
    if mt != "llama" and cfg.get("mlp_bias"):
        raise CheckpointError(f"config.json: mlp_bias is not a {mt} option (llama only)")


@dataclass
class _Layer:
    input_norm: torch.Tensor
    w_qkv: Weight  # [(Hq + 2 Hkv) D, hidden]: q, k, v projections fused
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    w_o: Weight
    b_o: torch.Tensor | None
    post_norm: torch.Tensor
    # the MLP: dense (gate and up fused [2 I, hidden], down) or, on a qwen3_moe sparse layer, `moe`
    w_gate_up: Weight | None
    b_gate_up: torch.Tensor | None
    w_down: Weight | None
    b_down: torch.Tensor | None
    moe: Moe | None = None


class DenseBackend(BatchedForward, KvStateBackend):
    """Full attention on every layer: the K/V state, snapshots and adopt of models/sliding.py's
    `KvStateBackend` (`KvLayout.all_full`), with this family's forward and fused decode step."""

    family = "dense"

    def __init__(
        self,
        cfg: DenseConfig,
        raw_cfg: dict[str, Any],
        weights: dict[str, Any],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        layout = KvLayout.all_full(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        super().__init__(layout, cfg.vocab_size, placement, dtype)
        self.cfg = cfg
        self.ops = ops
        self.embed: Weight = weights["embed"]
        self.lm_head: Weight = weights["lm_head"]
        self.final_norm: torch.Tensor = weights["final_norm"]
        self.layers: list[_Layer] = weights["layers"]
        self.rope: Rope = build_rope(raw_cfg, cfg.head_dim, placement.first)
        self.scale = cfg.head_dim**-0.5
        self._kv_names = [(f"layers.{i}.k", f"layers.{i}.v") for i in range(cfg.num_layers)]
        self._step = self._decode_step()

    def _decode_step(self) -> DecodeStep | None:
        """The decode step through every layer in one native call where the ops have one and
        it applies (bf16 on one CPU, no mixture of experts; kernels/cpu_decode_step.py), else None."""
        c, make = self.cfg, self.ops.dense_decode_step
        devices = {self.placement.device_of(i) for i in range(c.num_layers)}
        if make is None or self.dtype != torch.bfloat16 or devices != {torch.device("cpu")}:
            return None
        if any(layer.moe is not None for layer in self.layers):
            return None
        shape = DenseShape(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            self.scale,
        )
        return make(shape, self.layers, self.rope.rotary_dim)

    # -- state (new_state, export, adopt: KvStateBackend) ----------------------
    def restore_target(self, state: State) -> Alloc:
        """Where a snapshot file may be read directly: the first rows of `state`'s K/V
        buffers (already-mapped pages), so adopt(..., into=state) copies nothing."""

        def alloc(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
            buf = state.tensors.get(name)
            if (
                buf is None
                or buf.dtype != dtype
                or len(shape) != buf.dim()
                or shape[1:] != tuple(buf.shape[1:])
            ):
                return None
            return buf[: shape[0]] if shape[0] <= buf.shape[0] else None

        return alloc

    # -- compute -------------------------------------------------------------
    @torch.inference_mode()
    def _forward(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Advance each state by its chunk in one pass: the projections and the MLP run over
        all T = sum(n_i) tokens; RoPE, the K/V write and attention per sequence (the decoding
        sequences' attention in one batched call).
        Logits [sum(heads), vocab] float32: after each chunk's last `heads[b]` tokens (its
        last token when `heads` is None)."""
        c, ops = self.cfg, self.ops
        lens = [int(ch.shape[0]) for ch in chunks]
        starts = [s.position for s in states]
        for s, n in zip(states, lens, strict=True):
            assert n >= 1 and s.position + n <= s.capacity, f"state capacity {s.capacity} exceeded"
        t = sum(lens)
        rows, lasts = head_rows(lens, heads)
        offs = list(itertools.accumulate(lens, initial=0))[:-1]  # sequence j's first row of the step
        tokens = torch.cat([ch.reshape(-1) for ch in chunks]).to(self.device)
        x = embedding(tokens, self.embed, self.dtype)
        if len(states) == 1:
            cos, sin = self.rope.cos_sin(starts[0], t, self.dtype)
        else:
            positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, lens, strict=True)])
            cos, sin = self.rope.cos_sin_at(positions, self.dtype)
        fused = None
        if self._step is not None and t == len(states):  # a decode step
            caches = [a for s in states for a in self.state_addresses(s)]
            fused = self._step.run(x, cos, sin, caches, starts)
        for i, layer in enumerate(self.layers if fused is None else ()):
            dev = self.placement.device_of(i)
            if x.device != dev:  # a stage boundary: the hidden state and positions move on
                x, cos, sin = x.to(dev), cos.to(dev), sin.to(dev)
            q, k, v = self._qkv(layer, x, cos, sin)
            keys, values = [], []  # each sequence's cache rows 0 .. start + n, its chunk written
            k_name, v_name = self._kv_names[i]
            for state, start, n, off in zip(states, starts, lens, offs, strict=True):
                k_cache, v_cache = state.tensors[k_name][: start + n], state.tensors[v_name][: start + n]
                k_cache[start:] = k[off : off + n]
                v_cache[start:] = v[off : off + n]
                keys.append(k_cache)
                values.append(v_cache)
            x = self._mlp(layer, x, self._attention(q, keys, values, lens, offs))
        if fused is not None:
            x = fused
        if len(rows) < t:
            x = x[-1:] if rows == [t - 1] else x[rows]
        logits = ops.project(ops.rms_norm(x, self.final_norm, c.rms_norm_eps), self.lm_head).float()
        for state, start, n, last in zip(states, starts, lens, lasts, strict=True):
            state.position = start + n
            state.logits = logits[last]
        return logits

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], normed and rotated."""
        c, ops = self.cfg, self.ops
        t = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
        q, k, v = ops.project(h, layer.w_qkv, layer.b_qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)
        k = k.view(t, c.num_kv_heads, c.head_dim)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin), v

    def _mlp(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual after attention [T, Hq, D] and the MLP: the layer's output [T, hidden]."""
        c, ops = self.cfg, self.ops
        x = x + ops.project(attn.reshape(x.shape[0], c.num_heads * c.head_dim), layer.w_o, layer.b_o)
        h = ops.rms_norm(x, layer.post_norm, c.rms_norm_eps)
        if layer.moe is not None:
            return x + moe(layer.moe, h, ops)
        assert layer.w_gate_up is not None and layer.w_down is not None
        gate, up = ops.project(h, layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)
        return x + ops.project(ops.silu_mul(gate, up), layer.w_down, layer.b_down)

    # -- static decode (a CUDA graph captures it: generation/decode_graph.py) ---------
    def static_decode(self, max_context: int) -> bool:
        """Whether `decode_rows` can run here (the ops have address-table kernels, one
        device, no mixture of experts: its routing reads host values); builds the RoPE tables
        for every position below `max_context` first, so a captured step never sees them grow."""
        ops = self.ops
        if ops.decode_attention_table is None or ops.write_rows is None:
            return False
        if any(layer.moe is not None for layer in self.layers):
            return False
        if len({self.placement.device_of(i) for i in range(self.cfg.num_layers)}) != 1:
            return False
        self.rope.table(max_context, self.dtype)
        return True

    def state_addresses(self, state: State) -> list[int]:
        """The addresses `decode_rows` reads and writes for `state`: layer i's K buffer at
        2 i, its V buffer at 2 i + 1."""
        return [state.tensors[name].data_ptr() for pair in self._kv_names for name in pair]

    @torch.inference_mode()
    def decode_rows(
        self, tokens: torch.Tensor, positions: torch.Tensor, addresses: torch.Tensor
    ) -> torch.Tensor:
        """One decode token per sequence without a host value: tokens [B] int64 fed at
        positions [B] int64 (each sequence's state.position), addresses [2 L, B] int64 (column
        b: `state_addresses` of sequence b). Writes each K/V row, returns logits [B, vocab]
        float32; row b has the bits `step` gives that sequence (same ops, row-invariant).
        The caller advances the states' positions and logits (it knows the real rows)."""
        c, ops = self.cfg, self.ops
        assert ops.decode_attention_table is not None and ops.write_rows is not None
        cos_table, sin_table = self.rope.tables[self.dtype]
        x = embedding(tokens, self.embed, self.dtype)
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            k_table, v_table = addresses[2 * i], addresses[2 * i + 1]
            ops.write_rows(k, k_table, positions)
            ops.write_rows(v, v_table, positions)
            attn = ops.decode_attention_table(q, k_table, v_table, positions, self.scale, c.num_kv_heads)
            x = self._mlp(layer, x, attn)
        return ops.project(ops.rms_norm(x, self.final_norm, c.rms_norm_eps), self.lm_head).float()

    def _attention(
        self,
        q: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        lens: list[int],
        offs: list[int],
    ) -> torch.Tensor:
        """Attention of the step's T query rows q [T, Hq, D], sequence j's rows offs[j] ..
        offs[j] + lens[j] against keys[j], values[j]: the one-token (decoding) sequences in one
        batched call, each prefill chunk on its own. [T, Hq, D]."""
        ops = self.ops
        decoding = [j for j, n in enumerate(lens) if n == 1]
        if len(decoding) == len(lens):  # a decode step: q's rows are the sequences' queries
            return ops.decode_attention_batch(q, keys, values, self.scale)
        decoded: dict[int, torch.Tensor] = {}
        if decoding:
            batch = ops.decode_attention_batch(
                q[[offs[j] for j in decoding]],
                [keys[j] for j in decoding],
                [values[j] for j in decoding],
                self.scale,
            )
            decoded = dict(zip(decoding, batch.split(1), strict=True))
        outs = [
            decoded[j] if n == 1 else ops.prefill_attention(q[off : off + n], keys[j], values[j], self.scale)
            for j, (n, off) in enumerate(zip(lens, offs, strict=True))
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def build(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> DenseBackend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm and the head on the last."""
    cfg = DenseConfig.from_dict(ckpt.config)
    placement = Placement.of(where, cfg.num_layers)
    hid, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    w = Loader(ckpt, placement, dtype)
    wl = w.linear  # a projection: blocks where kept
    layers = []
    for i in range(cfg.num_layers):
        w.at_layer(i)
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        wq, wk, wv = (
            wl(a + "q_proj.weight", (q_size, hid)),
            wl(a + "k_proj.weight", (kv_size, hid)),
            wl(a + "v_proj.weight", (kv_size, hid)),
        )
        w_qkv = cat_rows([wq, wk, wv], dtype)
        del wq, wk, wv
        inter = cfg.intermediate_size
        sparse = cfg.is_sparse(i)
        w_gate_up = w_down = None
        layer_moe = None
        if sparse:
            e_n, e_i = cfg.num_experts, cfg.moe_intermediate_size
            gate_up, down = load_experts(w.has, w, m, e_n, e_i, hid)
            layer_moe = Moe(
                router=w(m + "gate.weight", (e_n, hid)),
                gate_up=gate_up,
                down=down,
                top_k=cfg.num_experts_per_tok,
                normalize=cfg.norm_topk_prob,
            )
            del gate_up, down
        else:
            wg, wu = wl(m + "gate_proj.weight", (inter, hid)), wl(m + "up_proj.weight", (inter, hid))
            w_gate_up = cat_rows([wg, wu], dtype)
            del wg, wu
            w_down = wl(m + "down_proj.weight", (hid, inter))
        layers.append(
            _Layer(
                input_norm=w(p + "input_layernorm.weight", (hid,)),
                w_qkv=w_qkv,
                # biases exactly as transformers builds them from the config (a bias the
                # config does not ask for is ignored there, so here too)
                b_qkv=w.qkv(a, q_size, kv_size) if cfg.qkv_bias else None,
                q_norm=w(a + "q_norm.weight", (d,)) if cfg.qk_norm else None,
                k_norm=w(a + "k_norm.weight", (d,)) if cfg.qk_norm else None,
                w_o=wl(a + "o_proj.weight", (hid, q_size)),
                b_o=w(a + "o_proj.bias", (hid,)) if cfg.o_bias else None,
                post_norm=w(p + "post_attention_layernorm.weight", (hid,)),
                w_gate_up=w_gate_up,
                b_gate_up=w.rows((m + "gate_proj.bias", (inter,)), (m + "up_proj.bias", (inter,)))
                if cfg.mlp_bias and not sparse
                else None,
                w_down=w_down,
                b_down=w(m + "down_proj.bias", (hid,)) if cfg.mlp_bias and not sparse else None,
                moe=layer_moe,
            )
        )
    embed, lm_head = w.ends(wl, "model.embed_tokens.weight", cfg.vocab_size, hid, cfg.tie_word_embeddings)
    weights = {
        "embed": embed,
        "lm_head": lm_head,
        "final_norm": w("model.norm.weight", (hid,)),
        "layers": layers,
    }
    return DenseBackend(cfg, ckpt.config, weights, placement, dtype, ops)
