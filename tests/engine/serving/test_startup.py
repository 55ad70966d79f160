"""Engine start-up (issue 27 item 1): on a new cache folder the engine answers /health before
any warm-up prefill of the prefill cost model has run; the warm-up then runs in the
background, between requests, and is persisted, so the next start on that folder has none."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from tests.api.procs import Proc, start_engine


def _prefill_cost(proc: Proc) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(proc.url + "/health", timeout=10).json()
    assert doc["status"] == "ok"
    return doc["prefill_cost"]


def _lines(proc: Proc, words: str) -> list[int]:
    return [i for i, line in enumerate(proc.tail(10**6).splitlines()) if words in line]


def test_health_is_ready_before_the_warm_up_which_then_runs_in_the_background(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    proc = start_engine(tiny_dense_model, cache, tmp_path / "logs")  # returns once /health is 200
    try:
        first = _prefill_cost(proc)
        assert first["calibration"] in ("waiting", "running", "done")  # never read from the new folder
        planned = first["warmup_planned"]
        assert planned > 0
        # the engine says what it had run when it started answering: none of the warm-up
        ready = _lines(proc, "keepwarm engine: ready on")
        assert len(ready) == 1
        assert (
            f"prefill cost model: 0 of {planned} warm-up prefills run"
            in proc.tail(10**6).splitlines()[ready[0]]
        )
        deadline = time.monotonic() + 120
        pc = first
        while pc["calibration"] != "done":
            assert time.monotonic() < deadline, f"the warm-up did not finish: {pc}\n{proc.tail()}"
            time.sleep(0.1)
            pc = _prefill_cost(proc)
        assert pc["warmup_prefills"] == planned and pc["fitted"] and pc["samples"] >= planned
        fitting, fitted = (
            _lines(proc, "fitting the prefill cost model in the background"),
            _lines(proc, "prefill cost model fitted"),
        )
        assert ready[0] < fitting[0] < fitted[0]
        namespace = httpx.get(proc.url + "/health").json()["namespace"]
        saved = json.loads((cache / namespace / "prefill_cost.json").read_text())
        assert saved["samples"] >= planned and "fit" in saved
        # requests are served as before
        r = httpx.post(
            proc.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 3,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        proc.stop()

    again = start_engine(tiny_dense_model, cache, tmp_path / "logs-again")
    try:
        pc = _prefill_cost(again)
        assert pc == {
            "calibration": "persisted",
            "warmup_prefills": 0,
            "warmup_planned": 0,
            "samples": pc["samples"],
            "fitted": True,
        }
        assert pc["samples"] >= planned
        assert "prefill cost model read from the cache folder" in again.tail()
        assert not _lines(again, "fitting the prefill cost model")
    finally:
        again.stop()
