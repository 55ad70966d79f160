"""What a restore saved is reported after a restart: the prefill cost model persists
beside the cache, so a fresh engine whose requests all hit the disk reports a
non-zero `prefill_saved_ms` from its first request."""

from __future__ import annotations

from pathlib import Path

from keepwarm.engine.engine import Engine
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
