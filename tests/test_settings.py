"""keepwarm.settings: one mechanism reads every service's settings from flags, the environment and
defaults; the three services' models, their --help and the README tables come from it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from keepwarm import settings
from keepwarm.api.config import GatewayConfig, parse_config
from keepwarm.engine.config import EngineConfig, config_from, format_size, parse_size
from keepwarm.settings import SettingsError, env_names, internal, setting
from keepwarm.ui.settings import UiSettings

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s" * 20
GATEWAY_ENV = {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET}


@dataclass(frozen=True)
class Toy:
    env_prefix: ClassVar[str] = "TOY_"

    port: int = setting(8000, env=("TOY_PORT", "PORT"), help="listen port")
    ratio: float = 0.5  # a plain field: --ratio / TOY_RATIO, parsed as its type
    hosts: tuple[str, ...] = setting((), flag="--host", repeat=True, help="repeatable")
    token: str = setting("", flag=None, secret=True, help="secret")
    fast: bool | None = None
    folder: Path | None = None
    derived: str = internal("fixed")


def _load(argv: list[str], env: dict[str, str]) -> Toy:
    p = argparse.ArgumentParser()
    settings.add_arguments(p, Toy)
    return settings.load(Toy, p.parse_args(argv), env)


def test_flag_beats_env_beats_default() -> None:
    assert _load([], {}) == Toy()
    assert _load([], {"TOY_PORT": "9", "TOY_RATIO": "0.25"}) == Toy(port=9, ratio=0.25)
    assert _load(["--port", "7", "--ratio", "2"], {"TOY_PORT": "9", "TOY_RATIO": "0.25"}) == Toy(
        port=7, ratio=2.0
    )
    # An empty variable is unset (compose passes `${X:-}` through as "").
    assert _load([], {"TOY_PORT": "", "TOY_RATIO": ""}) == Toy()
    # Plain fields get flags and variables from the prefix and parsers from their types; an
    # internal() field gets neither.
    assert _load(["--fast", "off", "--folder", "/x"], {}) == Toy(fast=False, folder=Path("/x"))
    assert _load([], {"TOY_FAST": "yes", "TOY_DERIVED": "other"}) == Toy(fast=True)
    with pytest.raises(SystemExit):
        _load(["--derived", "x"], {})
    # A repeated flag collects every occurrence; the variable separates by commas.
    assert _load(["--host", "a", "--host", "b,c"], {"TOY_HOSTS": "z"}).hosts == ("a", "b", "c")
    assert _load([], {"TOY_HOSTS": " y, z ,"}).hosts == ("y", "z")


def test_aliases_in_order() -> None:
    assert _load([], {"PORT": "5"}).port == 5
    assert _load([], {"PORT": "5", "TOY_PORT": "6"}).port == 6
    gateway = parse_config(["--engine", "http://a"], {**GATEWAY_ENV, "REDIS_URL": "redis://r:1/0"})
    assert gateway.redis_url == "redis://r:1/0"
    both = {**GATEWAY_ENV, "REDIS_URL": "redis://r:1/0", "KEEPWARM_REDIS_URL": "redis://k:2/0"}
    assert parse_config(["--engine", "http://a"], both).redis_url == "redis://k:2/0"
    assert (
        parse_config(["--engine", "http://a", "--redis-url", "redis://f:3/0"], both).redis_url
        == "redis://f:3/0"
    )


def test_secret_from_variable_or_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-the-file-0123\n")
    assert _load([], {"TOY_TOKEN_FILE": str(token)}).token == "from-the-file-0123"
    toy = _load([], {"TOY_TOKEN_FILE": str(token), "TOY_TOKEN": "from-the-variable"})
    assert toy.token == "from-the-variable" and "from-the-variable" not in repr(toy)
    with pytest.raises(SystemExit):  # a secret is never a flag (it would show in `ps`)
        _load(["--token", "x"], {})
    with pytest.raises(SettingsError, match=r"cannot read TOY_TOKEN_FILE '.*/missing': No such file"):
        _load([], {"TOY_TOKEN_FILE": str(tmp_path / "missing")})
    # With the variable set the file is not read at all.
    assert _load([], {"TOY_TOKEN_FILE": str(tmp_path / "missing"), "TOY_TOKEN": "v"}).token == "v"
    # The gateway's engine token and the dashboard's key the same way.
    gateway = parse_config(
        ["--engine", "http://a"], {**GATEWAY_ENV, "KEEPWARM_ENGINE_TOKEN_FILE": str(token)}
    )
    assert gateway.engine_token == "from-the-file-0123" and "from-the-file" not in repr(gateway)
    assert UiSettings.from_env({"KEEPWARM_UI_API_KEY_FILE": str(token)}).api_key == "from-the-file-0123"
    assert "KEEPWARM_ENGINE_TOKEN" in env_names(EngineConfig)
    # The engine's file is read by entrypoint.sh (which makes the token there first), not by the engine.
    assert "KEEPWARM_ENGINE_TOKEN_FILE" not in env_names(EngineConfig)


def test_a_bad_value_names_the_flag_or_variable_and_the_default() -> None:
    with pytest.raises(SettingsError, match=r"^TOY_PORT 'many': expected a whole number \(default: 8000\)$"):
        _load([], {"TOY_PORT": "many"})
    with pytest.raises(SettingsError, match=r"^PORT 'x': expected a whole number"):
        _load([], {"PORT": "x"})
    with pytest.raises(SettingsError, match=r"^--ratio 'half': expected a number \(default: 0.5\)$"):
        _load(["--ratio", "half"], {})
    with pytest.raises(SettingsError, match=r"^--fast 'maybe': expected true or false"):
        _load(["--fast", "maybe"], {})
    with pytest.raises(SettingsError, match=r"^KEEPWARM_DISK_BUDGET '4q': size '4q' is not a number"):
        config_from(None, {"KEEPWARM_MODEL": "/m", "KEEPWARM_DISK_BUDGET": "4q"}, cache_dir_default=False)
    with pytest.raises(SettingsError, match=r"^KEEPWARM_FSYNC 'sometimes': expected true or false"):
        config_from(None, {"KEEPWARM_MODEL": "/m", "KEEPWARM_FSYNC": "sometimes"}, cache_dir_default=False)
    with pytest.raises(
        SettingsError, match=r"^KEEPWARM_UI_REFRESH_S 'soon': expected a number \(default: 5.0\)$"
    ):
        UiSettings.from_env({"KEEPWARM_UI_REFRESH_S": "soon"})


def test_engine_values_as_before() -> None:
    env = {"KEEPWARM_MODEL": "/m", "KEEPWARM_MIN_FREE_DISK": "auto", "KEEPWARM_USE_TRITON": "auto"}
    cfg = config_from(None, {**env, "KEEPWARM_DISK_BUDGET": "1.5g", "KEEPWARM_CACHE_DIR": "none"})
    assert (cfg.model, cfg.models, cfg.disk_budget, cfg.cache_dir) == (Path("/m"), (), 1536 * 1024**2, None)
    assert (cfg.min_free_disk, cfg.use_triton, cfg.fsync) == (None, None, True)
    p = argparse.ArgumentParser()
    settings.add_arguments(p, EngineConfig)
    argv = ["--model", "/a", "--model", "/b", "--use-triton", "false", "--fsync", "0", "--kv-budget", "512m"]
    cfg = config_from(p.parse_args(argv), env, cache_dir_default=False)
    assert (cfg.model, cfg.models, cfg.use_triton, cfg.fsync) == (
        Path("/a"),
        (Path("/a"), Path("/b")),
        False,
        False,
    )
    assert (cfg.kv_budget, cfg.cache_dir, cfg.keepalive_s) == (512 * 1024**2, None, 5.0)
    assert [format_size(n) for n in (0, 16 * 1024**3, 3 * 1024**2, 1000)] == ["0", "16g", "3m", "1000"]
    assert all(parse_size(format_size(n)) == n for n in (0, 5, 2048, 7 * 1024**4))


def test_env_names_of_the_services() -> None:
    assert {"KEEPWARM_MODEL", "KEEPWARM_CACHE_DIR", "KEEPWARM_PORT", "KEEPWARM_ENGINE_TOKEN"} <= env_names(
        EngineConfig
    )
    assert "KEEPWARM_MODELS" not in env_names(EngineConfig)  # `models` is read as KEEPWARM_MODEL
    assert {
        "KEEPWARM_ENGINES",
        "KEEPWARM_REDIS_URL",
        "REDIS_URL",
        "KEEPWARM_API_KEYS",
        "KEEPWARM_API_KEYS_FILE",
        "KEEPWARM_SECRET",
        "KEEPWARM_GATEWAY_PORT",
        "KEEPWARM_ENGINE_TOKEN",
        "KEEPWARM_ENGINE_TOKEN_FILE",
    } <= env_names(GatewayConfig)
    assert "KEEPWARM_TIMELINE_LEN" not in env_names(GatewayConfig)  # internal
    assert env_names(UiSettings) == {
        "KEEPWARM_UI_GATEWAY",
        "KEEPWARM_UI_API_KEY",
        "KEEPWARM_UI_API_KEY_FILE",
        "KEEPWARM_UI_REFRESH_S",
        "KEEPWARM_UI_TIMEOUT_S",
        "KEEPWARM_UI_ADDRESS",
        "KEEPWARM_UI_PORT",
    }


def test_to_env_reads_back() -> None:
    ui = UiSettings(
        gateway="http://gw:1", api_key="k", refresh_s=0.0, timeout_s=2.5, address="0.0.0.0", port=9
    )
    assert UiSettings.from_env(settings.to_env(ui)) == ui
    toy = Toy(port=1, ratio=0.1, hosts=("a", "b"), token="t", fast=False, folder=Path("/f"))
    assert settings.load(Toy, None, settings.to_env(toy)) == toy


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["keepwarm.engine", "serve"], EngineConfig),
        (["keepwarm.api"], GatewayConfig),
        (["keepwarm.ui"], UiSettings),
    ],
)
def test_help_lists_every_variable_and_default(argv: list[str], model: type) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEPWARM_")}
    r = subprocess.run(
        [sys.executable, "-m", *argv, "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for name in env_names(model):
        assert name in text, name
    for spec in settings.specs(model):
        if spec.flag:
            assert spec.flag in text
    if model is EngineConfig:
        assert "[env KEEPWARM_DISK_BUDGET; default 16g]" in text
        assert "environment only: KEEPWARM_ENGINE_TOKEN:" in text
    if model is GatewayConfig:
        assert "[env KEEPWARM_REDIS_URL / REDIS_URL; default redis://127.0.0.1:6379/0]" in text


def test_secret_never_shown() -> None:
    with pytest.raises(SettingsError) as e:
        parse_config(["--engine", "http://a"], {**GATEWAY_ENV, "KEEPWARM_API_KEYS": "sk-very-secret"})
    assert "sk-very-secret" not in str(e.value) and "KEEPWARM_API_KEYS" in str(e.value)
    cfg = parse_config(["--engine", "http://a"], GATEWAY_ENV)
    assert SECRET not in repr(cfg) and "'k'" not in repr(cfg)


def test_readme_tables_are_generated_from_the_models() -> None:
    """README's Configuration tables equal the models' (`python -m keepwarm.settings README.md`
    rewrites them)."""
    blocks = settings.readme_blocks((ROOT / "README.md").read_text())
    assert {model for model, _ in blocks} == {EngineConfig, GatewayConfig, UiSettings}
    for model, table in blocks:
        assert table == settings.markdown_table(model), (
            f"run `python -m keepwarm.settings README.md` ({model})"
        )


def test_a_gateway_byte_size_takes_units_like_the_engines() -> None:
    from keepwarm.api.config import GatewayConfig
    from keepwarm.settings import read

    assert read(GatewayConfig, None, {"KEEPWARM_MAX_BODY_BYTES": "2m"})["max_body_bytes"] == 2 * 1024**2
    assert read(GatewayConfig, None, {"KEEPWARM_MAX_BODY_BYTES": "4096"})["max_body_bytes"] == 4096
