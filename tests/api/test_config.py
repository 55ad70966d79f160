from __future__ import annotations

from pathlib import Path

import pytest

from keepwarm.api.config import ConfigError, parse_api_keys, parse_api_keys_file, parse_config

SECRET = "s" * 20


def test_keys_from_env_string() -> None:
    assert parse_api_keys("k1:alpha, k2:beta,") == {"k1": "alpha", "k2": "beta"}
    # A key may itself contain ':'; the tenant is after the last one.
    assert parse_api_keys("sk:abc:team") == {"sk:abc": "team"}
    with pytest.raises(ValueError, match="item 2 must be 'key:tenant'"):
        parse_api_keys("k1:alpha,nocolon")
    # Through the loader the message names the variable and never echoes the (secret) keys.
    with pytest.raises(ConfigError, match="KEEPWARM_API_KEYS: item 1 must be 'key:tenant'") as e:
        parse_config(["--engine", "http://a"], {"KEEPWARM_API_KEYS": "sk-secret", "KEEPWARM_SECRET": SECRET})
    assert "sk-secret" not in str(e.value)


def test_keys_from_file(tmp_path: Path) -> None:
    assert parse_api_keys_file("# comment\nk1 alpha\n\n k2  beta  # trailing\n") == {
        "k1": "alpha",
        "k2": "beta",
    }
    f = tmp_path / "keys"
    f.write_text("k1 alpha extra\n")
    env = {"KEEPWARM_API_KEYS_FILE": str(f), "KEEPWARM_SECRET": SECRET}
    with pytest.raises(
        ConfigError, match=r"KEEPWARM_API_KEYS_FILE '.*/keys': line 1: expected 'key tenant', got 3"
    ):
        parse_config(["--engine", "http://a"], env)
    with pytest.raises(ConfigError, match="cannot read --api-keys-file '.*/missing': No such file"):
        parse_config(["--engine", "http://a", "--api-keys-file", str(tmp_path / "missing")], env)
    with pytest.raises(ConfigError, match="cannot read KEEPWARM_API_KEYS_FILE"):
        parse_config(["--engine", "http://a"], {**env, "KEEPWARM_API_KEYS_FILE": str(tmp_path / "missing")})


def test_flags_override_env(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("filekey filetenant\n")
    env = {
        "KEEPWARM_ENGINES": "http://a:1/,http://b:2",
        "REDIS_URL": "redis://r:6379/1",
        "KEEPWARM_API_KEYS": "envkey:envtenant",
        "KEEPWARM_API_KEYS_FILE": str(keys),
        "KEEPWARM_SECRET": SECRET,
        "KEEPWARM_RATE_LIMIT": "5",
    }
    cfg = parse_config([], env)
    assert cfg.engines == ("http://a:1", "http://b:2")
    assert cfg.redis_url == "redis://r:6379/1"
    assert dict(cfg.api_keys) == {"filekey": "filetenant", "envkey": "envtenant"}
    assert cfg.secret == SECRET.encode()
    assert (cfg.rate_limit, cfg.rate_window_s, cfg.port) == (5, 60, 8000)
    cfg = parse_config(["--engine", "http://c:3", "--port", "9001", "--rate-limit", "0"], env)
    assert cfg.engines == ("http://c:3",)
    assert (cfg.port, cfg.rate_limit) == (9001, 0)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET}, "no engine configured"),
        (["--engine", "a:1"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET}, "must start with http"),
        (["--engine", "http://a"], {"KEEPWARM_SECRET": SECRET}, "no API keys"),
        (["--engine", "http://a"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": "short"}, "KEEPWARM_SECRET"),
        (["--engine", "http://a", "--engine", "http://a"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET},
         "distinct"),
        (["--engine", "http://a"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET,
                                    "KEEPWARM_RATE_WINDOW": "x"}, r"KEEPWARM_RATE_WINDOW 'x': expected a whole number \(default: 60\)"),
        (["--engine", "http://a", "--health-timeout", "soon"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET},
         r"--health-timeout 'soon': expected a number \(default: 2.0\)"),
        # A ':' in a tenant would let "a:b"'s session "c" be tenant "a"'s session "b:c" in Redis.
        (["--engine", "http://a"], {"KEEPWARM_API_KEYS_FILE": "", "KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET,
                                    "KEEPWARM_ADMIN_TENANTS": "a:b"}, r"tenant name 'a:b': use 1-64 of"),
        (["--engine", "http://a"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET,
                                    "KEEPWARM_ENGINE_TOKEN": "short"}, "KEEPWARM_ENGINE_TOKEN must be at least 16"),
        (["--engine", "http://a", "--max-messages", "0"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET},
         r"--max-messages \(KEEPWARM_MAX_MESSAGES\) must be positive"),
        (["--engine", "http://a"], {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET,
                                    "KEEPWARM_REDIS_TIMEOUT": "0"}, r"--redis-timeout \(KEEPWARM_REDIS_TIMEOUT\)"),
    ],
)  # fmt: skip
def test_bad_config_names_what_to_change(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, env)


def test_cli_exits_2_naming_the_missing_setting() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEPWARM_")}
    r = subprocess.run([sys.executable, "-m", "keepwarm.api", "--port", "1"], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "no engine configured: pass --engine http://HOST:PORT or set KEEPWARM_ENGINES" in r.stderr


def test_tenant_names_and_hardening_settings(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 team:x\n")
    with pytest.raises(ConfigError, match="tenant name 'team:x'"):
        parse_config(
            ["--engine", "http://a"], {"KEEPWARM_API_KEYS_FILE": str(keys), "KEEPWARM_SECRET": SECRET}
        )
    token = tmp_path / "token"
    token.write_text("file-token-0123456789\n")
    env = {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": SECRET, "KEEPWARM_ENGINE_TOKEN_FILE": str(token)}
    cfg = parse_config(["--engine", "http://a"], env)
    # Defaults: no admin tenant, bounded messages, short Redis timeouts.
    assert (cfg.admin_tenants, cfg.max_messages, cfg.redis_timeout_s, cfg.redis_cooldown_s) == (
        (),
        1024,
        0.5,
        0.5,
    )
    assert cfg.engine_token == "file-token-0123456789" and "file-token" not in repr(cfg)
    # The variable wins over the file; flags set the rest.
    cfg = parse_config(["--engine", "http://a", "--max-messages", "7", "--redis-timeout", "0.1",
                        "--redis-cooldown", "2", "--health-timeout", "1.5", "--admin-tenants", "t, ops"],
                       {**env, "KEEPWARM_ENGINE_TOKEN": "env-token-0123456789"})  # fmt: skip
    assert cfg.engine_token == "env-token-0123456789"
    assert (cfg.max_messages, cfg.redis_timeout_s, cfg.redis_cooldown_s, cfg.health_timeout_s) == (
        7,
        0.1,
        2.0,
        1.5,
    )
    assert cfg.admin_tenants == ("t", "ops")
    with pytest.raises(ConfigError, match="cannot read KEEPWARM_ENGINE_TOKEN_FILE"):
        parse_config(["--engine", "http://a"], {**env, "KEEPWARM_ENGINE_TOKEN_FILE": str(tmp_path / "nope")})
