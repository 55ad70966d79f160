"""Snapshot copies to host memory (generation/snapshot_copier.py) and how the engine lands
them: a copy owns its memory; every snapshot a request took is in the cache when the
request returns (CPU: the copy is done at once); pending copies enter the cache oldest
first; an admission waits for them all, a step that consults no cache does not; on a GPU
the copy runs on a side stream and keeps the values it started with."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.request import FinishEvent
from keepwarm.engine.generation.snapshot_copier import PendingSnapshot, SnapshotCopier
from tests.conftest import NO_GPU
from tests.engine.generation.test_batching import _prompt, _request, _tokens
from tests.engine.test_engine import SYSTEM, USER_TURNS, _cfg, _req


class InFlight:
    """The completion pair of a copy that has not finished: `done()` is False until
    `finish()` (or `wait()`, which stands for blocking until the copy ends)."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.waits = 0

    def finish(self) -> None:
        self.flag.set()

    def wait(self) -> None:
        self.waits += 1
        self.flag.set()

    def pending(self, host: Snapshot) -> PendingSnapshot:
        return PendingSnapshot(host, self.flag.is_set, self.wait)


def test_a_copy_of_cpu_tensors_is_done_at_once_and_owns_its_memory() -> None:
    live = torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6)
    logits = torch.linspace(-1.0, 1.0, 11)
    snap = Snapshot(20, {"layers.0.k": live[:20], LOGITS: logits})  # views, as export() gives
    pending = SnapshotCopier().start(snap)
    assert pending.done()
    copy = pending.wait()
    assert copy.position == 20 and list(copy.tensors) == ["layers.0.k", LOGITS]
    assert torch.equal(copy.tensors["layers.0.k"], torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6))
    assert torch.equal(copy.logits, torch.linspace(-1.0, 1.0, 11))
    live.fill_(7.0)  # the live state moves on
    logits.zero_()
    assert torch.equal(copy.tensors["layers.0.k"], torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6))
    assert torch.equal(copy.logits, torch.linspace(-1.0, 1.0, 11))


def test_every_snapshot_of_a_request_is_cached_when_it_returns(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "cache"))
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
        req = _req(messages, Policy("full"))
        prompt = engine.prepare(req)
        points = engine.snapshots.save_points(Policy("full"), "", prompt, 0)
        assert len(points) == 2  # the system prompt's end and the whole prompt
        first = engine.complete(req)
        assert (
            first.prefix_key is not None
            and first.prefix_tokens == len(prompt.tokens) + first.completion_tokens
        )
        keys = [engine.cache.key("", prompt.tokens[:p]) for p in points] + [first.prefix_key]
        assert engine.cache.memory is not None and engine.cache.disk is not None
        assert all(k in engine.cache.memory and engine.cache.disk.contains(k) for k in keys)
        assert not engine.snapshots.copies and not engine.has_work()
        assert engine.stats.snapshots_saved == 3
        # a second user behind the same system prompt restores it
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[1]}]
        second = engine.complete(_req(other, Policy("full")))
        assert second.timings.cache_source == "memory" and second.cached_tokens == points[0]
    finally:
        engine.close()


def _host_snapshot(engine: Engine, tokens: tuple[int, ...]) -> Snapshot:
    """A real host snapshot of the state after `tokens`."""
    state = engine.memory.allocate(len(tokens) + 1)
    assert state is not None
    engine.backend.prefill(state, torch.tensor(tokens))
    snap = engine.backend.export(state).detached()
    engine.memory.free(state)
    return snap


def test_pending_copies_land_oldest_first_and_a_step_with_no_work_waits_for_them(
    tiny_dense_model: Path,
) -> None:
    engine = Engine(_cfg(tiny_dense_model, None))
    try:
        tokens = _prompt(random.Random(1), 12, engine.backend.vocab_size)
        snap = _host_snapshot(engine, tokens)
        a, b, c = InFlight(), InFlight(), InFlight()
        a.finish()
        c.finish()
        for salt, copy in (("a", a), ("b", b), ("c", c)):
            engine.snapshots.copies.append((engine.cache.key(salt, tokens), list(tokens), copy.pending(snap)))
        memory = engine.cache.memory
        assert memory is not None
        key = {s: engine.cache.key(s, tokens) for s in "abc"}
        engine.snapshots.land(wait=False)
        assert memory.keys() == [key["a"]]  # c is done but waits behind b
        assert len(engine.snapshots.copies) == 2 and engine.has_work()
        b.finish()
        engine.snapshots.land(wait=False)
        assert memory.keys() == [key["a"], key["b"], key["c"]] and b.waits == 0
        assert not engine.has_work()
        # a step with nothing to schedule lands what is still in flight, waiting for it
        d = InFlight()
        engine.snapshots.copies.append((engine.cache.key("d", tokens), list(tokens), d.pending(snap)))
        assert engine.has_work()
        assert engine.step() == 0
        assert d.waits == 1 and memory.keys()[-1] == engine.cache.key("d", tokens)
        assert not engine.has_work()
    finally:
        engine.close()


def test_an_admission_waits_for_pending_copies_and_a_step_that_admits_none_does_not(
    tiny_dense_model: Path,
) -> None:
    engine = Engine(_cfg(tiny_dense_model, None, max_seqs=4))
    try:
        rng = random.Random(2)
        vocab = engine.backend.vocab_size
        prompt = _prompt(rng, 40, vocab)
        req = _request(prompt, 4, "full")
        cold = _tokens(list(engine.generate(req)))
        memory = engine.cache.memory
        assert memory is not None
        key = engine.cache.key("", prompt)
        found = memory.get(key)
        assert found is not None
        memory.remove(key)  # the prompt's snapshot is now only a copy in flight
        flight = InFlight()
        engine.snapshots.copies.append((engine.cache.key("", found[0]), found[0], flight.pending(found[1])))
        # a request that consults no cache is admitted and runs without waiting
        other = engine.submit(_request(_prompt(rng, 10, vocab), 8, "off"), lambda ev: None)
        assert engine.step() == 1 and other.state is not None
        assert flight.waits == 0 and key not in memory
        # the repeat's admission waits for the copy and restores the whole prompt from it
        events = list(engine.generate(req))
        assert flight.waits == 1
        fin = events[-1]
        assert isinstance(fin, FinishEvent)
        assert fin.timings.cache_source == "memory" and fin.cached_tokens == len(prompt)
        assert _tokens(events) == cold
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_a_cuda_copy_runs_beside_the_compute_stream_and_keeps_the_values_it_started_with() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    live = torch.arange(4096 * 64, dtype=torch.float32, device=dev).reshape(4096, 64)
    logits = torch.linspace(-1.0, 1.0, 1000, device=dev)
    snap = Snapshot(100, {"layers.0.k": live[:100], LOGITS: logits})
    want = {name: t.cpu() for name, t in snap.tensors.items()}
    compute = torch.cuda.current_stream(dev)
    pending = SnapshotCopier().start(snap)
    live.fill_(-1.0)  # the next step updates the state in place, right behind the copy's start
    logits.zero_()
    torch.cuda._sleep(2_000_000_000)  # then the compute stream stays busy for about a second
    copy = pending.wait()
    # the copy ended while work queued on the compute stream after it still runs: it ran on
    # another stream, and nothing made the host wait for the compute stream
    assert not compute.query()
    assert pending.done()
    for name, t in copy.tensors.items():
        assert t.device.type == "cpu" and t.is_pinned()
        assert torch.equal(t, want[name]), name
    torch.cuda.synchronize(dev)
    assert torch.equal(live[:100].cpu(), torch.full((100, 64), -1.0))
