"""EngineStats: each step-loop event adds to exactly the counters it names."""

from __future__ import annotations

from dataclasses import asdict

import torch

from keepwarm.engine.cache.prefix_cache import Hit
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.generation.engine_stats import EngineStats


def _changed(before: EngineStats, after: EngineStats) -> dict[str, object]:
    a, b = asdict(before), asdict(after)
    return {k: b[k] for k in b if a[k] != b[k]}


def test_each_event_adds_to_its_own_counters() -> None:
    s = EngineStats()
    s.admitted(120, looked_up=True)
    s.admitted(30, looked_up=False)
    assert _changed(EngineStats(), s) == {"requests": 2, "prompt_tokens": 150, "lookups": 1}

    s = EngineStats()
    s.stepped(17, 0.25)
    s.stepped(3, 0.5)
    assert _changed(EngineStats(), s) == {"steps": 2, "step_tokens": 20, "step_seconds": 0.75}

    s = EngineStats()
    s.prefilled(64, 0.125)
    assert _changed(EngineStats(), s) == {"prefill_tokens": 64, "prefill_seconds": 0.125}

    s = EngineStats()
    s.verified(8, 5)
    s.verified(4, 0)
    assert _changed(EngineStats(), s) == {"drafted_tokens": 12, "accepted_tokens": 5}


def test_a_restore_counts_under_its_tier() -> None:
    snap = Snapshot(96, {"x": torch.zeros(1)})
    s = EngineStats()
    s.restored(Hit("k", 96, snap, "disk", 0.01, 4096), 96, 0.03, 0.5)
    s.restored(Hit("m", 64, snap, "memory", 0.0, 1024), 64, 0.01, 0.25)
    assert _changed(EngineStats(), s) == {
        "hits_by_tier": {"memory": 1, "disk": 1},
        "hit_tokens_by_tier": {"memory": 64, "disk": 96},
        "restore_seconds": 0.04,
        "restore_bytes": 5120,
        "prefill_saved_seconds": 0.75,
    }
