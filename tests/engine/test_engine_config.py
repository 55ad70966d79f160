"""Engine settings (services/engine/config.py): the disk tier's index backend."""

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
