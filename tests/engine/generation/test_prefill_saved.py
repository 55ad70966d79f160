"""What a restore saved is reported after a restart: the prefill cost model persists
beside the cache, so a fresh engine whose requests all hit the disk reports a
non-zero `prefill_saved_ms` from its first request. Without a persisted model it is fitted
by a warm-up that runs between requests (never before serving) and from real prefills; it
never changes a reply."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from keepwarm.engine.engine import Engine, Event
from keepwarm.engine.generation.prefill_cost import PrefillCost
from keepwarm.engine.generation.request import FinishEvent, TokenEvent
from tests.engine.test_engine import SYSTEM, USER_TURNS, _cfg, _req


def test_a_restarted_engine_reports_prefill_saved_on_disk_hits(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
    first = Engine(_cfg(tiny_dense_model, tmp_path / "cache"))
    try:
        assert not first.prefill_cost.calibrated
        first.calibrate()
        assert first.prefill_cost.calibrated
        cold = first.complete(_req(msgs))
        assert cold.timings.cache_source == "none"
        first.flush()
    finally:
        first.close()
    again = Engine(_cfg(tiny_dense_model, tmp_path / "cache"))
    try:
        assert again.prefill_cost.calibrated  # read back from the cache folder, no warm-up
        warm = again.complete(_req(msgs))
        assert warm.timings.cache_source == "disk" and warm.cached_tokens == cold.prompt_tokens
        # the persisted model says what the restored span costs cold (positive: no timing
        # involved), and the reply reports exactly that minus the measured restore time
        modelled = again.prefill_cost.saved(warm.cached_tokens, warm.prompt_tokens)
        assert modelled is not None and modelled > 0
        want = max(0.0, modelled * 1000 - warm.timings.restore_ms)
        assert abs(warm.timings.prefill_saved_ms - round(want, 2)) <= 0.011
    finally:
        again.close()


def test_the_warm_up_runs_chunk_by_chunk_between_steps_and_changes_no_reply(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    """The warm-up only influences what restores are reported to save: interleaved chunk by
    chunk with a request's steps, the reply's tokens, text and logprobs, and the request
    counters, are those of an engine that never warmed up."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[1]}]
    req = replace(_req(msgs), logprobs=True, top_logprobs=3)
    plain = Engine(_cfg(tiny_dense_model, tmp_path / "plain"))
    try:
        assert plain.calibration.state == "waiting" and plain.calibration.planned > 0
        want = list(plain.generate(req))
        assert plain.calibration.done == 0 and not plain.prefill_cost.calibrated  # one prefill: not yet
    finally:
        plain.close()

    engine = Engine(_cfg(tiny_dense_model, tmp_path / "warming"))
    try:
        planned = engine.calibration.planned
        # the test config's chunks: 64 tokens (chunk_size), so each step of the warm-up is short
        chunks = sum(-(-start // 64) + -(-n // 64) for start, n in PrefillCost.calibration_plan(1023))
        events: list[Event] = []
        engine.submit(req, events.append)
        interleaved = 0
        while engine.has_work():
            if interleaved < 5:  # some of the warm-up between the request's steps, not all of it
                interleaved += engine.calibrate_step()
            engine.step()
        assert interleaved == 5 and engine.calibration.state == "running"
        assert _replies(events) == _replies(want)
        assert engine.stats.prefill_tokens == plain.stats.prefill_tokens
        rest = 0
        while engine.calibrate_step():
            rest += 1
        assert interleaved + rest == chunks + 1  # the last call records the last prefill and saves
        assert engine.calibration.state == "done" and engine.calibration.done == planned
        assert engine.stats.calibration_prefills == planned and engine.prefill_cost.calibrated
        assert not engine.calibrate_step()
    finally:
        engine.close()


def _replies(events: list[Event]) -> list[object]:
    """What a client sees of each event, timings aside."""
    out: list[object] = []
    for ev in events:
        if isinstance(ev, TokenEvent):
            out.append(ev)
        elif isinstance(ev, FinishEvent):
            out.append((ev.finish_reason, ev.text, ev.prompt_tokens, ev.completion_tokens))
    return out


def test_real_prefills_fit_the_model_without_a_warm_up(tiny_dense_model: Path, tmp_path: Path) -> None:
    """A server busy from its first second never runs the warm-up: its requests' own
    prefills fit the model, and restores then report what they saved."""
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "cache"))
    try:
        chats = [
            [{"role": "system", "content": SYSTEM * k}, {"role": "user", "content": turn}]
            for k, turn in zip((1, 2, 3), USER_TURNS, strict=False)
        ]
        for i, msgs in enumerate(chats):
            assert not engine.prefill_cost.calibrated, i
            assert engine.complete(_req(msgs)).timings.prefill_saved_ms == 0.0  # nothing restored
        assert engine.prefill_cost.calibrated and engine.calibration.done == 0
        warm = engine.complete(_req(chats[2]))
        assert warm.cached_tokens == warm.prompt_tokens
        modelled = engine.prefill_cost.saved(warm.cached_tokens, warm.prompt_tokens)
        assert modelled is not None and modelled > 0
        want = max(0.0, modelled * 1000 - warm.timings.restore_ms)
        assert abs(warm.timings.prefill_saved_ms - round(want, 2)) <= 0.011
    finally:
        engine.close()
