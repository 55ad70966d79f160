"""`ops/bench` runs end to end on a tiny model (the real CLI, a real process) and writes the
JSON its docs and BENCHMARKS.md name. Speed is never asserted here; what is asserted is what
the figures must mean: the cache's warm answers equal the cold one, and with the cache on the
multi-user chat prefills far fewer prompt tokens than with it off (shared system prompt once,
then each turn's new tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench.py"
STANDIN = Path(__file__).with_name("peer_standin.py")


def _bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp_path / f"{args[0]}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--dtype", "float32", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
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
    assert "weights_bytes_as_file" not in r  # a safetensors folder: one weight mode


def test_bench_engine_measures_both_weight_modes_of_a_gguf(smollm2_model: Path, tmp_path: Path) -> None:
    """On a GGUF file, both --weights modes side by side: the quantized blocks hold under a third
    of the dequantized bytes (float32 here)."""
    r = _bench(
        tmp_path, "engine", "--model", str(smollm2_model), "--no-reference", "--no-start", "--prompt-tokens",
        "32", "--decode-tokens", "2", "--chunk", "32", "--decode-contexts", "16,40",
    )  # fmt: skip
    assert "start_s_warm" not in r
    for mode in ("as_file", "bf16"):
        for key in ("prefill_tok_s", "decode_tok_s_16", "decode_tok_s_40", "decode_roofline_fraction"):
            assert isinstance(r[f"{key}_{mode}"], float) and r[f"{key}_{mode}"] > 0, (key, mode)
    # 4 bytes a weight dequantized, 0.625 (Q4_1) and 1.06 (Q8_0) in blocks
    assert r["weights_bytes_as_file"] < 0.3 * r["weights_bytes_bf16"]
    assert r["weights_ratio_as_file"] == r["weights_bytes_as_file"] / r["weights_bytes_bf16"]


def test_bench_peer_reports_every_ratio_against_a_stand_in_peer(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    """`ops/bench peer` end to end, with a stand-in answering for llama-server (building
    llama.cpp takes ~20 minutes: never in ops/test) and the demo model for keepwarm (its real
    runs are on GGUF files, which the stand-in does not read). What is checked is what the
    figures must mean, not their size."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    server = bin_dir / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    server.chmod(0o755)
    log = tmp_path / "standin.jsonl"
    sizes = (
        "long_tokens=96,short_tokens=32,system_tokens=64,decode_tokens=6,reply_tokens=4,users=2,user_rounds=2"
    )
    r = _bench(tmp_path, "peer", "--model", str(tiny_dense_model), "--peer-bin", str(bin_dir), "--rounds", "2",
               "--idle-wait", "0", "--peer-workload", sizes, env={"PEER_STANDIN_LOG": str(log)})  # fmt: skip
    assert r["rounds"] == 2 and r["workload"]["users"] == 2
    pairs = {
        "prefill_ratio": "prefill_tok_s", "decode_ratio_256": "decode_tok_s_short",
        "decode_ratio_2048": "decode_tok_s_long", "turn2_ttft_ratio": "turn2_ttft_s",
        "restart_ttft_ratio": "restart_ttft_s", "chat8_p50_ratio": "chat8_p50_s", "chat8_p90_ratio": "chat8_p90_s",
        "start_ratio": "restart_start_s", "rss_ratio": "rss_bytes",
    }  # fmt: skip
    for ratio, figure in pairs.items():
        kw, peer = r[f"keepwarm_{figure}"], r[f"llama_{figure}"]
        assert kw > 0 and peer > 0, figure
        assert r[ratio] == kw / peer, ratio  # keepwarm / llama.cpp, as documented
        assert r["directions"][ratio] in ("higher is keepwarm ahead", "lower is keepwarm ahead")
        assert r["targets"][ratio]["met"] is (
            r[ratio] >= float(r["targets"][ratio]["target"][3:])
            if r["targets"][ratio]["target"].startswith(">=")
            else r[ratio] <= float(r["targets"][ratio]["target"][3:])
        )
        lo, hi = r[f"keepwarm_{figure}_spread"]
        assert lo <= kw <= hi  # the median of the rounds lies within their spread
    # keepwarm: turn 2 from its RAM tier, and the follow-up after a restart from its disk cache
    assert r["keepwarm_turn2_cached_tokens"] > 64 and r["keepwarm_restart_cached_tokens"] > 64
    # The peer was asked as llama-server is: no prompt cache for the cold and decode figures, the
    # prompt cache for conversations, and the slot saved before its restart and restored after.
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    chats = [s["body"] for s in sent if s["path"] == "/v1/chat/completions"]
    # per round: the cold prompt and the two decode contexts, three turns, 2 users x 2 turns
    assert [c["cache_prompt"] for c in chats] == ([False] * 3 + [True] * 3 + [True] * 4) * 2
    slots = [s["query"] for s in sent if s["path"] == "/slots/0"]
    assert slots == ["action=save", "action=restore"] * 2
    # README's "versus llama.cpp" table, written from this result between its markers.
    sys.path.insert(0, str(BENCH.parent))
    import peer

    readme = "intro\n" + peer.README_BEGIN + "\nold\n" + peer.README_END + "\nrest\n"
    table = peer.readme_table(r, "a test machine", "2026-12-04")
    assert (
        peer.render_readme(readme, table) == f"intro\n{peer.README_BEGIN}\n{table}\n{peer.README_END}\nrest\n"
    )
    rows = [line for line in table.splitlines() if line.startswith("| ") and "keepwarm /" not in line]
    assert len(rows) == len(pairs)
    assert f"| {r['prefill_ratio']:.2f} (higher is keepwarm ahead) |" in table
    assert f"| {r['turn2_ttft_ratio']:.2f} (lower is keepwarm ahead) |" in table


def test_bench_quality_reports_the_perplexity_of_both_weight_modes(
    smollm2_model: Path, tmp_path: Path
) -> None:
    r = _bench(tmp_path, "quality", "--model", str(smollm2_model), "--prompt-tokens", "256")
    assert r["tokens"] == 256 and r["text"] == "gpl-3.0.txt"
    assert r["ppl_ratio_as_file"] == r["ppl_as_file"] / r["ppl_bf16"]
    # the blocks' exact weights against the same values dequantized (float32 here): the int16
    # activations cost well under 1 % of perplexity
    assert 1 < r["ppl_bf16"] < 100 and abs(r["ppl_ratio_as_file"] - 1) < 0.01


def test_bench_spec_reports_speedup_cost_and_acceptance_with_the_same_replies(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    """The bench itself fails when a reply differs with speculation on and off."""
    r = _bench(tmp_path, "spec", "--model", str(tiny_dense_model), "--rounds", "1")
    assert {"spec_speedup_quote", "spec_cost_chat", "acceptance_rate", "load_average_1m"} <= r.keys()
    assert r["quote_prompt_tokens"] > 500 and r["quote_reply_tokens"] > 0 and r["chat_reply_tokens"] > 0
    assert r["drafted_tokens"] > 0 and r["acceptance_rate"] == round(
        r["accepted_tokens"] / r["drafted_tokens"], 3
    )
