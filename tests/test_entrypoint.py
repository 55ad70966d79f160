"""The engine image's entrypoint on a first start with several replicas at once
(`docker compose up --scale engine=N`): exactly one engine token is made and every
replica uses it; no temp files are left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENTRYPOINT = Path(__file__).resolve().parent.parent / "services/engine/entrypoint.sh"


def test_replicas_starting_together_share_one_token(tmp_path: Path) -> None:
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").symlink_to(sys.executable)
    token_dir = tmp_path / "engine-token"
    token_dir.mkdir()
    env = {
        **os.environ,
        "PATH": f"{shim}:{os.environ['PATH']}",
        "KEEPWARM_MODEL": str(tmp_path),  # set: the demo-model step is skipped
        "KEEPWARM_ENGINE_TOKEN": "",
        "KEEPWARM_ENGINE_TOKEN_FILE": str(token_dir / "token"),
    }
    procs = [
        subprocess.Popen(
            ["sh", str(ENTRYPOINT), "sh", "-c", 'printf %s "$KEEPWARM_ENGINE_TOKEN"'],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    tokens = {out for out, _ in outs}
    written = (token_dir / "token").read_text().strip()
    assert tokens == {written} and len(written) == 64
    assert sum("made the engine token" in err for _, err in outs) == 1
    assert sorted(p.name for p in token_dir.iterdir()) == ["token"]
