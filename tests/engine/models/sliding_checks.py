"""Checks shared by the sliding families' tests (test_laguna.py, test_gpt_oss.py): parity with
the transformers model the checkpoint was saved from, chunking, batched step, and snapshots
of sliding layers (min(p, W) rows in position order) adopted in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.cache.snapshot_file import write_snapshot
from keepwarm.engine.models.backend import State
from keepwarm.engine.models.sliding import SLIDING, SlidingKvBackend

ROOT = Path(__file__).resolve().parents[3]
ATOL = 1e-4


def randomize(model: Any, seed: int) -> Any:
    """Weights large enough for peaked logits; norms, biases, sinks and the router's selection
    bias away from their inits so that each is really tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "sinks" in name else 0.3))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "experts" in name and p.dim() == 3 and "gpt_oss" in type(model).__module__:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-2] ** -0.5)  # [E, in, out]
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def check_logits(ref: Any, ours: SlidingKvBackend, n: int) -> None:
    toks = prompt(n, ours.vocab_size, seed=n)
    with torch.no_grad():
        want = ref(toks[None]).logits[0].float()
    assert want.std().item() > 0.5  # peaked, informative logits
    got = ours.forward(ours.new_state(n + 4), toks, all_logits=True)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= ATOL


def check_greedy(ref: Any, ours: SlidingKvBackend, n: int = 11, new: int = 32, seed: int = 2) -> None:
    toks = prompt(n, ours.vocab_size, seed=seed)
    with torch.no_grad():
        out = ref.generate(
            toks[None], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    want = out[0, n:].tolist()
    state = ours.new_state(n + new)
    logits = ours.prefill(state, toks)
    got = []
    for _ in range(new):
        got.append(int(logits.argmax()))
        logits = ours.decode(state, got[-1])
    assert got == want, (got, want)
    assert len(set(got)) > 3  # a varied continuation, not one token repeated


def check_chunked(ours: SlidingKvBackend, chunk: int) -> None:
    n = 30 if chunk == 1 else 70  # one forward per token is the slow one
    toks = prompt(n, ours.vocab_size, seed=3)
    one_state = ours.new_state(n + 1)
    one = ours.forward(one_state, toks, all_logits=True)
    state = ours.new_state(n + 1)
    parts = [ours.forward(state, toks[i : i + chunk], all_logits=True) for i in range(0, n, chunk)]
    assert state.position == n
    # float32 noise only (logits reach ~30 here: 1e-4 is a few ulps)
    assert (torch.cat(parts) - one).abs().max().item() <= ATOL
    for name, t in ours.export(one_state).tensors.items():  # the same rows, in the same order
        tol = ATOL if name == LOGITS else 1e-5  # K/V rows are O(1), logits reach ~30
        assert (ours.export(state).tensors[name] - t).abs().max().item() <= tol, name
    assert (ours.decode(state, 5) - ours.decode(one_state, 5)).abs().max().item() <= ATOL


def _states(ours: SlidingKvBackend, window: int) -> tuple[list[State], list[torch.Tensor]]:
    """Sequences in different phases: fresh (a chunk longer than the window), mid-prefill,
    decoding past the window (its ring has wrapped), decoding before it."""
    plan = [(0, 2 * window + 3), (5, 7), (window + 9, 1), (3, 1), (0, 1)]
    states, chunks = [], []
    for k, (pre, n) in enumerate(plan):
        st = ours.new_state(pre + n + 2)
        if pre:
            ours.prefill(st, prompt(pre, ours.vocab_size, seed=10 + k))
        states.append(st)
        chunks.append(prompt(n, ours.vocab_size, seed=20 + k))
    return states, chunks


def check_step(ours: SlidingKvBackend, window: int) -> None:
    a, chunks = _states(ours, window)
    b, _ = _states(ours, window)
    batched = ours.step(a, chunks)
    each = torch.stack([ours.prefill(s, c) for s, c in zip(b, chunks, strict=True)])
    assert batched.shape == (len(chunks), ours.vocab_size) and batched.dtype == torch.float32
    assert batched.argmax(-1).tolist() == each.argmax(-1).tolist()
    assert (batched - each).abs().max().item() <= ATOL
    for k, (sa, sb) in enumerate(zip(a, b, strict=True)):
        assert sa.position == sb.position and sa.logits is not None and torch.equal(sa.logits, batched[k])
    # and the next step (all decodes) still agrees: the caches were written identically
    nxt = [torch.tensor([int(x)]) for x in batched.argmax(-1)]
    again = ours.step(a, nxt)
    assert (
        again - torch.stack([ours.prefill(s, c) for s, c in zip(b, nxt, strict=True)])
    ).abs().max() <= ATOL


def sliding_layers(ours: SlidingKvBackend) -> list[int]:
    return [i for i, t in enumerate(ours.layout.layer_types) if t == SLIDING]


def check_snapshot_rows(ours: SlidingKvBackend, snap: Snapshot, window: int) -> None:
    p = snap.position
    for i, kind in enumerate(ours.layout.layer_types):
        rows = min(p, window) if kind == SLIDING else p
        assert snap.tensors[f"layers.{i}.k"].shape[0] == rows, (i, p)
        assert snap.tensors[f"layers.{i}.v"].shape[0] == rows, (i, p)


def check_snapshots_in_fresh_process(ours: SlidingKvBackend, model_dir: Path, tmp: Path, window: int) -> None:
    """Snapshots below, at and above the window, written as files, adopted in a new interpreter
    and continued: bit-identical to the run that never stopped (same chunk boundaries)."""
    points = [window - 3, window, window + 5]
    n = window + 12
    toks = prompt(n, ours.vocab_size, seed=4)
    follow = [7, 3, 11, 5, 2, 9]
    live = ours.new_state(n + len(follow))
    bounds = [0, *points, n]
    files = {}
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        ours.prefill(live, toks[lo:hi])
        if hi in points:
            snap = ours.export(live)
            check_snapshot_rows(ours, snap, window)
            path = tmp / f"snap-{hi}.safetensors"
            assert write_snapshot(
                path, namespace="t", key=str(hi), tokens=toks[:hi].tolist(), snapshot=snap, fsync=False
            )
            files[hi] = path
    want = [live.logits.clone()] + [ours.decode(live, t) for t in follow]
    out = tmp / "continued.pt"
    code = f"""
import torch
from pathlib import Path
from keepwarm.engine.cache.snapshot_file import read_snapshot
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.kernels.ops import TORCH_OPS
torch.set_num_threads({torch.get_num_threads()})  # the same reduction order as this process
b = build_backend(open_checkpoint({str(model_dir)!r}), torch.device("cpu"), torch.float32, TORCH_OPS)
toks, bounds, files, follow = {toks.tolist()!r}, {bounds!r}, {dict((k, str(v)) for k, v in files.items())!r}, {follow!r}
out = {{}}
for p, f in files.items():
    snap, _ = read_snapshot(Path(f), namespace="t")
    st = b.adopt(snap, {n + len(follow)})
    for lo, hi in zip(bounds, bounds[1:]):
        if lo >= p:
            b.prefill(st, torch.tensor(toks[lo:hi]))
    out[p] = [st.logits.clone()] + [b.decode(st, t) for t in follow]
torch.save(out, {str(out)!r})
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(out)
    assert sorted(got) == points
    for p in points:
        for x, y in zip(got[p], want, strict=True):
            assert torch.equal(x, y), p


def check_views_survive_the_ring_wrapping(ours: SlidingKvBackend, window: int) -> None:
    """An exported view of an unwrapped ring stays valid while the live state wraps it."""
    toks = prompt(window + 20, ours.vocab_size, seed=6)
    live = ours.new_state(window + 21)
    ours.prefill(live, toks[: window - 2])
    snap = ours.export(live)
    frozen = snap.detached()
    ours.prefill(live, toks[window - 2 :])  # wraps every sliding ring
    for name, t in frozen.tensors.items():
        assert torch.equal(snap.tensors[name], t), name
