"""Continuous batching through the whole engine, every family (float32): sequences
run together give what each gives alone; preemption under a tiny state budget
resumes with the same output; a cancel frees its memory; a random stress run ends
with every sequence finished and the memory back where it started."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import parse_policy
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
from keepwarm.engine.generation.sampling import SamplingParams
from keepwarm.engine.generation.sequence import Sequence, Status
from keepwarm.engine.generation.state_memory import StateMemory
from tests.engine.test_engine import _cfg

FAMILIES = {"dense": "tiny_dense_model", "hybrid": "tiny_hybrid_model", "deepseek_v4": "tiny_deepseek_model"}
LOGITS_ATOL = 1e-4  # the families' parity tolerance against transformers


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(FAMILIES[request.param])


class Tape:
    """Every logits row each sequence sampled from, by sequence id."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[int, list[torch.Tensor]] = defaultdict(list)
        inner = engine._sample

        def sample(seq: Sequence, logits: torch.Tensor) -> None:
            self.rows[seq.seq_id].append(logits.detach().float().clone())
            inner(seq, logits)

        engine._sample = sample  # type: ignore[method-assign]


def _prompt(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, min(vocab, 250)) for _ in range(n))


def _request(
    tokens: tuple[int, ...], max_tokens: int, policy: str = "off", salt: str = ""
) -> GenerateRequest:
    return GenerateRequest(
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        prompt_tokens=tokens,
        policy=parse_policy(policy),
        cache_salt=salt,
    )


def _solo(engine: Engine, req: GenerateRequest) -> tuple[list[int], list[torch.Tensor]]:
    tape = Tape(engine)
    events = list(engine.generate(req))
    fin = events[-1]
    assert isinstance(fin, FinishEvent)
    (rows,) = tape.rows.values()
    engine._sample = Engine._sample.__get__(engine)  # type: ignore[method-assign]
    return [ev.token_id for ev in events if not isinstance(ev, FinishEvent) and ev.token_id >= 0], rows


def _run_together(
    engine: Engine,
    reqs: list[GenerateRequest],
    should_stop: Callable[[int], Callable[[], bool]] | None = None,
    arrive_at: list[int] | None = None,
) -> tuple[dict[int, list[Any]], dict[int, list[torch.Tensor]], list[Sequence]]:
    """Submit `reqs` (request i at step arrive_at[i]) and step until all are done."""
    tape = Tape(engine)
    events: dict[int, list[Any]] = defaultdict(list)
    seqs: list[Sequence | None] = [None] * len(reqs)
    arrive = arrive_at or [0] * len(reqs)
    step = 0
    while True:
        for i, req in enumerate(reqs):
            if seqs[i] is None and arrive[i] <= step:
                stop = should_stop(i) if should_stop else (lambda: False)
                seqs[i] = engine.submit(req, events[i].append, stop)
        if all(s is not None and s.status is Status.FINISHED for s in seqs):
            break
        engine.step()
        step += 1
        assert step < 20_000, "the engine stopped making progress"
    engine._sample = Engine._sample.__get__(engine)  # type: ignore[method-assign]
    done = [s for s in seqs if s is not None]
    return events, {s.seq_id: tape.rows[s.seq_id] for s in done}, done


def _tokens(events: list[Any]) -> list[int]:
    return [ev.token_id for ev in events if not isinstance(ev, FinishEvent) and ev.token_id >= 0]


def test_sequences_run_together_equal_each_alone(model: Path) -> None:
    engine = Engine(_cfg(model, None, memory_budget=0, chunk_size=32, max_batch_tokens=48))
    try:
        rng = random.Random(7)
        vocab = engine.backend.vocab_size
        reqs = [_request(_prompt(rng, n, vocab), m) for n, m in ((5, 9), (70, 6), (23, 12), (41, 3))]
        solo = [_solo(engine, r) for r in reqs]
        assert engine.memory.used_bytes == 0
        events, rows, seqs = _run_together(engine, reqs)
        for i, s in enumerate(seqs):
            want_tokens, want_rows = solo[i]
            assert _tokens(events[i]) == want_tokens
            got = rows[s.seq_id]
            assert len(got) == len(want_rows)
            for a, b in zip(got, want_rows, strict=True):
                assert (a - b).abs().max().item() <= LOGITS_ATOL
        assert engine.stats.steps > 0 and engine.memory.used_bytes == 0
    finally:
        engine.close()


def test_a_batched_step_mixes_prefill_chunks_and_decodes(model: Path) -> None:
    engine = Engine(_cfg(model, None, memory_budget=0, chunk_size=16, max_batch_tokens=20))
    try:
        seen: list[list[int]] = []
        inner = engine.runner.run

        def run(batch: Any) -> Any:
            seen.append([b.num_tokens for b in batch])
            return inner(batch)

        engine.runner.run = run  # type: ignore[method-assign]
        rng = random.Random(1)
        vocab = engine.backend.vocab_size
        reqs = [_request(_prompt(rng, 6, vocab), 8), _request(_prompt(rng, 50, vocab), 4)]
        _run_together(engine, reqs, arrive_at=[0, 3])
        # the second prompt arrives while the first decodes: its chunks ride along with one
        # decode token per step, and no step exceeds the token budget
        assert [1, 16] in seen and all(sum(s) <= 20 for s in seen)
        assert max(len(s) for s in seen) == 2
    finally:
        engine.close()


def test_preemption_under_a_tiny_state_budget_resumes_with_the_same_output(model: Path) -> None:
    engine = Engine(_cfg(model, None, memory_budget=64 * 1024**2, chunk_size=32))
    try:
        rng = random.Random(3)
        vocab = engine.backend.vocab_size
        reqs = [_request(_prompt(rng, 12 + 3 * i, vocab), 40) for i in range(4)]
        solo = [_solo(engine, r) for r in reqs]
        # slots grow in 16-token blocks; the budget holds one whole sequence (at most 61
        # tokens: a 64-token slot) and a bit, so sequences growing together must preempt
        mem = StateMemory(engine.backend, 0, engine.cfg.max_context, block=16)
        mem.budget_bytes = mem.bytes_for(64) + mem.bytes_for(16) // 2
        engine.memory = mem
        events, rows, seqs = _run_together(engine, reqs)
        assert engine.stats.preemptions > 0
        assert sum(s.num_preemptions for s in seqs) == engine.stats.preemptions
        for i, s in enumerate(seqs):
            assert _tokens(events[i]) == solo[i][0], i
            for a, b in zip(rows[s.seq_id], solo[i][1], strict=True):
                assert (a - b).abs().max().item() <= LOGITS_ATOL
        assert mem.used_bytes == 0 and mem.peak_bytes <= mem.budget_bytes
    finally:
        engine.close()


def test_cancel_mid_batch_frees_its_memory(model: Path) -> None:
    engine = Engine(_cfg(model, None, memory_budget=0))
    try:
        rng = random.Random(5)
        vocab = engine.backend.vocab_size
        reqs = [_request(_prompt(rng, 20, vocab), 30) for _ in range(3)]
        solo = [_solo(engine, r) for r in reqs]
        flag = {"stop": False}
        events: dict[int, list[Any]] = defaultdict(list)
        seqs = [
            engine.submit(r, events[i].append, (lambda: flag["stop"]) if i == 1 else (lambda: False))
            for i, r in enumerate(reqs)
        ]
        for _ in range(5):
            engine.step()
        assert all(s.status is Status.RUNNING for s in seqs)
        before = engine.memory.used_bytes
        flag["stop"] = True
        engine.step()
        assert seqs[1].status is Status.FINISHED and seqs[1].state is None
        assert engine.memory.used_bytes == before - engine.memory.bytes_for(engine.memory.capacity_for(21))
        fin = events[1][-1]
        assert isinstance(fin, FinishEvent) and fin.finish_reason == "cancelled"
        while any(s.status is not Status.FINISHED for s in seqs):
            engine.step()
        assert _tokens(events[0]) == solo[0][0] and _tokens(events[2]) == solo[2][0]
        assert engine.memory.used_bytes == 0
    finally:
        engine.close()


def test_stress_random_arrivals_lengths_policies_and_cancels(model: Path, tmp_path: Path) -> None:
    engine = Engine(
        _cfg(model, tmp_path / "cache", chunk_size=24, max_batch_tokens=40, max_seqs=6, queue_size=64)
    )
    try:
        rng = random.Random(11)
        vocab = engine.backend.vocab_size
        shared = _prompt(rng, 30, vocab)  # a shared "system prompt" so caching has work to do
        reqs, cancel_at, arrive = [], {}, []
        for i in range(32):
            own = _prompt(rng, rng.randrange(1, 40), vocab)
            tokens = shared + own if rng.random() < 0.6 else own
            policy = rng.choice(["off", "full", "auto", "16"])
            reqs.append(_request(tokens, rng.randrange(1, 14), policy, salt=rng.choice(["a", "b"])))
            arrive.append(rng.randrange(0, 60))
            if rng.random() < 0.2:
                cancel_at[i] = rng.randrange(0, 30)
        mem = StateMemory(engine.backend, 0, engine.cfg.max_context, block=16)
        mem.budget_bytes = 5 * mem.bytes_for(48)
        engine.memory = mem
        started = mem.used_bytes
        step = {"n": 0}
        inner_step = engine.step

        def counted() -> int:
            step["n"] += 1
            return inner_step()

        engine.step = counted  # type: ignore[method-assign]

        def stopper(i: int) -> Callable[[], bool]:
            at = cancel_at.get(i)
            return (lambda: step["n"] >= arrive[i] + at) if at is not None else (lambda: False)

        events, _, seqs = _run_together(engine, reqs, stopper, arrive)
        engine.step = inner_step  # type: ignore[method-assign]
        assert all(s.status is Status.FINISHED for s in seqs)
        assert mem.used_bytes == started and mem.peak_bytes <= mem.budget_bytes
        for i in range(len(seqs)):
            fin = events[i][-1]
            assert isinstance(fin, FinishEvent)
            if fin.finish_reason == "cancelled":
                continue
            want, _ = _solo(engine, _request(reqs[i].prompt_tokens or (), reqs[i].sampling.max_tokens))
            assert _tokens(events[i]) == want, i
    finally:
        engine.close()
