"""Fixtures of the fault tests: the disk cache's index backend (SQLite, or a real Valkey)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.procs import Proc, start_valkey


@pytest.fixture(scope="module")
def cache_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_valkey(tmp_path_factory.mktemp("cache-valkey"))
    yield proc
    proc.stop()


@pytest.fixture(params=["sqlite", "redis"])
def cache_index_url(request: pytest.FixtureRequest) -> str | None:
    """None for the SQLite index, else the URL of a Valkey for `--cache-index redis` (each
    test's folder has its own id there, so tests sharing the server never share keys)."""
    if request.param == "sqlite":
        return None
    proc: Proc = request.getfixturevalue("cache_valkey")
    return proc.url
