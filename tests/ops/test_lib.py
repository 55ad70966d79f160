"""ops/lib.sh's preflight checks, run in a real bash against real volumes."""

from __future__ import annotations

import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "ops" / "lib.sh"


def _free_disk(need_mib: int, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'source "{LIB}" && ensure_free_disk {need_mib} "{path}"'],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_free_disk_passes_a_volume_with_room(tmp_path: Path) -> None:
    done = _free_disk(1, tmp_path)
    assert (done.returncode, done.stderr) == (0, "")


def test_free_disk_refuses_naming_the_path_and_what_it_needs(tmp_path: Path) -> None:
    done = _free_disk(1 << 40, tmp_path)  # a mebibyte count no volume here has
    assert done.returncode == 1
    assert f"error: {tmp_path} has " in done.stderr
    assert f"the suite needs {1 << 40} MiB there" in done.stderr
