"""The gateway's Prometheus metrics: requests by route template and status, upstream waits,
retries, the Redis breaker and the engine pool; only an admin tenant's key reads them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.procs import ENGINE_TOKEN, Proc, start_gateway

ALPHA = {"Authorization": "Bearer key-alpha"}
BETA = {"Authorization": "Bearer key-beta"}  # the admin tenant here


def samples(gw: Proc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(gw.url + "/metrics", headers=BETA)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


@pytest.fixture
def admin_gateway(engine: Proc, valkey: Proc, logs: Path) -> Iterator[Proc]:
    gw = start_gateway(
        [engine.url], valkey.url, logs, engine_token=ENGINE_TOKEN, extra=["--admin-tenants", "beta"]
    )
    yield gw
    gw.stop()


def test_metrics_count_requests_waits_and_the_pool(admin_gateway: Proc, engine: Proc) -> None:
    gw = admin_gateway.url
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi."}]}
    assert httpx.post(gw + "/v1/chat/completions", json=body, headers=ALPHA, timeout=60).status_code == 200
    assert (
        httpx.post(gw + "/v1/chat/completions", json={**body, "max_tokens": -1}, headers=ALPHA).status_code
        == 400
    )
    assert httpx.post(gw + "/v1/chat/completions", json=body).status_code == 401
    assert httpx.get(gw + "/v1/sessions/nobody", headers=ALPHA).status_code == 404
    assert httpx.get(gw + "/v1/sessions/nobody-else", headers=ALPHA).status_code == 404
    refused = httpx.get(gw + "/metrics", headers=ALPHA)  # every tenant's traffic: admins only
    assert refused.status_code == 403 and "KEEPWARM_ADMIN_TENANTS" in refused.json()["error"]["message"]

    got = samples(admin_gateway)
    chat = "/v1/chat/completions"
    for status, n in (("200", 1.0), ("400", 1.0), ("401", 1.0)):
        assert got[("keepwarm_gateway_requests_total", (("route", chat), ("status", status)))] == n
    # one series for the route template, never one per session id
    assert got[("keepwarm_gateway_requests_total",
                (("route", "/v1/sessions/{session_id:str}"), ("status", "404")))] == 2.0  # fmt: skip
    assert got[("keepwarm_gateway_requests_total", (("route", "/metrics"), ("status", "403")))] == 1.0
    # The one answered chat waited once for its engine's headers; nothing was retried.
    assert got[("keepwarm_gateway_upstream_wait_seconds_count", (("outcome", "answer"),))] == 1.0
    retries = {k[1][0][1]: v for k, v in got.items() if k[0] == "keepwarm_gateway_upstream_retries_total"}
    assert retries == dict.fromkeys(
        ("broken_connection", "engine_down", "engine_lost", "engine_busy", "queue_full"), 0.0
    )
    assert got[("keepwarm_gateway_redis_circuit_open", ())] == 0.0
    assert got[("keepwarm_gateway_engine_healthy", (("engine", engine.url),))] == 1.0
    assert got[("keepwarm_gateway_engine_load", (("engine", engine.url),))] == 0.0
