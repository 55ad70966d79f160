"""What a restore saved is reported after a restart: the prefill cost model persists
beside the cache, so a fresh engine whose requests all hit the disk reports a
non-zero `prefill_saved_ms` from its first request."""

from __future__ import annotations

from pathlib import Path

from keepwarm.engine.engine import Engine
from tests.engine.test_engine import SYSTEM, USER_TURNS, _cfg, _req


def test_a_restarted_engine_reports_prefill_saved_on_disk_hits(tiny_dense_model: Path, tmp_path: Path) -> None:
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
        assert warm.timings.prefill_saved_ms > 0
        assert again.stats.prefill_saved_seconds > 0
    finally:
        again.close()
