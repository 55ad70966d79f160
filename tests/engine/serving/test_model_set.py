"""Several models on one engine (issue 15): each with its own namespace and cache entries,
picked by the request's `model`; loaded on first request; under a --models-budget that fits
one, the least recently used idle model is parked and reloaded on demand, its disk cache
still valid. Real engine process, real HTTP over loopback."""

from __future__ import annotations

import argparse
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keepwarm.engine.config import ConfigError, EngineConfig, add_engine_args, config_from
from keepwarm.engine.serving.model_set import ModelSet, served_configs, weight_bytes
from tests.api.procs import Proc, start_engine
from tests.engine.serving.test_server import metric

SYSTEM = "You are a patient assistant who answers about a small village and its river. " * 2


@pytest.fixture(scope="module")
def models_folder(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two demo models of the same shapes and other weights: alpha (seed 0), beta (seed 1)."""
    from keepwarm.engine.demo.demo_model import make_demo_model

    root = tmp_path_factory.mktemp("served")
    shutil.copytree(tiny_dense_model, root / "alpha")
    make_demo_model(root / "beta", family="dense", seed=1, size="tiny")
    (root / "notes").mkdir()  # no config.json: not a model
    return root


def _parse(argv: list[str], env: dict[str, str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from(p.parse_args(argv), env or {}, cache_dir_default=False)


def test_several_models_from_flags_or_a_folder(models_folder: Path) -> None:
    a, b = models_folder / "alpha", models_folder / "beta"
    cfg = _parse(["--model", str(a), "--model", str(b), "--models-budget", "1m"])
    assert cfg.model == a and cfg.models == (a, b) and cfg.models_budget == 1024**2  # type: ignore[attr-defined]
    assert [c.served_name for c in served_configs(cfg)] == ["alpha", "beta"]  # type: ignore[arg-type]
    folder = _parse(["--model", str(models_folder)])
    assert folder.models == (a, b)  # type: ignore[attr-defined]
    single = _parse([], {"KEEPWARM_MODEL": str(a)})
    assert single.models == () and [c.served_name for c in served_configs(single)] == ["alpha"]  # type: ignore[attr-defined,arg-type]
    with pytest.raises(ConfigError, match="--model-name names one model"):
        _parse(["--model", str(models_folder), "--model-name", "x"])


def test_queue_figures_never_wait_for_a_load_or_a_park(models_folder: Path, tmp_path: Path) -> None:
    """/health reads running / waiting on the event loop; a park holds the set's lock while it
    waits out a step and flushes the disk writer, so the figures must not take that lock."""
    cfg = _parse(["--model", str(models_folder), "--cache-dir", str(tmp_path), "--dtype", "float32"])
    models = ModelSet(served_configs(cfg), 0)  # type: ignore[arg-type]
    try:
        slot, engine = models.acquire("alpha")
        models.release(slot)
        figures: list[int] = []
        with models.lock:  # a load or a park in progress, in another thread
            reader = threading.Thread(target=lambda: figures.extend([models.num_running, models.num_waiting]))
            reader.start()
            reader.join(timeout=30)
            assert not reader.is_alive(), "the queue figures waited for the set's lock"
        assert figures == [0, 0]
    finally:
        models.close()


@pytest.fixture(scope="module")
def engine(models_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    one, two = (
        weight_bytes(_parse(["--model", str(models_folder / m), "--dtype", "float32"]))
        for m in ("alpha", "beta")
    )
    assert two == one
    tmp = tmp_path_factory.mktemp("model-set")
    proc = start_engine(
        models_folder,
        tmp / "cache",
        tmp / "logs",
        extra=["--models-budget", str(one + one // 2), "--memory-budget", "0"],
    )
    yield proc
    proc.stop()


def _chat(engine: Proc, model: str, messages: list[dict[str, str]], **kw: object) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)


def _residency(engine: Proc) -> dict[str, str]:
    cards = httpx.get(engine.url + "/v1/models").json()["data"]
    return {c["id"]: c["residency"] for c in cards}


def test_alternating_models_park_and_reload_and_turn_two_restores_from_disk(engine: Proc) -> None:
    # the default model loads at start; the other waits for its first request
    assert _residency(engine) == {"alpha": "loaded", "beta": "parked"}
    health = httpx.get(engine.url + "/health").json()
    assert health["model"] == "alpha" and health["models"] == {"alpha": "loaded", "beta": "parked"}

    beta1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the mill."}]
    r = _chat(engine, "beta", beta1)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["model"] == "beta"
    assert _residency(engine) == {"alpha": "parked", "beta": "loaded"}

    alpha1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And the bridge?"}]
    r = _chat(engine, "alpha", alpha1)
    assert r.status_code == 200 and r.json()["model"] == "alpha"
    assert _residency(engine) == {"alpha": "loaded", "beta": "parked"}

    # turn 2 on beta, parked since its turn 1: reloaded, and its prefix comes from disk
    beta2 = [*beta1, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
             {"role": "user", "content": "What did the miller do in winter?"}]  # fmt: skip
    r = _chat(engine, "beta", beta2)
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["usage"]["timings"]["cache_source"] == "disk"
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _residency(engine) == {"alpha": "parked", "beta": "loaded"}
    # the restored answer is the uncached one
    cold = _chat(engine, "beta", beta2, prefix_cache={"scope": "off"}).json()
    assert cold["usage"]["timings"]["cache_source"] == "none"
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]

    text = httpx.get(engine.url + "/metrics").text
    loads = {m: metric(text, f'keepwarm_model_loads_total{{model="{m}"}}') for m in ("alpha", "beta")}
    parks = {m: metric(text, f'keepwarm_model_parks_total{{model="{m}"}}') for m in ("alpha", "beta")}
    assert loads == {"alpha": 2, "beta": 2} and parks == {"alpha": 2, "beta": 1}
    load_s = {m: metric(text, f'keepwarm_model_load_seconds_total{{model="{m}"}}') for m in ("alpha", "beta")}
    park_s = {m: metric(text, f'keepwarm_model_park_seconds_total{{model="{m}"}}') for m in ("alpha", "beta")}
    assert all(v > 0 for v in load_s.values()) and all(v > 0 for v in park_s.values())
    assert metric(text, 'keepwarm_model_loaded{model="beta"}') == 1
    assert metric(text, 'keepwarm_model_loaded{model="alpha"}') == 0
    assert metric(text, "keepwarm_requests_total") == 4  # counters survive the parks
    print(
        "\nmean load s:", {m: round(load_s[m] / loads[m], 4) for m in loads},
        "mean park s:", {m: round(park_s[m] / parks[m], 4) for m in parks},
    )  # fmt: skip


def test_each_model_has_its_own_namespace_and_entries(engine: Proc) -> None:
    a = httpx.get(engine.url + "/v1/cache", params={"model": "alpha"}).json()
    b = httpx.get(engine.url + "/v1/cache", params={"model": "beta"}).json()
    assert a["model"] == "alpha" and b["model"] == "beta"
    assert a["namespace"] != b["namespace"]
    for info in (a, b):  # both models' entries, each under its own namespace, in one folder
        assert any(e["namespace"] == info["namespace"] for e in info["entries"])


def test_an_unknown_model_is_a_404_listing_the_served_ones(engine: Proc) -> None:
    r = _chat(engine, "gamma", [{"role": "user", "content": "hi"}])
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model"
    assert "'alpha', 'beta'" in err["message"] and "'default' names 'alpha'" in err["message"]
    # `default` (and no model at all) is the first model
    assert _chat(engine, "default", [{"role": "user", "content": "hi"}]).json()["model"] == "alpha"
