"""The gateway's first start without configuration (keepwarm.api.bootstrap): the secret and one
API key made once in the state folder, explicit variables winning, the key printed again on demand."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from keepwarm.api import bootstrap
from keepwarm.api.config import ConfigError, parse_config

BASE = {"KEEPWARM_ENGINES": "http://127.0.0.1:8100"}


def test_without_a_state_folder_nothing_changes() -> None:
    assert bootstrap.first_start(BASE) == BASE
    with pytest.raises(ConfigError, match="KEEPWARM_SECRET"):
        parse_config([], {**BASE, "KEEPWARM_API_KEYS": "k:t"})


def test_first_start_makes_a_secret_and_one_key_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {**BASE, "KEEPWARM_STATE_DIR": str(tmp_path / "state")}
    with caplog.at_level(logging.INFO, logger="keepwarm.api.bootstrap"):
        first = parse_config([], bootstrap.first_start(env))
    key = (tmp_path / "state" / bootstrap.KEY_FILE).read_text().strip()
    assert key.startswith("kw-") and len(key) > 30
    assert first.api_keys == {key: bootstrap.TENANT}
    assert len(first.secret) == 64
    assert [r.getMessage().count(f"API key: {key}") for r in caplog.records] == [0, 1]
    for name in (bootstrap.SECRET_FILE, bootstrap.KEYS_FILE, bootstrap.KEY_FILE):
        assert stat.S_IMODE((tmp_path / "state" / name).stat().st_mode) == 0o600

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keepwarm.api.bootstrap"):
        again = parse_config([], bootstrap.first_start(env))
    assert (again.api_keys, again.secret) == (first.api_keys, first.secret)
    assert caplog.records == []  # printed once: only when it was made
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["api-key", "api-keys", "secret"]


def test_explicit_variables_win(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {
        **BASE,
        "KEEPWARM_STATE_DIR": str(state),
        "KEEPWARM_SECRET": "an-explicit-secret-of-some-length",
        "KEEPWARM_API_KEYS": "mine:me",
    }
    out = bootstrap.first_start(env)
    assert out == env  # nothing filled in
    cfg = parse_config([], out)
    assert (cfg.secret, cfg.api_keys) == (b"an-explicit-secret-of-some-length", {"mine": "me"})
    assert list(state.iterdir()) == []  # no secret or key made

    keys_file = tmp_path / "keys"
    keys_file.write_text("filed tenant-f\n")
    out = bootstrap.first_start(
        {**BASE, "KEEPWARM_STATE_DIR": str(state), "KEEPWARM_API_KEYS_FILE": str(keys_file)}
    )
    assert parse_config([], out).api_keys == {"filed": "tenant-f"}
    assert sorted(p.name for p in state.iterdir()) == ["secret"]  # the secret is still made


def test_a_state_folder_that_cannot_be_written_names_the_variable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="KEEPWARM_STATE_DIR=.*mount a writable volume"):
        bootstrap.first_start({**BASE, "KEEPWARM_STATE_DIR": str(blocker / "state")})


def test_the_module_prints_the_key_again(tmp_path: Path) -> None:
    env = {**os.environ, "KEEPWARM_STATE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "keepwarm.api.bootstrap"]
    before = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert before.returncode == 1 and "has not started yet" in before.stderr
    bootstrap.first_start({**BASE, "KEEPWARM_STATE_DIR": str(tmp_path)})
    after = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0
    assert after.stdout == (tmp_path / bootstrap.KEY_FILE).read_text()
    unset = subprocess.run(
        cmd, env={k: v for k, v in env.items() if k != "KEEPWARM_STATE_DIR"}, capture_output=True, text=True
    )
    assert unset.returncode == 2 and "KEEPWARM_STATE_DIR is not set" in unset.stderr
