"""The container test needs a Docker engine; ops/test-containers (and ops/test) set one up where
root may, and say why not elsewhere. Timings land in .cache/containers-timings.json and in the
terminal summary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.containers.compose_stack import ROOT, TIMINGS

TIMINGS_FILE = ROOT / ".cache" / "containers-timings.json"


def docker_answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [i for i in items if here in Path(str(i.path)).parents]
    if ours and not docker_answers():
        skip = pytest.mark.skip(reason="no Docker engine answers: ops/test-containers sets one up (as root)")
        for item in ours:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS:
        return
    TIMINGS_FILE.parent.mkdir(parents=True, exist_ok=True)
    TIMINGS_FILE.write_text(json.dumps(TIMINGS, indent=2) + "\n")
    terminalreporter.section("container timings (s)")
    for name, seconds in TIMINGS.items():
        terminalreporter.write_line(f"{name}: {seconds:.1f}")
