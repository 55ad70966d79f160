"""Requests that share a prefix and arrive together prefill it once: the later one waits for
the earlier one's snapshot and restores it (generation/scheduler.py), with the same output
as alone; one whose own cache entry is deeper is never held back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.sequence import Status
from tests.engine.generation.test_batching import FAMILIES, _prompt, _request, _solo, _tokens
from tests.engine.test_engine import _cfg

SHARED, TAIL = 80, 20


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(FAMILIES[request.param])


def _prompts(vocab: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rng = random.Random(3)
    shared = _prompt(rng, SHARED, vocab)
    return shared + _prompt(rng, TAIL, vocab), shared + _prompt(rng, TAIL, vocab)


def test_a_prefix_shared_by_requests_arriving_together_is_prefilled_once(model: Path) -> None:
    engine = Engine(_cfg(model, None, max_batch_tokens=512))
    try:
        a, b = _prompts(engine.backend.vocab_size)
        solo_b = _tokens(list(engine.generate(_request(b, 6, "off"))))
        before = engine.stats.prefill_tokens
        events: dict[int, list[object]] = {0: [], 1: []}
        batches: list[list[int]] = []
        inner = engine.runner.run

        def run(batch):  # type: ignore[no-untyped-def]
            batches.append([s.seq.seq_id for s in batch])
            return inner(batch)

        engine.runner.run = run  # type: ignore[method-assign]
        seq_a = engine.submit(_request(a, 6, str(SHARED)), events[0].append)
        seq_b = engine.submit(_request(b, 6, str(SHARED)), events[1].append)
        while engine.has_work():
            engine.step()
        assert seq_a.status is Status.FINISHED and seq_b.status is Status.FINISHED
        # b waited out a's first chunk (which ends at the shared save point), then restored it
        assert batches[0] == [seq_a.seq_id]
        assert seq_b.hit is not None and seq_b.restored == SHARED and seq_b.hit.source == "memory"
        assert seq_a.restored == 0
        assert engine.stats.prefill_tokens - before == (SHARED + TAIL) + TAIL
        assert _tokens(events[1]) == solo_b
    finally:
        engine.close()


def test_a_request_with_a_deeper_entry_of_its_own_is_not_held_back(model: Path) -> None:
    engine = Engine(_cfg(model, None, max_batch_tokens=512))
    try:
        a, b = _prompts(engine.backend.vocab_size)
        _solo(engine, _request(b, 4, str(SHARED + TAIL)))  # caches all of b (not its first 80)
        seq_a = engine.submit(_request(a, 4, str(SHARED)), lambda ev: None)
        seq_b = engine.submit(_request(b, 4, str(SHARED)), lambda ev: None)
        engine.step()
        assert seq_a.status is Status.RUNNING and seq_b.status is Status.RUNNING
        assert seq_b.restored == SHARED + TAIL
        while engine.has_work():
            engine.step()
    finally:
        engine.close()


def test_requests_sharing_nothing_are_not_held_back(model: Path) -> None:
    engine = Engine(_cfg(model, None, max_batch_tokens=512))
    try:
        a, _ = _prompts(engine.backend.vocab_size)
        other = _prompt(random.Random(9), SHARED + TAIL, engine.backend.vocab_size)
        seq_a = engine.submit(_request(a, 4, str(SHARED)), lambda ev: None)
        seq_c = engine.submit(_request(other, 4, str(SHARED)), lambda ev: None)
        seq_off = engine.submit(_request(a, 4, "off"), lambda ev: None)  # never restores: never waits
        engine.step()
        assert {seq_a.status, seq_c.status, seq_off.status} == {Status.RUNNING}
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
