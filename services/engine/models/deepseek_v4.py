"""Compressed-attention family `deepseek_v4` (DeepSeek V4), matching transformers'
DeepseekV4ForCausalLM: shared K=V MQA with partial interleaved RoPE and per-head attention
sinks over a sliding window on every layer; CSA layers add an overlapping compressor
(rate m) whose rows a lightning indexer picks top-k per query; HCA layers add a
non-overlapping compressor (rate m') whose completed rows are all visible; grouped
low-rank output projection; manifold-constrained hyper-connections (hc_mult residual
streams mixed through Sinkhorn-projected matrices); hash-routed or top-k routed MoE with
a shared expert.

State, by canonical name (p = position, W = sliding_window, r = the layer's rate, d =
head_dim, C = d for HCA and 2d for CSA, dI = index_head_dim):
  every layer   `layers.{i}.window`       [min(p, W-1), d]  rope'd K=V rows of the last
                                          positions, in position order (W-1 suffice: a
                                          query sees itself and the W-1 before it)
  CSA/HCA       `layers.{i}.compressed`   [p // r, d]   one row per completed block
                `layers.{i}.pending_kv`   [p % r, C]    raw compressor kv / gate projections
                `layers.{i}.pending_gate` [p % r, C]    of the open block
  CSA only      `layers.{i}.overlap_kv`   [r or 0, d]   Ca half (kv, and gate + position bias
                `layers.{i}.overlap_gate` [r or 0, d]   float32) of the last completed block,
                                          which the next block's row overlaps; 0 rows
                                          before the first block completes
                `layers.{i}.indexer.*`    the indexer's own compressor: compressed
                                          [p // r, dI], pending_kv / pending_gate
                                          [p % r, 2 dI], overlap_kv / overlap_gate [r or 0, dI]
  `sidecar.logits` [vocab] float32
Hyper-connection streams live only within a token, so no mHC state persists.
Each layer's state and weights live on its stage's device (models/placement.py); the mHC
streams, positions and token ids move with the hidden state at a stage boundary.
This is exactly transformers' cache (DeepseekV4HCACache / DeepseekV4CSACache), whose
chunked forward equals its one-shot forward; so is ours at any chunk boundary.

Invariant: window, pending and overlap tensors are replaced by new tensors at every step,
never written in place, and compressed rows below the live count are never rewritten; so
an exported snapshot (views, no copy) stays valid while the live state moves on.

A step (`step`, and `prefill` / `decode` as a step of one sequence) runs the hyper-connection
mixing, every projection (attention, compressor and indexer inputs, output), the MoE and the
head over all its tokens at once; each sequence's sliding window, compressors, indexer
scores and attention run on its own slice of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.loading.checkpoint import Checkpoint
from keepwarm.engine.models.backend import State
from keepwarm.engine.models.deepseek_v4_config import CSA, HASH_MOE, HCA, SLIDING, DeepseekV4Config
from keepwarm.engine.models.deepseek_v4_weights import (
    load_experts,
    load_weight,
    weight_specs,
)
from keepwarm.engine.models.geometry import Geometry, SnapshotMismatch, TensorSpec
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope
from keepwarm.engine.models.step import BatchedForward, Step
from keepwarm.engine.models.weights import Loader
from keepwarm.kernels.ops import Ops

__all__ = ["DeepseekV4Backend", "build", "geometry_of"]

_QUERY_BLOCK = 256  # queries per attention block: scores are [heads, block, W - 1 + block + compressed]


# -- weights ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Compressor:
    """One compressor: rows = kv_norm(sum over a block of softmax(gate + bias) * kv), roped at
    the block's first position. Overlapping (CSA): each token projects two series, Ca for the
    next block and Cb for its own, so a row spans 2r tokens with stride r."""

    kv: torch.Tensor  # [C, hidden]
    gate: torch.Tensor  # [C, hidden]
    position_bias: torch.Tensor  # [r, C] float32
    norm: torch.Tensor  # [dim] float32
    rate: int
    dim: int
    overlap: bool


@dataclass(frozen=True)
class _Indexer:
    comp: _Compressor
    q_b: torch.Tensor  # [IH * dI, q_lora_rank]
    weights_proj: torch.Tensor  # [IH, hidden]


@dataclass(frozen=True)
class _HyperConnection:
    fn: torch.Tensor  # [(2 + n) n, n hidden] float32: pre | post | comb logits
    base: torch.Tensor  # [(2 + n) n] float32
    scale: torch.Tensor  # [3] float32


@dataclass(frozen=True)
class _Layer:
    kind: str
    attn_norm: torch.Tensor  # [hidden] float32
    attn_hc: _HyperConnection
    q_a: torch.Tensor  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor  # [q_lora_rank] float32
    q_b: torch.Tensor  # [H d, q_lora_rank]
    kv: torch.Tensor  # [d, hidden]
    kv_norm: torch.Tensor  # [d] float32
    sinks: torch.Tensor  # [H] float32
    o_a: torch.Tensor  # [g, d_g, H d / g]: per-group low-rank projection
    o_b: torch.Tensor  # [hidden, g d_g]
    compressor: _Compressor | None
    indexer: _Indexer | None
    ffn_norm: torch.Tensor  # [hidden] float32
    ffn_hc: _HyperConnection
    router: torch.Tensor  # [E, hidden]
    tid2eid: torch.Tensor | None  # [vocab, k] int64: hash routing table (hash_moe layers)
    score_bias: torch.Tensor | None  # [E] float32: selection-only bias (moe layers)
    experts_gate_up: torch.Tensor  # [E, 2I, hidden]: gate rows then up rows
    experts_down: torch.Tensor  # [E, hidden, I]
    shared_gate_up: torch.Tensor  # [2I, hidden]
    shared_down: torch.Tensor  # [hidden, I]


# -- math helpers ------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's RMSNorm: float32 normalize, times the float32 weight, one cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float, ops: Ops) -> torch.Tensor:
    """x [..., D] * rsqrt(mean(x^2) + eps) rounded to x's dtype (as transformers). The sum of
    squares goes through ops.linear against a ones row: one reduction order per row in the
    invariant bundle, so a row's bits do not depend on how many rows are in the call."""
    ones = torch.ones((1, x.shape[-1]), dtype=torch.float32, device=x.device)
    mean_sq = ops.linear(x.float().square(), ones) / x.shape[-1]  # [..., 1]
    return x * torch.rsqrt(mean_sq + eps).to(x.dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotate: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rope slice of x [N, d] or [N, heads, d]; cos/sin
    [N, Dr/2] (one entry per channel pair), math in float32, leading channels untouched."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = (rope.float() * cos + _rotate_pairs(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _cos_sin(rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, Dr/2] at absolute `positions` [N], cast to `dtype` as transformers does:
    the first half of the rope's table rows (computed in fixed blocks, so a position's values
    are the same bits whatever the chunk; torch's cos/sin of a fresh [N, Dr/2] are not)."""
    cos, sin = rope.cos_sin_at(positions, dtype)  # [N, Dr] = the [N, Dr/2] values twice
    half = rope.inv_freq.shape[0]
    return cos[:, :half], sin[:, :half]


def _sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` (kept, size 1) by elementwise adds in index order: the same bits for
    a row whatever the other dims' sizes (a torch reduction may block by shape)."""
    parts = x.unbind(dim)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total.unsqueeze(dim)


def _hc_weights(
    hc: _HyperConnection, streams: torch.Tensor, cfg: DeepseekV4Config, ops: Ops
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC for streams [T, n, hidden]: post [T, n] and comb [T, n, n] (float32, comb
    Sinkhorn-projected onto doubly-stochastic matrices), and the collapsed block input [T, hidden].
    Every reduction is row-local in a fixed order (ops.linear, _sum), so a token's weights do
    not depend on T."""
    t, n = streams.shape[0], cfg.hc_mult
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), cfg.rms_norm_eps, ops)
    mixes = ops.linear(flat, hc.fn)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre_s, post_s, comb_s = hc.scale.unbind(0)
    eps = cfg.hc_eps
    pre = ops.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * ops.sigmoid(post_w * post_s + post_b)
    comb = ops.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), -1) + eps
    comb = comb / (_sum(comb, -2) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (_sum(comb, -1) + eps)
        comb = comb / (_sum(comb, -2) + eps)
    collapsed = _sum(pre.unsqueeze(-1) * streams, 1).squeeze(1).to(streams.dtype)
    return post, comb, collapsed


def _hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams [T, n, hidden] = post * block output + comb^T @ old streams."""
    dtype = streams.dtype
    # comb^T @ streams as float32 products summed in stream order, one rounding (a batched
    # matmul's blocking would depend on T)
    comb_t = comb.to(dtype).float().transpose(-1, -2)  # rounded to the streams' dtype, as the reference
    mixed = _sum(comb_t.unsqueeze(-1) * streams.float().unsqueeze(1), 2).squeeze(2)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed.to(dtype)


# -- geometry ----------------------------------------------------------------------
def _window_rows(window: int, position: int) -> int:
    return min(position, window - 1)


def _block_rows(rate: int, position: int) -> int:
    return position // rate


def _pending_rows(rate: int, position: int) -> int:
    return position % rate


def _overlap_rows(rate: int, position: int) -> int:
    return rate if position >= rate else 0


def _compressor_specs(
    prefix: str, rate: int, dim: int, overlap: bool, dtype: torch.dtype
) -> list[TensorSpec]:
    width = 2 * dim if overlap else dim
    block, pending = functools.partial(_block_rows, rate), functools.partial(_pending_rows, rate)
    specs = [
        TensorSpec(prefix + "compressed", dtype, (-1, dim), 0, block),
        TensorSpec(prefix + "pending_kv", dtype, (-1, width), 0, pending),
        TensorSpec(prefix + "pending_gate", dtype, (-1, width), 0, pending),
    ]
    if overlap:
        ov = functools.partial(_overlap_rows, rate)
        specs.append(TensorSpec(prefix + "overlap_kv", dtype, (-1, dim), 0, ov))
        specs.append(TensorSpec(prefix + "overlap_gate", torch.float32, (-1, dim), 0, ov))
    return specs


def geometry_of(cfg: DeepseekV4Config, dtype: torch.dtype) -> Geometry:
    specs: list[TensorSpec] = []
    window = functools.partial(_window_rows, cfg.sliding_window)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        specs.append(TensorSpec(p + "window", dtype, (-1, cfg.head_dim), 0, window))
        if kind != SLIDING:
            specs += _compressor_specs(p, cfg.rate(i), cfg.head_dim, kind == CSA, dtype)
        if kind == CSA:
            specs += _compressor_specs(p + "indexer.", cfg.rate(i), cfg.index_head_dim, True, dtype)
    specs.append(TensorSpec(LOGITS, torch.float32, (cfg.vocab_size,)))
    return Geometry(tuple(specs))


# -- backend -----------------------------------------------------------------------
class DeepseekV4Backend(BatchedForward):
    family = "deepseek_v4"

    def __init__(
        self,
        cfg: DeepseekV4Config,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        hc_head: _HyperConnection,
        layers: list[_Layer],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        assert len(layers) == cfg.num_layers
        self.cfg = cfg
        self.embed = embed
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.hc_head = hc_head
        self.layers = layers
        self.placement = placement
        self.device = placement.first  # where tokens enter; logits come out on placement.last
        self.dtype = dtype
        self.ops = ops
        self.vocab_size = cfg.vocab_size
        self.scale = cfg.head_dim**-0.5
        # sliding-only layers use the "main" rope; CSA/HCA layers, their compressors and
        # indexers all use the "compress" rope (its own theta, optionally YaRN)
        # (on the first stage: every stage's cos/sin are computed there, then moved)
        self.rope_main = _rope_of(cfg, cfg.rope_main, placement.first)
        self.rope_compress = _rope_of(cfg, cfg.rope_compress, placement.first)
        self.geometry = geometry_of(cfg, dtype)

    # -- state -----------------------------------------------------------------------
    def new_state(self, capacity: int) -> State:
        if capacity < 1:
            raise ValueError(f"state capacity must be >= 1 token, got {capacity}")
        tensors: dict[str, torch.Tensor] = {}
        for s in self.geometry.specs:
            if s.length_dim is None:
                continue
            device = self.placement.device_for(s.name)  # the layer's stage
            if s.name.endswith(".compressed"):  # append-only: preallocated for `capacity` tokens
                tensors[s.name] = torch.empty(s.shape_at(capacity), dtype=s.dtype, device=device)
            else:  # replaced at every step, right-sized
                tensors[s.name] = torch.empty(s.shape_at(0), dtype=s.dtype, device=device)
        return State(capacity=capacity, tensors=tensors)

    def export(self, state: State) -> Snapshot:
        assert state.logits is not None, "export needs at least one token of state"
        p = state.position
        out: dict[str, torch.Tensor] = {}
        for s in self.geometry.specs:
            if s.length_dim is None:
                continue
            t = state.tensors[s.name]
            rows = s.shape_at(p)[0]
            assert s.name.endswith(".compressed") or t.shape[0] == rows, f"{s.name}: {t.shape[0]} rows at {p}"
            out[s.name] = t[:rows]
        out[LOGITS] = state.logits
        return Snapshot(p, out)

    def adopt(self, snapshot: Snapshot, capacity: int, into: State | None = None) -> State:
        # `into` (a spent state whose buffers could be reused) is not used: this family
        # replaces its fixed-size tensors per step, so there is little to reuse.
        p = snapshot.position
        if p < 1:
            raise SnapshotMismatch(f"snapshot position {p} is invalid (a snapshot covers at least one token)")
        if p > capacity:
            raise SnapshotMismatch(f"snapshot covers {p} tokens, capacity is {capacity}")
        self.geometry.validate(snapshot.tensors, p)  # every name, dtype and shape before any write
        state = self.new_state(capacity)
        for name, t in state.tensors.items():
            src = snapshot.tensors[name]
            if name.endswith(".compressed"):
                t[: src.shape[0]].copy_(src)
            else:
                state.tensors[name] = src.to(self.placement.device_for(name), copy=True)
        state.position = p
        state.logits = snapshot.tensors[LOGITS].to(self.placement.last, torch.float32, copy=True)
        return state

    # -- compute -----------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Advance each `states[b]` by `chunks[b]` [n_b] (any size, any position) in one pass over
        T = sum(n_b) tokens: mHC, projections, compressor and indexer projections, MoE and the
        head over all T at once; sliding window, compressors, indexer scores and attention per
        sequence. Logits [sum(heads), vocab] float32: after each chunk's last `heads[b]` tokens
        (its last token when `heads` is None)."""
        c = self.cfg
        step = Step.of(states, chunks, heads)
        tokens = torch.cat([ch.reshape(-1) for ch in chunks]).to(self.device).long()
        t = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        streams = x.unsqueeze(1).expand(t, c.hc_mult, c.hidden_size).contiguous()  # [T, n, hidden]
        positions = step.positions(self.device)
        cos_sin = {
            "main": _cos_sin(self.rope_main, positions, self.dtype),
            "compress": _cos_sin(self.rope_compress, positions, self.dtype),
        }
        for i, layer in enumerate(self.layers):
            dev = self.placement.device_of(i)
            if streams.device != dev:  # a stage boundary: the mHC streams, positions and ids move on
                streams, tokens = streams.to(dev), tokens.to(dev)
                cos_sin = {k: (cos.to(dev), sin.to(dev)) for k, (cos, sin) in cos_sin.items()}
            post, comb, collapsed = _hc_weights(layer.attn_hc, streams, c, self.ops)
            h = self.ops.rms_norm_1p(collapsed, layer.attn_norm, c.rms_norm_eps)
            out = self._attention(i, layer, h, states, step, cos_sin)
            streams = _hc_merge(streams, out, post, comb)
            post, comb, collapsed = _hc_weights(layer.ffn_hc, streams, c, self.ops)
            h = self.ops.rms_norm_1p(collapsed, layer.ffn_norm, c.rms_norm_eps)
            streams = _hc_merge(streams, self._moe(layer, h, tokens), post, comb)
        streams = streams[step.head_rows]
        x = self._hc_head(streams)
        normed = self.ops.rms_norm_1p(x, self.final_norm, c.rms_norm_eps)
        logits = self.ops.linear(normed, self.lm_head).float()
        for b, st in enumerate(states):
            st.position = step.starts[b] + step.lengths[b]
            st.logits = logits[step.head_last[b]].clone()
        return logits

    def _hc_head(self, streams: torch.Tensor) -> torch.Tensor:
        """Collapse the streams [T, n, hidden] into one [T, hidden] with sigmoid weights."""
        hc = self.hc_head
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.cfg.rms_norm_eps, self.ops)
        pre = self.ops.sigmoid(self.ops.linear(flat, hc.fn) * hc.scale + hc.base) + self.cfg.hc_eps
        return _sum(pre.unsqueeze(-1) * streams, 1).squeeze(1).to(streams.dtype)

    def _attention(
        self,
        i: int,
        layer: _Layer,
        h: torch.Tensor,
        states: Sequence[State],
        step: Step,
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Attention block over h [T, hidden] -> [T, hidden]: every projection over all T
        tokens, then per sequence its window, compressors, indexer and attention."""
        c, linear = self.cfg, self.ops.linear
        t, dev = h.shape[0], h.device
        cos, sin = cos_sin["main" if layer.kind == SLIDING else "compress"]
        q_res = self.ops.rms_norm_1p(linear(h, layer.q_a), layer.q_a_norm, c.rms_norm_eps)  # [T, q_lora_rank]
        q = linear(q_res, layer.q_b).view(t, c.num_heads, c.head_dim)
        q = unweighted_rms_norm(q, c.rms_norm_eps, self.ops)
        q = apply_rope(q, cos, sin)  # [T, H, d]
        kv = apply_rope(self.ops.rms_norm_1p(linear(h, layer.kv), layer.kv_norm, c.rms_norm_eps), cos, sin)
        comp, idx = layer.compressor, layer.indexer
        if comp is not None:  # compressor inputs of every token: kv and gate [T, C] each
            comp_kv, comp_gate = linear(h, comp.kv), linear(h, comp.gate)
        if idx is not None:  # the indexer's: compressor kv and gate [T, 2 dI], queries, head weights
            idx_kv, idx_gate = linear(h, idx.comp.kv), linear(h, idx.comp.gate)
            idx_q = apply_rope(linear(q_res, idx.q_b).view(t, c.index_n_heads, c.index_head_dim), cos, sin)
            idx_w = linear(h, idx.weights_proj).float() * c.index_n_heads**-0.5  # [T, IH]

        out = torch.empty_like(q)
        prefix = f"layers.{i}."
        for st, start, n, o in zip(states, step.starts, step.lengths, step.offsets, strict=False):
            rows = slice(o, o + n)
            # window rows then this chunk's: positions start - S0 .. start + n - 1
            full = torch.cat([st.tensors[prefix + "window"], kv[rows]])
            keep = _window_rows(c.sliding_window, start + n)
            st.tensors[prefix + "window"] = full[full.shape[0] - keep :].clone()
            comp_rows: torch.Tensor | None = None
            comp_bias: torch.Tensor | None = None
            if comp is not None:
                comp_rows = self._compress(comp, comp_kv[rows], comp_gate[rows], st, prefix, start)
                if idx is None:
                    # HCA: query at q sees every block that ended at or before q
                    q_pos = torch.arange(start, start + n, device=dev)
                    visible = (q_pos + 1) // comp.rate
                    entry = torch.arange(comp_rows.shape[0], device=dev)
                    comp_bias = torch.zeros((n, comp_rows.shape[0]), dtype=torch.float32, device=dev)
                    comp_bias.masked_fill_(entry[None, :] >= visible[:, None], float("-inf"))
                else:
                    keys = self._compress(
                        idx.comp, idx_kv[rows], idx_gate[rows], st, prefix + "indexer.", start
                    )
                    comp_bias = self._index(idx, keys, idx_q[rows], idx_w[rows], start)
            out[rows] = self._attend(layer, q[rows], full, start, comp_rows, comp_bias)  # [n, H, d]
        # K = V carries rope on its trailing slice: rotate the output back by the query position
        out = apply_rope(out, cos, -sin)
        g = c.o_groups
        per_group = out.reshape(t, g, -1)
        grouped = torch.cat([linear(per_group[:, j], layer.o_a[j]) for j in range(g)], dim=-1)  # [T, g d_g]
        return linear(grouped, layer.o_b)

    def _attend(
        self,
        layer: _Layer,
        q: torch.Tensor,
        full: torch.Tensor,
        start: int,
        comp_rows: torch.Tensor | None,
        comp_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Eager attention with sinks, one sequence. q [T, H, d]; full [S0 + T, d] window rows
        then this chunk's rows (row 0 at position start - S0); comp_rows [C, d] with comp_bias
        [T, C] (0 or -inf). Query blocks keep scores at [H, block, W - 1 + block + C].
        The invariant kernel (ops.attention) when the bundle has one: key tiles at absolute
        positions, compressed rows after them, the sink last, so a row's bits do not depend on
        the chunk; else torch."""
        w = self.cfg.sliding_window
        t, dev = q.shape[0], q.device
        base = start + t - full.shape[0]
        kv = full.unsqueeze(1)  # [S0 + T, 1, d]: K = V, one kv head
        extra = {}
        if comp_rows is not None and comp_bias is not None and comp_rows.shape[0] > 0:
            rows = comp_rows.unsqueeze(1)
            extra = dict(extra_k=rows, extra_v=rows, extra_mask=comp_bias == 0)
        fast = self.ops.attention(q, kv, kv, self.scale, window=w, offset=base, sinks=layer.sinks, **extra)
        if fast is not None:
            return fast
        out = torch.empty_like(q)
        for a in range(0, t, _QUERY_BLOCK):
            b = min(t, a + _QUERY_BLOCK)
            lo = max(start + a - w + 1, base)
            keys = full[lo - base : start + b - base]
            q_pos = torch.arange(start + a, start + b, device=dev)[:, None]
            k_pos = torch.arange(lo, start + b, device=dev)[None, :]
            bias = torch.zeros((b - a, keys.shape[0]), dtype=torch.float32, device=dev)
            bias.masked_fill_((k_pos > q_pos) | (k_pos <= q_pos - w), float("-inf"))
            if comp_rows is not None and comp_bias is not None:
                keys = torch.cat([keys, comp_rows])
                bias = torch.cat([bias, comp_bias[a:b]], dim=-1)
            qb = q[a:b].transpose(0, 1)  # [H, tb, d]
            scores = torch.matmul(qb, keys.T) * self.scale + bias.to(q.dtype)
            sinks = layer.sinks.view(-1, 1, 1).expand(-1, b - a, 1)
            logits = torch.cat([scores, sinks], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # drop the sink
            out[a:b] = torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)
        return out

    def _compress(
        self, comp: _Compressor, kv: torch.Tensor, gate: torch.Tensor, state: State, prefix: str, start: int
    ) -> torch.Tensor:
        """Feed one sequence's chunk, projected (kv, gate [T, C]), to a compressor; returns
        all its rows so far [(start + T) // r, dim]."""
        r, d = comp.rate, comp.dim
        kv = torch.cat([state.tensors[prefix + "pending_kv"], kv])  # [start % r + T, C]
        gate = torch.cat([state.tensors[prefix + "pending_gate"], gate])
        n = kv.shape[0] // r
        used = n * r
        state.tensors[prefix + "pending_kv"] = kv[used:].clone()
        state.tensors[prefix + "pending_gate"] = gate[used:].clone()
        first = start // r  # index of the first block this chunk completes
        rows = state.tensors[prefix + "compressed"]
        if n > 0:
            ck = kv[:used].view(n, r, -1)
            cg = gate[:used].view(n, r, -1) + comp.position_bias  # float32
            if comp.overlap:
                # row w softmax-mixes Ca of block w-1 (slots :r) with Cb of block w (slots r:)
                wide_kv = ck.new_zeros((n, 2 * r, d))
                wide_gate = cg.new_full((n, 2 * r, d), float("-inf"))
                wide_kv[:, r:] = ck[..., d:]
                wide_gate[:, r:] = cg[..., d:]
                wide_kv[1:, :r] = ck[:-1, :, :d]
                wide_gate[1:, :r] = cg[:-1, :, :d]
                if first > 0:
                    wide_kv[0, :r] = state.tensors[prefix + "overlap_kv"]
                    wide_gate[0, :r] = state.tensors[prefix + "overlap_gate"]
                state.tensors[prefix + "overlap_kv"] = ck[-1, :, :d].clone()
                state.tensors[prefix + "overlap_gate"] = cg[-1, :, :d].clone()
                ck, cg = wide_kv, wide_gate
            # products in kv's dtype, summed in float32 in slot order, one rounding (as torch's sum)
            mixed = _sum((ck * self.ops.softmax(cg, 1).to(ck.dtype)).float(), 1).squeeze(1).to(ck.dtype)
            new = self.ops.rms_norm_1p(mixed, comp.norm, self.cfg.rms_norm_eps)
            block_pos = (first + torch.arange(n, device=self.placement.first)) * r
            cos, sin = _cos_sin(self.rope_compress, block_pos, new.dtype)  # on the first stage
            rows[first : first + n] = apply_rope(new, cos.to(new.device), sin.to(new.device))
        return rows[: first + n]

    def _index(
        self, idx: _Indexer, keys: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Lightning indexer, one sequence: bias [T, C] over its CSA compressed rows, 0 on each
        query's top-k completed blocks by sum_h w_h * relu(q_h . k), -inf elsewhere. keys
        [C, dI] are the indexer compressor's rows, q [T, IH, dI] roped, weights [T, IH] float32."""
        c = self.cfg
        t, dev = q.shape[0], q.device
        n_rows = keys.shape[0]
        if n_rows == 0:
            return torch.zeros((t, 0), dtype=torch.float32, device=dev)
        # q . k per (token, head, entry) through ops.linear (one reduction order per output
        # whatever T or C), the heads summed in order: a token's scores do not depend on the chunk
        scores = self.ops.linear(q.float().reshape(t * q.shape[1], -1), keys.float()).view(t, q.shape[1], -1)
        scores = F.relu(scores) * c.index_head_dim**-0.5  # [T, IH, C]
        index_scores = _sum(scores * weights.unsqueeze(-1), 1).squeeze(1)  # [T, C]
        q_pos = torch.arange(start, start + t, device=dev)
        visible = ((q_pos + 1) // idx.comp.rate)[:, None]  # blocks completed at each query
        entry = torch.arange(n_rows, device=dev)[None, :]
        index_scores = index_scores.masked_fill(entry >= visible, float("-inf"))
        top = self.ops.topk(index_scores, min(c.index_topk, n_rows))[1]  # [T, k]; invariant: ties to lowest
        top = torch.where(top < visible, top, torch.full_like(top, n_rows))  # future picks -> spare column
        bias = torch.full((t, n_rows + 1), float("-inf"), dtype=torch.float32, device=dev)
        bias.scatter_(-1, top, 0.0)
        return bias[:, :n_rows]

    def _moe(self, layer: _Layer, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        c, linear = self.cfg, self.ops.linear
        logits = linear(h, layer.router)  # [T, E]
        ops = self.ops
        scores = ops.softplus(logits).sqrt() if c.scoring_func == "sqrtsoftplus" else ops.sigmoid(logits)
        if layer.tid2eid is not None:
            chosen = layer.tid2eid[tokens]  # [T, k]: hash routing, fixed per token id
        else:
            assert layer.score_bias is not None
            chosen = ops.topk(scores + layer.score_bias, c.num_experts_per_tok)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (_sum(weights, -1) + 1e-20) * c.routed_scaling_factor
        out = torch.zeros_like(h)
        lim = c.swiglu_limit
        for e in torch.unique(chosen).tolist():
            tok, slot = torch.where(chosen == e)
            gate, up = linear(h[tok], layer.experts_gate_up[e]).chunk(2, dim=-1)
            y = linear(ops.silu_mul(gate.clamp(max=lim), up.clamp(min=-lim, max=lim)), layer.experts_down[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        gate, up = linear(h, layer.shared_gate_up).chunk(2, dim=-1)
        shared = linear(ops.silu_mul(gate.clamp(max=lim), up.clamp(min=-lim, max=lim)), layer.shared_down)
        return out + shared


def _rope_of(cfg: DeepseekV4Config, params: dict[str, object], device: torch.device) -> Rope:
    """Inverse frequencies of one rope type, from the shared rope table code (default / yarn
    / ...); V4 rotates interleaved pairs, so only inv_freq and the scaling are used."""
    flat = {"rope_parameters": dict(params), "max_position_embeddings": cfg.max_position_embeddings}
    return build_rope(flat, cfg.head_dim, device)


def build(
    ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops
) -> DeepseekV4Backend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm, the mHC head and the head on the last."""
    cfg = DeepseekV4Config.from_dict(ckpt.config)
    placement = Placement.of(where, cfg.num_layers)
    at = Loader(ckpt, placement, dtype)  # where `get` loads to: set per layer, then per stage below
    specs = {s.key: s for s in weight_specs(cfg)}

    def get(key: str) -> torch.Tensor:
        return load_weight(ckpt, specs[key], dtype, at.device)

    def hc(prefix: str) -> _HyperConnection:
        return _HyperConnection(get(prefix + ".fn"), get(prefix + ".base"), get(prefix + ".scale"))

    def compressor(p: str, kind: str, i: int, dim: int) -> _Compressor:
        return _Compressor(
            kv=get(p + "kv"),
            gate=get(p + "gate"),
            position_bias=get(p + "position_bias"),
            norm=get(p + "norm"),
            rate=cfg.rate(i),
            dim=dim,
            overlap=kind == CSA,
        )

    layers: list[_Layer] = []
    for i, kind in enumerate(cfg.layer_types):
        at.at_layer(i)
        p = f"layers.{i}."
        comp = compressor(p + "comp.", kind, i, cfg.head_dim) if kind in (CSA, HCA) else None
        indexer = None
        if kind == CSA:
            indexer = _Indexer(
                comp=compressor(p + "index.", kind, i, cfg.index_head_dim),
                q_b=get(p + "index.q_b"),
                weights_proj=get(p + "index.weights_proj"),
            )
        gate_up, down = load_experts(ckpt, cfg, i, dtype, at.device)
        o_a = get(p + "o_a")  # [g d_g, H d / g] -> [g, d_g, H d / g]
        layers.append(
            _Layer(
                kind=kind,
                attn_norm=get(p + "attn_norm"),
                attn_hc=hc(p + "attn_hc"),
                q_a=get(p + "q_a"),
                q_a_norm=get(p + "q_a_norm"),
                q_b=get(p + "q_b"),
                kv=get(p + "kv"),
                kv_norm=get(p + "kv_norm"),
                sinks=get(p + "sinks"),
                o_a=o_a.view(cfg.o_groups, cfg.o_lora_rank, -1),
                o_b=get(p + "o_b"),
                compressor=comp,
                indexer=indexer,
                ffn_norm=get(p + "ffn_norm"),
                ffn_hc=hc(p + "ffn_hc"),
                router=get(p + "router"),
                tid2eid=get(p + "tid2eid") if cfg.mlp_layer_types[i] == HASH_MOE else None,
                score_bias=None if cfg.mlp_layer_types[i] == HASH_MOE else get(p + "score_bias"),
                experts_gate_up=gate_up,
                experts_down=down,
                shared_gate_up=torch.cat([get(p + "shared.gate"), get(p + "shared.up")]),
                shared_down=get(p + "shared.down"),
            )
        )
    at.device = placement.first
    embed = get("embed")
    at.device = placement.last
    lm_head = embed.to(at.device) if cfg.tie_word_embeddings else get("lm_head")
    hc_head = hc("hc_head")
    return DeepseekV4Backend(cfg, embed, lm_head, get("norm"), hc_head, layers, placement, dtype, ops)
