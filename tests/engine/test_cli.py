"""The engine CLI as a user runs it: real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keepwarm.engine", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_streams_and_prints_timings(tiny_dense_model: Path, tmp_path: Path) -> None:
    res = _run(
        [
            "generate",
            "--model",
            str(tiny_dense_model),
            "--prompt",
            "Hello there",
            "--max-tokens",
            "5",
            "--dtype",
            "float32",
            "--cache-dir",
            str(tmp_path / "c"),
        ]
    )
    assert res.returncode == 0, res.stderr
    assert "prompt tokens (0 restored from none)" in res.stderr
    assert "5 generated" in res.stderr


def test_chat_second_turn_restores(tiny_dense_model: Path, tmp_path: Path) -> None:
    res = _run(
        [
            "chat",
            "--model",
            str(tiny_dense_model),
            "--max-tokens",
            "4",
            "--dtype",
            "float32",
            "--cache-dir",
            str(tmp_path / "c"),
            "--min-tokens",
            "4",
            "--system",
            "You are a careful assistant for a village library.",
        ],
        stdin="first question\nsecond question\n\n",
    )
    assert res.returncode == 0, res.stderr
    timing_lines = [line for line in res.stderr.splitlines() if "prompt tokens" in line]
    assert len(timing_lines) == 2
    assert "restored from none" in timing_lines[0]
    assert "restored from memory" in timing_lines[1]


def test_bad_flag_value_says_what_to_change(tiny_dense_model: Path) -> None:
    res = _run(
        ["generate", "--model", str(tiny_dense_model), "--prompt", "x", "--disk-prefix-cache", "sometimes"]
    )
    assert res.returncode == 2
    assert "--disk-prefix-cache" in res.stderr and "accepted: off, full, auto" in res.stderr
    res = _run(["generate", "--model", str(tiny_dense_model), "--prompt", "x", "--disk-budget", "lots"])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--disk-budget 'lots': size 'lots' is not a number with an optional k/m/g/t suffix" in res.stderr
    assert "(default: 16g)" in res.stderr
    res = _run(["generate", "--model", str(tiny_dense_model), "--prompt", "x", "--writer-nice", "20"])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--writer-nice 20 must be in 0..19" in res.stderr
    res = _run(["generate", "--model", str(tiny_dense_model / "missing"), "--prompt", "x"])
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
