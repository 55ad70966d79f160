"""A weight matrix kept in its quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): what
`ops.project` multiplies by without dequantizing it (kernels/cpu_quant_linear.py), and the
blocks' formulas in torch.

GGUF blocks (bytes per block along a row; a row of K weights is its blocks back to back):
  Q8_0 (34 per 32): f16 d, 32 x int8 q           w = d * q
  Q4_0 (18 per 32): f16 d, 16 bytes of nibbles   w = d * (q - 8)
  Q4_1 (20 per 32): f16 d, f16 m, 16 bytes       w = d * q + m
  Q5_0 (22 per 32): f16 d, 4 bytes of fifth bits (bit j: weight j), 16 bytes   w = d * (q - 16)
  Q5_1 (24 per 32): f16 d, f16 m, the same                                    w = d * q + m
(byte i's low nibble is weight i, its high nibble weight i + 16), and the k-quants' super-blocks
of 256 weights, 8 sub-blocks of 32 (Q6_K: 16 of 16):
  Q4_K (144): f16 d, f16 dmin, 12 bytes of 6-bit scales sc and minima m, 128 bytes of nibbles
              w = (d * sc) * q - dmin * m                    q in 0..15
  Q5_K (176): the same with a fifth bit per weight (32 bytes)  q in 0..31
  Q6_K (210): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d
              w = (d * sc) * (q - 32)                         q in 0..63
`dequantize_blocks` computes each value in float32 with the multiplies and the add or subtract
as separate operations, as the `gguf` package's reference does, so the results are bitwise the
reference's.

In memory (`QuantWeight.blocks`, [N, row_bytes(kind, K)] uint8) each row is laid out for the
kernel (`regroup`): Q8_0 / Q4_0 / Q4_1 as the row's K / 32 scales d, then (Q4_1) its minima m,
then its quants (the same bytes); the k-quants per row as
  Q4_K: every super-block's d, every dmin (f16), every sub-block's sc, every m (one byte each),
        then per block of 32: 16 bytes of nibbles (byte i: weight i low, weight i + 16 high)
  Q5_K: as Q4_K, each block's nibbles followed by 4 bytes of fifth bits (byte i bit k: weight i + 4 k)
  Q5_0 / Q5_1: every d (and m), then per block its nibbles and fifth bits as Q5_K
  Q6_K: every d, every super-block's 16 scales (int8, the first halves' 8 then the second
        halves' 8), then per block of 32: 16 bytes of low nibbles and 8 bytes of 2-bit highs
        (byte i bits 2k, 2k + 1: weight i + 8 k)
(148, 180 and 210 bytes per 256 weights: within 3 % of the file), so the kernel converts 8
scales at once and every block of 32 is read the same way. Rows stay whole, so they can be
sliced, permuted and concatenated like a dense matrix's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

import torch

QuantKind = Literal["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]
KINDS: tuple[QuantKind, ...] = get_args(QuantKind)  # the kernel's enum, in order
K_KINDS: tuple[QuantKind, ...] = ("Q4_K", "Q5_K", "Q6_K")
_SAME_BYTES: tuple[QuantKind, ...] = ("Q8_0", "Q4_0", "Q4_1")  # laid out with the file's bytes, regrouped
BLOCK = 32  # weights per block (the kernel's unit)
SUPER = 256  # weights per k-quant super-block
BLOCK_BYTES: dict[QuantKind, int] = {
    "Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24
}  # fmt: skip
_LAYOUT_BYTES: dict[QuantKind, int] = {**BLOCK_BYTES, "Q4_K": 148, "Q5_K": 180}  # per GGUF block, in memory


def block_weights(kind: QuantKind) -> int:
    """Weights per GGUF block of `kind` (a row's length is a multiple of it)."""
    return SUPER if kind in K_KINDS else BLOCK


def row_bytes(kind: QuantKind, k: int) -> int:
    """Bytes of a row of `k` weights in the kernel's layout."""
    return k // block_weights(kind) * _LAYOUT_BYTES[kind]


def _f16(col: torch.Tensor) -> torch.Tensor:
    """Two bytes per row, little-endian float16, as float32 (one per block, shape (n, 1))."""
    return col.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> its 32 4-bit values, low nibbles first."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def dequantize_blocks(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    """Blocks of `kind` (uint8, any shape holding whole blocks) as a flat float32 tensor."""
    if kind not in _SAME_BYTES:
        return _dequantize_rows(kind, regroup(kind, raw.reshape(1, -1))).reshape(-1)
    b = raw.reshape(-1, BLOCK_BYTES[kind])
    d = _f16(b[:, 0:2])
    if kind == "Q8_0":
        out = d * b[:, 2:].contiguous().view(torch.int8).float()
    elif kind == "Q4_0":
        out = d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()
    else:
        out = d * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])
    return out.reshape(-1)


def _header(kind: QuantKind) -> int:
    """Bytes of f16 values at the head of a GGUF block (d; d and m for Q4_1)."""
    return 4 if kind == "Q4_1" else 2


def regroup(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, blocks * block bytes] -> the kernel's rows (the module docstring's layout)."""
    if kind in K_KINDS:
        return _regroup_k(kind, raw)
    if kind in ("Q5_0", "Q5_1"):
        return _regroup_q5(kind, raw)
    n, h = raw.shape[0], _header(kind)
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])
    parts = [b[:, :, i : i + 2].reshape(n, -1) for i in range(0, h, 2)] + [b[:, :, h:].reshape(n, -1)]
    return torch.cat(parts, dim=1).contiguous()


def ungroup(kind: QuantKind, rows: torch.Tensor) -> torch.Tensor:
    """The kernel's rows -> GGUF blocks (regroup's inverse; Q8_0, Q4_0, Q4_1)."""
    assert kind in _SAME_BYTES, kind
    n, h, size = rows.shape[0], _header(kind), BLOCK_BYTES[kind]
    nb = rows.shape[1] // size
    heads = [rows[:, i * nb : (i + 2) * nb].reshape(n, nb, 2) for i in range(0, h, 2)]
    quants = rows[:, h * nb :].reshape(n, nb, size - h)
    return torch.cat([*heads, quants], dim=2).reshape(n, -1)


def _scales_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: a super-block's 12 scale bytes [..., 12] -> its 8 sub-blocks' 6-bit sc and m."""
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, m


def _pack(q: torch.Tensor, kind: QuantKind) -> torch.Tensor:
    """Blocks' integer values [n, nb, 32] (uint8, unsigned) -> their bytes in the kernel's layout
    [n, nb, 16 | 20 | 24]: the low nibbles, then (Q5_K) the fifth bits or (Q6_K) the 2-bit highs."""
    low = q & 15
    parts = [low[..., :16] | (low[..., 16:] << 4)]
    if kind in ("Q5_K", "Q5_0", "Q5_1"):
        h = (q >> 4).reshape(*q.shape[:-1], 8, 4)  # [k, i]: weight 4 k + i
        parts.append(sum((h[..., k, :] << k for k in range(8)), torch.zeros_like(h[..., 0, :])))
    if kind == "Q6_K":
        h = (q >> 4).reshape(*q.shape[:-1], 4, 8)  # [k, i]: weight 8 k + i
        parts.append(sum((h[..., k, :] << (2 * k) for k in range(4)), torch.zeros_like(h[..., 0, :])))
    return torch.cat(parts, dim=-1)


def _unpack(blocks: torch.Tensor, kind: QuantKind) -> torch.Tensor:
    """_pack's inverse: [n, nb, bytes] -> [n, nb, 32] uint8."""
    q = torch.cat([blocks[..., :16] & 15, blocks[..., :16] >> 4], dim=-1)
    if kind in ("Q5_K", "Q5_0", "Q5_1"):
        hb = blocks[..., 16:20]
        q = q | (torch.stack([(hb >> k) & 1 for k in range(8)], dim=-2).flatten(-2) << 4)
    if kind == "Q6_K":
        hb = blocks[..., 16:24]
        q = q | (torch.stack([(hb >> (2 * k)) & 3 for k in range(4)], dim=-2).flatten(-2) << 4)
    return q


def _regroup_k(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])
    sb = b.shape[1]
    if kind == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, sb, 2, 2, 32), b[..., 128:192].reshape(n, sb, 2, 32)
        low = torch.stack(
            [ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], 3
        )
        high = torch.stack([(qh >> (2 * j)) & 3 for j in range(4)], dim=3)
        q = (low | (high << 4)).reshape(n, sb * 8, 32)  # block 4 half + quarter of each super-block
        scales = b[..., 192:208].reshape(n, sb, 8, 2)  # 16-weight halves: (block, first | second)
        heads = [b[..., 208:210].reshape(n, -1), scales.transpose(2, 3).reshape(n, -1)]
    else:
        quants = b[..., 48:176] if kind == "Q5_K" else b[..., 16:144]
        qs = quants.reshape(n, sb, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, sb, 8, 32)  # sub-block 2 c + h
        if kind == "Q5_K":
            qh = b[..., 16:48]
            q = q | (torch.stack([(qh >> j) & 1 for j in range(8)], dim=2) << 4)
        q = q.reshape(n, sb * 8, 32)
        sc, m = _scales_k4(b[..., 4:16])
        heads = [b[..., 0:2].reshape(n, -1), b[..., 2:4].reshape(n, -1), sc.reshape(n, -1), m.reshape(n, -1)]
    return torch.cat([*heads, _pack(q, kind).reshape(n, -1)], dim=1).contiguous()


def _regroup_q5(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])
    h = 4 if kind == "Q5_1" else 2  # f16 bytes before the fifth bits
    qh = b[..., h : h + 4]  # little-endian: bit j of the 32 is weight j
    fifth = torch.stack([(qh[..., j // 8] >> (j % 8)) & 1 for j in range(32)], dim=-1)
    qs = b[..., h + 4 :]
    q = torch.cat([qs & 15, qs >> 4], dim=-1) | (fifth << 4)
    heads = [b[..., i : i + 2].reshape(n, -1) for i in range(0, h, 2)]
    return torch.cat([*heads, _pack(q, kind).reshape(n, -1)], dim=1).contiguous()


def _dequantize_q5(kind: QuantKind, rows: torch.Tensor) -> torch.Tensor:
    n = rows.shape[0]
    nb = rows.shape[1] // BLOCK_BYTES[kind]
    d = _f16(rows[:, : 2 * nb].reshape(-1, 2)).reshape(n, nb, 1)
    h = 4 if kind == "Q5_1" else 2
    q = _unpack(rows[:, h * nb :].reshape(n, nb, 20), kind)
    if kind == "Q5_0":
        return (d * (q.to(torch.int8) - 16).float()).reshape(n, -1)
    m = _f16(rows[:, 2 * nb : 4 * nb].reshape(-1, 2)).reshape(n, nb, 1)
    return (d * q.float() + m).reshape(n, -1)


def _dequantize_k(kind: QuantKind, rows: torch.Tensor) -> torch.Tensor:
    """A k-quant weight's rows in the kernel's layout -> float32 [n, K], the reference's formulas."""
    n = rows.shape[0]
    sb = rows.shape[1] // _LAYOUT_BYTES[kind]
    nb = 8 * sb
    d = _f16(rows[:, : 2 * sb].reshape(-1, 2)).reshape(n, sb)
    if kind == "Q6_K":
        scales = rows[:, 2 * sb : 18 * sb].contiguous().view(torch.int8).reshape(n, sb, 2, 8).transpose(2, 3)
        q = _unpack(rows[:, 18 * sb :].reshape(n, nb, 24), kind).to(torch.int8) - 32
        scale = d[:, :, None, None] * scales.float()  # [n, sb, 8, 2]: per 16 weights
        return (scale.reshape(n, nb, 2, 1) * q.reshape(n, nb, 2, 16).float()).reshape(n, -1)
    dmin = _f16(rows[:, 2 * sb : 4 * sb].reshape(-1, 2)).reshape(n, sb)
    sc, m = rows[:, 4 * sb : 4 * sb + nb], rows[:, 4 * sb + nb : 4 * sb + 2 * nb]
    q = _unpack(rows[:, 4 * sb + 2 * nb :].reshape(n, nb, 16 if kind == "Q4_K" else 20), kind)
    scale = (d.repeat_interleave(8, dim=1) * sc.float())[..., None]
    low = (dmin.repeat_interleave(8, dim=1) * m.float())[..., None]
    return (scale * q.float() - low).reshape(n, -1)


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as `blocks` ([N, K / 32 * BLOCK_BYTES[kind]] uint8, contiguous, in the
    kernel's row layout: `from_gguf` makes one from a file's blocks)."""

    kind: QuantKind
    blocks: torch.Tensor
    in_features: int  # K

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.in_features % block_weights(self.kind) == 0, self.in_features
        assert self.blocks.dtype == torch.uint8 and self.blocks.dim() == 2, (
            self.blocks.dtype,
            self.blocks.shape,
        )
        assert self.blocks.shape[1] == row_bytes(self.kind, self.in_features), self.blocks.shape

    @classmethod
    def from_gguf(cls, kind: QuantKind, raw: torch.Tensor, in_features: int) -> QuantWeight:
        """From a GGUF tensor's bytes ([N, K / 32 * block bytes] uint8, blocks back to back)."""
        return cls(kind, regroup(kind, raw), in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.in_features)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix (each value exact in float32, then cast to `dtype`)."""
        return _dequantize_rows(self.kind, self.blocks).reshape(self.shape).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized, [*ids.shape, K] (an embedding lookup)."""
        picked = self.blocks.index_select(0, ids.reshape(-1).to(self.device))
        return _dequantize_rows(self.kind, picked).reshape(*ids.shape, self.in_features).to(dtype)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.kind, self.blocks.to(device), self.in_features)


def _dequantize_rows(kind: QuantKind, rows: torch.Tensor) -> torch.Tensor:
    """Rows in the kernel's layout -> float32 [n, K] (the reference's values)."""
    if kind in K_KINDS:
        return _dequantize_k(kind, rows)
    if kind in ("Q5_0", "Q5_1"):
        return _dequantize_q5(kind, rows)
    return dequantize_blocks(kind, ungroup(kind, rows)).reshape(rows.shape[0], -1)


def quantize_q8_0(w: torch.Tensor) -> QuantWeight:
    """A dense [N, K] matrix (K a multiple of 32) as Q8_0 blocks, by ggml's reference: per block
    d = amax / 127 (stored as f16), q = roundf(x / d) with 1 / d computed once (0 for an all-zero
    block), ties away from zero. The bytes equal the `gguf` package's quantize."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)
    raw = torch.cat([d.half().view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8)], dim=-1)
    return QuantWeight.from_gguf("Q8_0", raw.reshape(n, -1), k)


def quantize_q4_k(w: torch.Tensor) -> QuantWeight:
    """`q4_k_bytes` as a block weight (the kernel's layout)."""
    return QuantWeight.from_gguf("Q4_K", q4_k_bytes(w), w.shape[1])


def q4_k_bytes(w: torch.Tensor) -> torch.Tensor:
    """A dense [N, K] matrix (K a multiple of 256) as GGUF Q4_K blocks [N, K / 256 * 144]: per sub-block of 32 the range
    [min(x, 0), max(x)] in 16 steps; per super-block of 8 the scales' and the offsets' largest
    over 63 as the f16 d and dmin; each sub-block's 6-bit scale rounded up (so the range fits)
    and its offset to nearest; q = round((x + dmin m) / (d sc)) in 0..15. A value's error is at
    most half a step plus half of dmin. (ggml refines each sub-block's scale and offset by a
    search; this is its plain min-max start: a little less accurate, never out of range.)"""
    n, k = w.shape
    x = w.float().reshape(n, k // SUPER, 8, BLOCK)
    low = x.amin(-1).clamp(max=0)
    scale = (x.amax(-1) - low) / 15
    d = (scale.amax(-1) / 63).half()
    dmin = (-low).amax(-1).div(63).half()
    df, dminf = d.float()[..., None], dmin.float()[..., None]
    sc = torch.where(df > 0, torch.ceil(scale / torch.where(df > 0, df, 1)), 0).clamp(0, 63)
    m = torch.where(dminf > 0, torch.round(-low / torch.where(dminf > 0, dminf, 1)), 0).clamp(0, 63)
    step, offset = df * sc, dminf * m
    q = torch.where(
        step[..., None] > 0,
        torch.round((x + offset[..., None]) / torch.where(step > 0, step, 1)[..., None]),
        0,
    )
    q = q.clamp(0, 15).to(torch.uint8)  # [n, sb, 8, 32]
    sc8, m8 = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.cat(  # the 12-byte packing _scales_k4 reads
        [
            sc8[..., :4] | ((sc8[..., 4:] >> 4) << 6),
            m8[..., :4] | ((m8[..., 4:] >> 4) << 6),
            (sc8[..., 4:] & 15) | ((m8[..., 4:] & 15) << 4),
        ],
        dim=-1,
    )
    pairs = q.reshape(n, k // SUPER, 4, 2, BLOCK)  # chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // SUPER, 128)
    raw = torch.cat(
        [d.view(torch.uint8).reshape(n, -1, 2), dmin.view(torch.uint8).reshape(n, -1, 2), scales, qs], dim=-1
    )
    return raw.reshape(n, -1).contiguous()


@dataclass(frozen=True)
class QuantRows:
    """Block weights of different kinds stacked along N (a fused projection whose parts cannot
    share one kind: a Q4_K_M file's Q4_K q / k beside a Q6_K v); each part is multiplied by its
    own kernel and the results laid side by side, so every output has its part's bits."""

    parts: tuple[QuantWeight, ...]

    def __post_init__(self) -> None:
        assert len(self.parts) > 1 and len({p.in_features for p in self.parts}) == 1, self.parts

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].in_features)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def to(self, device: torch.device | str) -> QuantRows:
        return QuantRows(tuple(p.to(device) for p in self.parts))


Weight: TypeAlias = torch.Tensor | QuantWeight | QuantRows  # a projection's weight: dense or in blocks


_Q8_0_OFFSET: dict[QuantKind, int] = {"Q8_0": 0, "Q4_0": 8, "Q5_0": 16}  # w = d (q - offset): Q8_0 exactly


def _as_q8_0(w: QuantWeight) -> QuantWeight:
    """A Q8_0, Q4_0 or Q5_0 weight as Q8_0 blocks of the same values (the same d, q - offset)."""
    if w.kind == "Q8_0":
        return w
    n, nb = w.blocks.shape[0], w.in_features // BLOCK
    size = 20 if w.kind == "Q5_0" else 16
    q = _unpack(w.blocks[:, 2 * nb :].reshape(n, nb, size), w.kind)
    signed = (q.to(torch.int16) - _Q8_0_OFFSET[w.kind]).to(torch.int8)
    rows = torch.cat([w.blocks[:, : 2 * nb], signed.view(torch.uint8).reshape(n, -1)], dim=1)
    return QuantWeight("Q8_0", rows.contiguous(), w.in_features)


def cat_rows(parts: Sequence[torch.Tensor | QuantWeight], dtype: torch.dtype) -> Weight:
    """The parts stacked along N (a fused projection): one block matrix when every part has the
    same kind (or each is Q8_0, Q4_0 or Q5_0: then Q8_0 blocks of the same values, as a Q4_K_M
    file's fallback Q5_0 q / k beside a Q8_0 v), QuantRows when the kinds differ otherwise, else
    (a dense part among them) the dense matrices in `dtype` (the model's)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        qs = [p for p in parts if isinstance(p, QuantWeight)]
        kinds = {p.kind for p in qs}
        if len(kinds) > 1 and kinds <= set(_Q8_0_OFFSET):
            qs, kinds = [_as_q8_0(p) for p in qs], {"Q8_0"}
        if len(kinds) > 1:  # runs of one kind joined: q and k of Q4_K stay one matrix
            runs: list[list[QuantWeight]] = []
            for q in qs:
                if runs and runs[-1][0].kind == q.kind:
                    runs[-1].append(q)
                else:
                    runs.append([q])
            return QuantRows(
                tuple(
                    QuantWeight(r[0].kind, torch.cat([q.blocks for q in r]), r[0].in_features) for r in runs
                )
            )
        if len(kinds) == 1:
            return QuantWeight(qs[0].kind, torch.cat([q.blocks for q in qs]), qs[0].in_features)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantWeight) else p.to(dtype) for p in parts])


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """F.embedding for a dense or block weight."""
    if isinstance(weight, QuantWeight):
        return weight.rows(ids, dtype)
    return torch.nn.functional.embedding(ids, weight)
