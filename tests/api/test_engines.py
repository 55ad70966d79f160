"""EnginePool against a real engine's /health (reached under two host names, so
two 'engines' are healthy) and a port nobody listens on."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from keepwarm.api.engines import EnginePool
from tests.api.procs import ENGINE_AUTH, Proc, free_port

pytestmark = pytest.mark.anyio


def rank(url: str, affinity: str) -> bytes:
    return hashlib.blake2b(f"{affinity}\0{url}".encode(), digest_size=8).digest()


async def test_probe_and_affinity_order(engine: Proc) -> None:
    port = engine.url.rsplit(":", 1)[1]
    one, two, dead = engine.url, f"http://localhost:{port}", f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient(headers=ENGINE_AUTH) as client:
        pool = EnginePool([one, two, dead], client, interval_s=60)
        assert pool.candidates("s") == [] and not pool.any_healthy()  # nothing probed yet
        await pool.probe_all()
        assert pool.status() == [{"url": one, "healthy": True}, {"url": two, "healthy": True},
                                 {"url": dead, "healthy": False}]  # fmt: skip
        h = pool.health(one)
        assert (h.model, h.queue_depth, h.error) == ("tiny", 0, None) and len(h.namespace) > 8
        # The served models, read from /v1/models (with the engine token).
        assert list(h.models) == ["tiny"] and h.models["tiny"]["max_model_len"] == 512
        assert list(pool.served()) == ["tiny"] and len(pool.served()["tiny"]) == 2
        assert pool.candidates("s", model="other") == [] and pool.known("tiny") and not pool.known("other")
        assert pool.health(dead).error.startswith("ConnectError")
        for affinity in ("s1", "s2", "s3", "tenant"):
            expected = sorted([one, two], key=lambda u, a=affinity: rank(u, a))
            assert pool.candidates(affinity) == expected
            # The session's own engine goes first when healthy; an unhealthy one is ignored.
            assert pool.candidates(affinity, preferred=expected[1]) == [expected[1], expected[0]]
            assert pool.candidates(affinity, preferred=dead) == expected
        pool.mark_down(one, "test")
        assert pool.candidates("s1", preferred=one) == [two]
        await pool.probe(one)
        assert pool.health(one).healthy
