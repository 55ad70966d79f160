"""Process fixtures for the gateway tests (helpers live in tests/api/procs.py so
other test packages can import them): one Valkey server, a tiny demo model and
one engine + gateway per session (the engine answers only the gateway's token);
each test gets a clean Redis database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.api.procs import ENGINE_TOKEN, Proc, make_demo_model, start_engine, start_gateway, start_valkey


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield proc
    proc.stop()


@pytest.fixture
def redis_sync(valkey: Proc) -> Iterator[redis.Redis]:
    """A decoding client on a freshly flushed database."""
    client = redis.Redis.from_url(valkey.url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def engine(demo_model: Path, tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[Proc]:
    proc = start_engine(demo_model, tmp_path_factory.mktemp("cache"), logs, token=ENGINE_TOKEN)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def gateway(engine: Proc, valkey: Proc, logs: Path) -> Iterator[Proc]:
    proc = start_gateway([engine.url], valkey.url, logs, engine_token=ENGINE_TOKEN)
    yield proc
    proc.stop()
