"""State, snapshots and attention for families whose layers are full or sliding-window
attention (laguna, gpt_oss, gemma3; dense is the case with every layer full): the shared half of
those backends. `KvStateBackend` owns the state (new_state, export, adopt); a sliding family
subclasses `SlidingKvBackend` and writes only its per-token math (`_hidden`: embeddings to final
hidden states), calling `Batch.attend` for each attention layer. Dense subclasses
`KvStateBackend` and keeps its own forward (its fused decode step, kernels/cpu_decode_step.py).

State, by canonical name (docs/architecture.md, 'Model families', 'The backend contract'):
  full layer i:    `layers.{i}.k` / `.v`  [capacity, Hkv, D]  row a = position a
  sliding layer i: `layers.{i}.k` / `.v`  [R, Hkv, D], R = min(W, capacity): a ring, position
                   a at row a % R; only the last W positions are ever read
  `sidecar.logits` [vocab] float32
Each layer's K/V lives on its stage's device (models/placement.py); logits on the last stage's.
Snapshot at position p: full layers rows 0..p-1; sliding layers exactly min(p, W) rows,
positions p - min(p, W) .. p-1 in position order, so the file does not depend on the ring's
rotation. Adopt puts each row back at row a % R, which makes the adopted ring identical to
the live one it was taken from (and so the continuation bit-identical).

Invariant: K/V rows are written in place, and a full layer's rows below `position` are never
rewritten; an exported view of a sliding ring (taken before it wrapped) stays valid because
the first write that would wrap over it replaces the ring by a copy first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.loading.checkpoint import CheckpointError
from keepwarm.engine.models.backend import State
from keepwarm.engine.models.geometry import Geometry, SnapshotMismatch, TensorSpec, all_rows
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope
from keepwarm.engine.models.step import BatchedForward, head_rows
from keepwarm.kernels.ops import Ops
from keepwarm.kernels.sliding_attention import SlidingAttentionOps

FULL = "full_attention"
SLIDING = "sliding_attention"
_RING_VIEWS = "ring_views"  # State.extra flag: export handed out views of unwrapped rings


@dataclass(frozen=True)
class WindowRows:
    """Rows a sliding layer's snapshot holds at a position: min(position, window)."""

    window: int

    def __call__(self, position: int) -> int:
        return min(position, self.window)

    @property
    def layout_key(self) -> str:
        """Part of Geometry.layout_id (and so of the cache namespace): another window, other rows."""
        return f"window={self.window}"


@dataclass(frozen=True)
class KvLayout:
    """Which layers are sliding, the window, and the K/V row shape (shared by all layers)."""

    layer_types: tuple[str, ...]
    window: int
    num_kv_heads: int
    head_dim: int

    @staticmethod
    def all_full(num_layers: int, num_kv_heads: int, head_dim: int) -> KvLayout:
        """Every layer full attention (no window: nothing is a ring)."""
        return KvLayout((FULL,) * num_layers, 0, num_kv_heads, head_dim)

    def ring_size(self, capacity: int) -> int:
        return min(self.window, capacity)

    def geometry(self, dtype: torch.dtype, vocab_size: int) -> Geometry:
        specs: list[TensorSpec] = []
        row = (-1, self.num_kv_heads, self.head_dim)
        for i, kind in enumerate(self.layer_types):
            rows = WindowRows(self.window) if kind == SLIDING else all_rows
            for part in ("k", "v"):
                specs.append(TensorSpec(f"layers.{i}.{part}", dtype, row, length_dim=0, rows=rows))
        specs.append(TensorSpec(LOGITS, torch.float32, (vocab_size,)))
        return Geometry(tuple(specs))


def check_layer_types(layer_types: Sequence[str], num_layers: int, window: object) -> tuple[str, ...]:
    """Validated `layer_types` (config.json) with the sliding window they need."""
    out = tuple(str(t) for t in layer_types)
    if len(out) != num_layers:
        raise CheckpointError(
            f"config.json: layer_types has {len(out)} entries, num_hidden_layers is {num_layers}"
        )
    bad = sorted({t for t in out if t not in (FULL, SLIDING)})
    if bad:
        raise CheckpointError(f"config.json: layer_types {bad} unknown (use {FULL!r} or {SLIDING!r})")
    if SLIDING in out and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise CheckpointError(
            f"config.json: sliding_window must be a positive integer for sliding_attention layers, got {window!r}"
        )
    return out


class Batch:
    """One forward over several sequences: their tokens are concatenated along dim 0
    (`offsets[b]` .. `offsets[b + 1]` are sequence b's), each starting at its state's position."""

    def __init__(self, backend: SlidingKvBackend, states: Sequence[State], chunks: Sequence[torch.Tensor]):
        self.backend = backend
        self.states = list(states)
        self.starts = [s.position for s in states]
        self.lengths = [int(c.shape[0]) for c in chunks]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def cos_sin(self, rope: Rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, Dr] at every token's absolute position."""
        parts = [rope.cos_sin(s, n, dtype) for s, n in zip(self.starts, self.lengths, strict=True)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer i's attention for every token: q [N, Hq, D], this step's k, v [N, Hkv, D]
        (written into each sequence's cache) -> [N, Hq, D]. Per sequence; decode (one token)
        reads the cache in place, a chunk attends [earlier rows it can see | its own rows].
        With the invariant bundle (ops.attention not None), decode and chunks alike run the
        kernel over the rows in absolute order (key tiles at absolute positions), so a row's
        bits do not depend on the chunking."""
        b = self.backend
        window = b.layout.window if b.layout.layer_types[i] == SLIDING else None
        attn = b.attention
        outs = []
        for st, start, n, o in zip(self.states, self.starts, self.lengths, self.offsets, strict=False):
            qs, ks, vs = q[o : o + n], k[o : o + n], v[o : o + n]
            k_buf, v_buf = st.tensors[f"layers.{i}.k"], st.tensors[f"layers.{i}.v"]
            end = start + n
            fast = self._invariant(b.ops, qs, ks, vs, k_buf, v_buf, start, window, scale, sinks)
            if fast is not None:
                outs.append(fast)
                continue
            if window is None:
                k_buf[start:end] = ks
                v_buf[start:end] = vs
                if n == 1:
                    outs.append(attn.decode(qs[0], k_buf, v_buf, scale, start, None, sinks).unsqueeze(0))
                else:
                    outs.append(attn.prefill(qs, k_buf[:end], v_buf[:end], scale, None, sinks))
                continue
            r = k_buf.shape[0]
            if n == 1:
                k_buf[start % r] = ks[0]
                v_buf[start % r] = vs[0]
                outs.append(attn.decode(qs[0], k_buf, v_buf, scale, start, window, sinks).unsqueeze(0))
                continue
            prev = min(start, window - 1)  # earlier rows the chunk's first query can see
            if prev:
                idx = torch.arange(start - prev, start, device=k_buf.device) % r
                kc = torch.cat([k_buf.index_select(0, idx), ks])
                vc = torch.cat([v_buf.index_select(0, idx), vs])
            else:
                kc, vc = ks, vs
            outs.append(attn.prefill(qs, kc, vc, scale, window, sinks))
            keep = min(n, r)  # only the last R rows of the chunk survive in the ring
            slots = torch.arange(end - keep, end, device=k_buf.device) % r
            k_buf.index_copy_(0, slots, ks[n - keep :])
            v_buf.index_copy_(0, slots, vs[n - keep :])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _invariant(
        ops: Ops,
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        start: int,
        window: int | None,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One sequence's attention through ops.attention, writing its rows into the cache;
        None where the bundle has no kernel for these inputs (a ring is then untouched; a full
        layer's rows are written, as the torch path writes them again)."""
        n, end = qs.shape[0], start + qs.shape[0]
        if window is None:  # keys 0 .. end - 1: the rows written first (the torch path writes the same)
            k_buf[start:end] = ks
            v_buf[start:end] = vs
            return ops.attention(qs, k_buf[:end], v_buf[:end], scale, sinks=sinks)
        r = k_buf.shape[0]
        prev = min(start, window - 1)  # earlier rows the chunk's first query can see
        idx = torch.arange(start - prev, start, device=k_buf.device) % r
        kc = torch.cat([k_buf.index_select(0, idx), ks])
        vc = torch.cat([v_buf.index_select(0, idx), vs])
        out = ops.attention(qs, kc, vc, scale, window=window, offset=start - prev, sinks=sinks)
        if out is not None:
            keep = min(n, r)  # only the last R rows of the chunk survive in the ring
            slots = torch.arange(end - keep, end, device=k_buf.device) % r
            k_buf.index_copy_(0, slots, ks[n - keep :])
            v_buf.index_copy_(0, slots, vs[n - keep :])
        return out


class KvStateBackend:
    """The state half of the Backend contract (models/backend.py: new_state, export, adopt) for
    families whose state is one K/V cache per attention layer, full or sliding: the sliding
    families below and dense (every layer full attention, `KvLayout.all_full`)."""

    def __init__(self, layout: KvLayout, vocab_size: int, placement: Placement, dtype: torch.dtype) -> None:
        self.layout = layout
        self.vocab_size = vocab_size
        self.placement = placement
        self.device = placement.first  # where tokens enter; logits come out on placement.last
        self.dtype = dtype
        self.geometry = layout.geometry(dtype, vocab_size)

    def new_state(self, capacity: int) -> State:
        if capacity < 1:
            raise ValueError(f"state capacity must be >= 1 token, got {capacity}")
        lay = self.layout
        ring = lay.ring_size(capacity)
        tensors = {}
        for i, kind in enumerate(lay.layer_types):
            rows = ring if kind == SLIDING else capacity
            for part in ("k", "v"):
                tensors[f"layers.{i}.{part}"] = torch.empty(
                    (rows, lay.num_kv_heads, lay.head_dim),
                    dtype=self.dtype,
                    device=self.placement.device_of(i),
                )
        return State(capacity=capacity, tensors=tensors)

    def export(self, state: State) -> Snapshot:
        assert state.logits is not None, "export needs at least one token of state"
        p = state.position
        lay = self.layout
        out: dict[str, torch.Tensor] = {}
        for i, kind in enumerate(lay.layer_types):
            for part in ("k", "v"):
                name = f"layers.{i}.{part}"
                t = state.tensors[name]
                if kind == FULL or p <= t.shape[0]:
                    out[name] = t[:p]  # in position order already: a view
                else:  # a wrapped ring: its last min(p, W) positions, rotated into order (a copy)
                    r = t.shape[0]
                    out[name] = torch.cat([t[p % r :], t[: p % r]])
        if SLIDING in lay.layer_types and p <= lay.ring_size(state.capacity):
            state.extra[_RING_VIEWS] = True
        out[LOGITS] = state.logits
        return Snapshot(p, out)

    def adopt(self, snapshot: Snapshot, capacity: int, into: State | None = None) -> State:
        p = snapshot.position
        if p < 1:
            raise SnapshotMismatch(f"snapshot position {p} is invalid (a snapshot covers at least one token)")
        if p > capacity:
            raise SnapshotMismatch(
                f"snapshot covers {p} tokens, capacity is {capacity}: allocate a larger state"
            )
        self.geometry.validate(snapshot.tensors, p)  # every name, dtype and row count before any write
        reuse = into is not None and into.capacity == capacity and into.tensors.keys() == self.new_keys()
        state = into if reuse and into is not None else self.new_state(capacity)
        state.extra.clear()
        for i, kind in enumerate(self.layout.layer_types):
            for part in ("k", "v"):
                name = f"layers.{i}.{part}"
                src, buf = snapshot.tensors[name], state.tensors[name]
                if kind == FULL or p <= buf.shape[0]:
                    if buf[:p].data_ptr() != src.data_ptr():  # equal when a restore read straight into `into`
                        buf[:p].copy_(src)
                else:
                    r = buf.shape[0]
                    slots = torch.arange(p - src.shape[0], p, device=buf.device) % r
                    buf.index_copy_(0, slots, src.to(buf.device))
        state.position = p
        state.logits = snapshot.tensors[LOGITS].to(self.placement.last, torch.float32, copy=True)
        return state

    def new_keys(self) -> set[str]:
        return {s.name for s in self.geometry.specs if s.name != LOGITS}


class SlidingShape(Protocol):
    """What a sliding family's config tells the shared half: its layers' kinds and K/V shape."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def layer_types(self) -> Sequence[str]: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class Ends:
    """A model's weights outside its layers: the embedding on the first stage, the final norm
    and the output projection on the last."""

    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


L = TypeVar("L")


class SlidingKvBackend(BatchedForward, KvStateBackend, Generic[L]):
    """The Backend contract (models/backend.py) for full + sliding attention families, minus
    the family's math (`_hidden`, `_logits`). `ropes` maps each layer kind to its rotary
    embedding (one object for both kinds where they share it)."""

    family: str

    def __init__(
        self,
        shape: SlidingShape,
        ropes: dict[str, Rope],
        ends: Ends,
        layers: list[L],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        layout = KvLayout(tuple(shape.layer_types), shape.sliding_window, shape.num_kv_heads, shape.head_dim)
        super().__init__(layout, shape.vocab_size, placement, dtype)
        self.ropes, self.layers, self.ops = ropes, layers, ops
        self.embed, self.final_norm, self.lm_head = ends.embed, ends.final_norm, ends.lm_head
        self.attention: SlidingAttentionOps = placement.sliding_attention()  # the one place it is chosen

    def _cos_sin(self, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer kind's rotary cos/sin at the batch's positions (once per rope object)."""
        by_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rope in self.ropes.values():
            if id(rope) not in by_rope:
                by_rope[id(rope)] = batch.cos_sin(rope, self.dtype)
        return {kind: by_rope[id(rope)] for kind, rope in self.ropes.items()}

    def _to_stage(
        self, i: int, x: torch.Tensor, cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Before layer i: at a stage boundary the hidden state and the positions move on."""
        dev = self.placement.device_of(i)
        if x.device == dev:
            return x, cos_sin
        moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # kinds sharing a rope share its move
        for cos, sin in cos_sin.values():
            if id(cos) not in moved:
                moved[id(cos)] = (cos.to(dev), sin.to(dev))
        return x.to(dev), {t: moved[id(cos)] for t, (cos, _) in cos_sin.items()}

    # -- the family's part ---------------------------------------------------------
    def _hidden(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] int64 -> final hidden states [N, hidden] (before the final norm)."""
        raise NotImplementedError

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """final hidden states [M, hidden] -> logits [M, vocab] float32."""
        raise NotImplementedError

    # -- compute ---------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Projections and MoE over all sum(n_i) tokens at once, attention per sequence."""
        if not states or len(states) != len(chunks):
            raise ValueError(
                f"step needs one chunk per state, got {len(states)} states and {len(chunks)} chunks"
            )
        if len({id(s) for s in states}) != len(states):
            raise ValueError("step: a state appears twice; each sequence advances once per step")
        for st, c in zip(states, chunks, strict=True):
            if c.dim() != 1 or c.shape[0] == 0:
                raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(c.shape)}")
            end = st.position + int(c.shape[0])
            if end > st.capacity:
                raise ValueError(
                    f"state capacity {st.capacity} is too small for {end} tokens: allocate a larger state"
                )
            if st.extra.get(_RING_VIEWS) and end > self.layout.ring_size(st.capacity):
                # this step wraps rings that an exported snapshot still views: copy-on-write
                for i, kind in enumerate(self.layout.layer_types):
                    if kind == SLIDING:
                        for part in ("k", "v"):
                            name = f"layers.{i}.{part}"
                            st.tensors[name] = st.tensors[name].clone()
                del st.extra[_RING_VIEWS]
        batch = Batch(self, states, chunks)
        rows, lasts = head_rows(batch.lengths, heads)
        tokens = (
            torch.cat([c.to(self.device) for c in chunks]) if len(chunks) > 1 else chunks[0].to(self.device)
        )
        h = self._hidden(batch, tokens)
        if len(rows) < batch.num_tokens:
            h = h[torch.tensor(rows, device=h.device)]
        logits = self._logits(h)
        for b, st in enumerate(states):
            st.position = batch.starts[b] + batch.lengths[b]
            st.logits = logits[lasts[b]].clone()
        return logits
