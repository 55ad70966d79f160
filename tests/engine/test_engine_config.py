"""Engine settings (services/engine/config.py): the disk tier's index backend, --weights."""

from __future__ import annotations

import pytest

from keepwarm.engine.config import ConfigError, config_from

BASE = {"KEEPWARM_MODEL": "/models/x", "KEEPWARM_CACHE_DIR": "/var/cache/keepwarm"}


def test_the_index_is_sqlite_unless_asked() -> None:
    cfg = config_from(env=BASE)
    assert (cfg.cache_index, cfg.cache_index_url) == ("sqlite", "")


def test_redis_takes_its_url_from_the_environment() -> None:
    env = {**BASE, "KEEPWARM_CACHE_INDEX": "redis", "KEEPWARM_CACHE_INDEX_URL": "redis://valkey:6379/1"}
    cfg = config_from(env=env)
    assert (cfg.cache_index, cfg.cache_index_url) == ("redis", "redis://valkey:6379/1")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KEEPWARM_CACHE_INDEX": "redis"}, "--cache-index redis needs --cache-index-url"),
        (
            {"KEEPWARM_CACHE_INDEX_URL": "redis://valkey:6379/1"},
            "--cache-index-url is set but --cache-index is sqlite",
        ),
        ({"KEEPWARM_CACHE_INDEX": "postgres"}, "--cache-index 'postgres': use sqlite"),
        (
            {"KEEPWARM_CACHE_INDEX": "redis", "KEEPWARM_CACHE_INDEX_URL": "valkey:6379"},
            "--cache-index-url 'valkey:6379': use redis://",
        ),
    ],
)
def test_a_bad_index_setting_names_the_flag(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from(env={**BASE, **env})


def test_weights_default_to_auto_and_refuse_what_they_cannot_do() -> None:
    assert config_from(env=BASE).weights == "auto"
    assert config_from(env={**BASE, "KEEPWARM_WEIGHTS": "as-file"}).weights == "as-file"
    with pytest.raises(ConfigError, match="--weights 'q4': use one of auto, as-file, bf16"):
        config_from(env={**BASE, "KEEPWARM_WEIGHTS": "q4"})


def test_quantize_takes_q8_0_or_q4_k() -> None:
    assert config_from(env=BASE).quantize == ""
    assert config_from(env={**BASE, "KEEPWARM_QUANTIZE": "q8_0"}).quantize == "q8_0"
    assert config_from(env={**BASE, "KEEPWARM_QUANTIZE": "q4_k"}).quantize == "q4_k"
    with pytest.raises(ConfigError, match="--quantize 'q4_0': use q8_0 or q4_k"):
        config_from(env={**BASE, "KEEPWARM_QUANTIZE": "q4_0"})
