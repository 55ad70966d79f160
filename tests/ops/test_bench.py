"""`ops/bench` runs end to end on a tiny model (the real CLI, a real process) and writes the
JSON its docs and BENCHMARKS.md name. Speed is never asserted here; what is asserted is what
the figures must mean: the cache's warm answers equal the cold one, and with the cache on the
multi-user chat prefills far fewer prompt tokens than with it off (shared system prompt once,
then each turn's new tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench.py"


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{args[0]}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--dtype", "float32", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result == json.loads(proc.stdout[proc.stdout.index("{") :])  # printed and written alike
    return result


def test_bench_serve_reports_every_figure_and_the_cache_saves_prefill(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    r = _bench(
        tmp_path, "serve", "--model", str(tiny_dense_model), "--reply-tokens", "8", "--system-tokens", "200",
        "--agents", "2", "--agent-steps", "3", "--agent-system-tokens", "300",
    )  # fmt: skip
    for key in (
        "decode_tok_s_1", "decode_tok_s_4", "decode_tok_s_8", "decode_scaling_8", "ttft_p50_full_1user",
        "ttft_p50_full", "ttft_p90_full", "ttft_p50_off", "ttft_p90_off", "ttft_first_turn_p50_full",
        "two_engines_decode_tok_s_8", "ttft_off_over_full_p50", "ttft_p90_full_8_over_p50_full_1",
        "agent_ttft_p50_off", "agent_ttft_p50_full", "agent_ttft_p90_full", "agent_first_step_ttft_p50_full",
        "agent_ttft_off_over_full_p50",
    ):  # fmt: skip
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["decode_scaling_8"] == r["decode_tok_s_8"] / r["decode_tok_s_1"]
    # 8 users x 4 turns over one ~200-token system prompt: with `full` the prompt is prefilled
    # once (requests arriving together wait for its snapshot) and later turns only their new
    # tokens; with `off` every turn prefills its whole conversation
    assert r["prefill_tokens_full"] < 200 + 32 * 60
    assert r["prefill_tokens_off"] > 32 * 200
    assert r["deterministic"] is True
    # 2 agents x 3 steps over a 300-token system prompt and the tools: `off` prefills every
    # step's whole prompt, `full` the shared prefix once and then each step's call and result
    assert (r["agents"], r["agent_steps"], r["agent_system_tokens"]) == (2, 3, 300)
    assert r["agent_prefill_tokens_off"] > 2 * 3 * 300
    assert r["agent_prefill_tokens_full"] < r["agent_prefill_tokens_off"] / 2


def test_bench_cache_warm_answers_equal_the_cold_one(tiny_dense_model: Path, tmp_path: Path) -> None:
    r = _bench(tmp_path, "cache", "--model", str(tiny_dense_model), "--prompt-tokens", "256")
    assert r["identical_output"] is True
    assert r["warm_sources"] == ["memory", "disk", "disk", "disk"]
    assert r["snapshot_bytes"] > 0 and 0 < r["prompt_tokens"] <= 256


def test_bench_engine_reports_the_start_times(tiny_dense_model: Path, tmp_path: Path) -> None:
    """`start_s_new_folder` and `start_s_warm`: the real engine process from spawn to /health on
    a new cache folder, then on the same folder once its prefill cost model was persisted."""
    r = _bench(
        tmp_path, "engine", "--model", str(tiny_dense_model), "--no-reference", "--prompt-tokens", "32",
        "--decode-tokens", "2", "--chunk", "32",
    )  # fmt: skip
    for key in ("start_s_new_folder", "start_s_warm", "start_warmup_s", "prefill_tok_s"):
        assert isinstance(r[key], float) and r[key] > 0, key
    # ready before the warm-up ended (it runs after /health answers); none on the warm folder
    assert r["start_calibration_at_ready"] in ("waiting", "running", "done")
    assert r["start_calibration_warm"] == "persisted"
    assert r["kernels_prebuilt"] in (True, False, None)
