"""EnginePool against a real engine's /health (reached under two host names, so
two 'engines' are healthy) and a port nobody listens on; load ordering from the
engines' reported sequences and this gateway's open requests; dns+ names whose
addresses are real engines on 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from keepwarm.api.config import ConfigError, parse_config
from keepwarm.api.engines import DnsName, EnginePool, EngineSourceError, parse_engine
from tests.api.procs import ENGINE_AUTH, ENGINE_TOKEN, Proc, free_port, start_engine, wait_http

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
        assert pool.status() == [{"url": one, "healthy": True, "running": 0, "waiting": 0},
                                 {"url": two, "healthy": True, "running": 0, "waiting": 0},
                                 {"url": dead, "healthy": False, "running": None, "waiting": None}]  # fmt: skip
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


async def test_load_orders_engines_and_ties_follow_the_affinity_hash(engine: Proc) -> None:
    port = engine.url.rsplit(":", 1)[1]
    one, two = engine.url, f"http://localhost:{port}"
    async with httpx.AsyncClient(headers=ENGINE_AUTH, timeout=60) as client:
        pool = EnginePool([one, two], client, interval_s=60)
        await pool.probe_all()
        by_hash = {a: sorted([one, two], key=lambda u, a=a: rank(u, a)) for a in (f"s{i}" for i in range(24))}
        assert len({tuple(v) for v in by_hash.values()}) == 2  # both orders occur: ties really are hashed
        # A request this gateway opened counts until it ends: the other engine goes first for every key.
        ticket = pool.begin(one)
        assert pool.health(one).load() == 1
        for a in by_hash:
            assert pool.candidates(a) == [two, one]
            assert pool.candidates(a, preferred=one) == [one, two]  # the session's engine still first
        ticket.close()
        ticket.close()  # idempotent
        assert pool.health(one).load() == 0
        assert all(pool.candidates(a) == order for a, order in by_hash.items())
        # A sequence running on the engine, as its /health reports it, loads both names of it.
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                "temperature": 1.0, "ignore_eos": True, "speculate": False}  # fmt: skip  (still running at the probe)
        async with client.stream("POST", f"{one}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass
            await pool.probe_all()
            assert (pool.health(one).running, pool.health(one).waiting) == (1, 0)
            assert pool.status()[0] == {"url": one, "healthy": True, "running": 1, "waiting": 0}
            # Counted once: the request was not opened through this pool.
            assert pool.health(one).load() == pool.health(two).load() == 1
            # A ticket opened before the probe is part of the engine's own figure from then on.
            ticket = pool.begin(two)
            await pool.probe(two)
            assert pool.health(two).load() == 1
            ticket.close()
            assert pool.health(two).load() == 0  # it ended: the stale figure is corrected down


def test_engine_entries_parse_or_say_what_to_write() -> None:
    assert parse_engine("http://e:8100") == "http://e:8100"
    assert parse_engine("dns+http://engine:8100") == DnsName("dns+http://engine:8100", "http", "engine", 8100)
    assert parse_engine("dns+https://engine").port == 443
    for bad in ("engine:8100", "dns+engine:8100", "dns+http://engine:8100/v1", "dns+http://engine:99999"):
        with pytest.raises(EngineSourceError, match="engine"):
            parse_engine(bad)
    env = {"KEEPWARM_API_KEYS": "k:t", "KEEPWARM_SECRET": "s" * 16}
    cfg = parse_config([], {**env, "KEEPWARM_ENGINES": "dns+http://engine:8100,http://other:8100"})
    assert cfg.engines == ("dns+http://engine:8100", "http://other:8100")
    with pytest.raises(ConfigError, match="dns\\+http://NAME:PORT, nothing more"):
        parse_config(["--engine", "dns+http://engine:8100/x"], env)


async def test_dns_name_engines_join_and_leave_with_the_answer(
    engine: Proc, demo_model: Path, tmp_path: Path, logs: Path
) -> None:
    port = int(engine.url.rsplit(":", 1)[1])
    # A second real engine on another loopback address, same port: what two compose replicas look like.
    other = start_engine(demo_model, tmp_path / "cache", logs, port=port, extra=["--host", "127.0.0.2"],
                         token=ENGINE_TOKEN, wait=False)  # fmt: skip
    other.url = f"http://127.0.0.2:{port}"
    answer: list[str] | Exception = ["127.0.0.1"]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, p: int) -> Sequence[str]:
        asked.append((host, p))
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    first, second = f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"
    try:
        wait_http(other)
        async with httpx.AsyncClient(headers=ENGINE_AUTH) as client:
            pool = EnginePool([f"dns+http://engines.test:{port}"], client, interval_s=60, resolver=resolver)
            assert pool.urls == [] and pool.candidates("s") == []  # nothing resolved before the first poll
            await pool.probe_all()
            assert asked == [("engines.test", port)] and pool.urls == [first] and pool.health(first).healthy
            answer = ["127.0.0.2", "127.0.0.1", "127.0.0.2"]  # a scale-up; order and repeats do not matter
            await pool.probe_all()
            assert pool.urls == [first, second]
            assert [e["healthy"] for e in pool.status()] == [True, True]
            assert pool.health(second).namespace == pool.health(first).namespace  # same model, same cache
            lost = pool.lost(second)
            answer = ["127.0.0.1"]  # a scale-down: the address leaves the pool, its waiters are told
            await pool.probe_all()
            assert pool.urls == [first] and lost.is_set() and pool.lost(second).is_set()
            assert pool.health(second).error == "no longer in the pool" and pool.candidates("s") == [first]
            answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            await pool.probe_all()
            assert pool.urls == [first] and pool.any_healthy()  # a failed lookup keeps the last answer
            answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            await pool.probe_all()
            assert pool.urls == [] and pool.status() == []
            assert pool.problems() == [
                f"dns+http://engines.test:{port}: engines.test does not resolve (Name or service not known)"
            ]
            # The system resolver: localhost's A record.
            real = EnginePool([f"dns+http://localhost:{port}"], client, interval_s=60)
            await real.probe_all()
            assert real.urls == [first] and real.health(first).healthy
    finally:
        other.stop()
