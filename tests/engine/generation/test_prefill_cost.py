"""The prefill cost model: fit, estimate, what a restore saved, persistence."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from keepwarm.engine.generation.prefill_cost import (
    FILE_NAME,
    Fit,
    PrefillCost,
    nonnegative_least_squares,
)

TRUE = Fit(a=2e-4, b=3e-8, c=4e-3)  # 0.2 ms/token, 30 ns per attended pair, 4 ms per call
NS = "a1" * 16


def _feed(
    model: PrefillCost, fit: Fit, spans: list[tuple[int, int]], noise: float = 0.0, seed: int = 0
) -> None:
    rng = random.Random(seed)
    for start, n in spans:
        model.record(start, n, fit.cost(start, n) * (1.0 + rng.uniform(-noise, noise)))


COLD = [(0, n) for n in (16, 64, 200, 512, 1000, 2048)]
PARTIAL = [(s, n) for s in (500, 2000, 4000) for n in (32, 128, 512)]


def test_exact_costs_are_recovered_from_cold_and_partial_prefills() -> None:
    m = PrefillCost(None)
    _feed(m, TRUE, COLD + PARTIAL)
    f = m.fit()
    assert f is not None
    assert (f.a, f.b, f.c) == pytest.approx((TRUE.a, TRUE.b, TRUE.c), rel=1e-6)
    assert m.estimate(3000, 700) == pytest.approx(TRUE.cost(3000, 700), rel=1e-6)
    assert m.estimate(0, 0) == 0.0


def test_cost_grows_with_the_start_position() -> None:
    m = PrefillCost(None)
    _feed(m, TRUE, COLD + PARTIAL, noise=0.05, seed=1)
    deep, shallow = m.estimate(8000, 100), m.estimate(0, 100)
    assert deep is not None and shallow is not None
    # attention over 8000 more keys: 100 * 8000 * 30 ns = 24 ms more than at the start
    assert deep - shallow == pytest.approx(100 * 8000 * TRUE.b, rel=0.15)


def test_noisy_measurements_estimate_within_ten_percent() -> None:
    m = PrefillCost(None)
    _feed(m, TRUE, (COLD + PARTIAL) * 4, noise=0.2, seed=2)
    for start, n in [(0, 100), (0, 3000), (1500, 300), (6000, 50)]:
        est = m.estimate(start, n)
        assert est == pytest.approx(TRUE.cost(start, n), rel=0.10), (start, n)


def test_coefficients_are_never_negative() -> None:
    # linear cost and nothing else: an unconstrained fit of noisy data could give b < 0
    m = PrefillCost(None)
    linear = Fit(a=1e-4, b=0.0, c=0.0)
    _feed(m, linear, COLD + PARTIAL, noise=0.1, seed=3)
    f = m.fit()
    assert f is not None and min(f.a, f.b, f.c) >= 0.0
    assert m.estimate(0, 1000) == pytest.approx(0.1, rel=0.1)
    assert nonnegative_least_squares([[1.0, 0.0], [0.0, 1.0]], [2.0, -3.0], 13.0) == [2.0, 0.0]


def test_uncalibrated_until_enough_samples_and_short_prefills_are_ignored() -> None:
    m = PrefillCost(None, min_samples=3, min_tokens=8)
    assert m.estimate(0, 100) is None and m.saved(50, 100) is None and not m.calibrated
    m.record(0, 4, 0.01)  # too short to say anything
    m.record(0, 100, float("nan"))
    m.record(0, 100, -1.0)
    m.record(0, 100, TRUE.cost(0, 100))
    m.record(0, 400, TRUE.cost(0, 400))
    assert m.samples == 2 and m.estimate(0, 100) is None
    m.record(100, 100, TRUE.cost(100, 100))
    assert m.calibrated and m.estimate(0, 100) is not None


def test_saved_is_the_full_cost_minus_what_is_left_to_prefill() -> None:
    m = PrefillCost(None)
    _feed(m, TRUE, COLD + PARTIAL)
    assert m.saved(0, 500) == 0.0
    assert m.saved(500, 500) == pytest.approx(TRUE.cost(0, 500), rel=1e-6)  # exact hit: no prefill at all
    # a restore of r of t tokens saves a*r + b*r²/2 (the per-call cost is paid either way)
    r, t = 400, 1000
    assert m.saved(r, t) == pytest.approx(TRUE.a * r + TRUE.b * r * r / 2, rel=1e-6)


def test_persisted_beside_the_cache_and_reloaded(tmp_path: Path) -> None:
    m = PrefillCost.for_namespace(tmp_path, NS, save_every_s=3600.0)
    assert not m.calibrated
    _feed(m, TRUE, COLD + PARTIAL)
    path = tmp_path / NS / FILE_NAME
    assert path.exists()  # the first record saves (nothing saved yet)
    m.save()
    doc = json.loads(path.read_text())
    assert doc["samples"] == len(COLD + PARTIAL) and doc["fit"]["a"] == pytest.approx(TRUE.a, rel=1e-6)
    assert sorted(p.name for p in path.parent.iterdir()) == [FILE_NAME]  # no temp file left

    again = PrefillCost.for_namespace(tmp_path, NS)  # a restarted engine
    assert again.samples == len(COLD + PARTIAL)
    assert again.estimate(2000, 300) == pytest.approx(TRUE.cost(2000, 300), rel=1e-6)
    assert PrefillCost.for_namespace(tmp_path, "b2" * 16).estimate(0, 10) is None  # per namespace


@pytest.mark.parametrize(
    "text",
    ["", "{", "[]", '{"version": 1}', '{"version": 1, "xtx": [[1]], "xty": [1], "yty": 1, "samples": 1}',
     '{"version": 1, "xtx": [[1,0,0],[0,1,0],[0,0,1]], "xty": [1,1,"x"], "yty": 1, "samples": 1}',
     '{"version": 99, "xtx": [], "xty": [], "yty": 0, "samples": 0}'],
)  # fmt: skip
def test_a_damaged_file_gives_an_empty_model(tmp_path: Path, text: str) -> None:
    path = tmp_path / NS / FILE_NAME
    path.parent.mkdir()
    path.write_text(text)
    m = PrefillCost.for_namespace(tmp_path, NS)
    assert m.samples == 0 and m.estimate(0, 10) is None
    _feed(m, TRUE, COLD)
    assert m.calibrated


def test_calibration_plan_fits_the_context_and_determines_the_model() -> None:
    plan = PrefillCost.calibration_plan(1024)
    assert all(s + n <= 1024 for s, n in plan)
    assert any(s > 0 for s, _ in plan) and len({n for _, n in plan}) >= 3
    m = PrefillCost(None)
    _feed(m, TRUE, plan)
    assert m.estimate(512, 256) == pytest.approx(TRUE.cost(512, 256), rel=1e-6)
    assert PrefillCost.calibration_plan(16) == [(0, 16)]
