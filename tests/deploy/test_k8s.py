"""deploy/k8s, checked offline.

Each kustomization root (deploy/k8s and every overlay under deploy/k8s/overlays) is rendered
here in plain Python from its kustomization.yaml (resources, folders of them, configMapGenerator,
images); where kubectl is installed, `kubectl kustomize` must render exactly the same. Every
rendered resource is validated against the Kubernetes JSON schemas shipped by
kubernetes-validate (strict: unknown fields fail), then cross-checked the way no schema can:
selectors, ports, probes and the routes they hit, HPA/PDB targets, shutdown timing, and the
settings in the ConfigMap against service/settings.py and docker/Dockerfile.

Why one module over 450 lines: every test reads the same rendered kustomization (the
renderer and its lookups above), which a split would render again or move to a helper used
by this file alone.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from fastapi.routing import APIRoute

from service.http import create_app
from service.settings import Settings
from tests.conftest import ROOT
from tests.deploy.support import load_image, settings_env_names, settings_from

K8S = ROOT / "deploy" / "k8s"
ROOTS = [K8S, *sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))]
# Oldest Kubernetes release these manifests support (PDB unhealthyPodEvictionPolicy, HPA v2
# behavior), and the newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
Resource = dict[str, Any]


# --- rendering --------------------------------------------------------------------------------


def env_file(path: Path) -> dict[str, str]:
    """A kustomize `envs` file: KEY=value lines; blank lines and # comments skipped."""
    data = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not KEY=value: {line!r}"
            data[key.strip()] = value
    return data


def containers(resource: Resource) -> list[Resource]:
    if resource["kind"] != "Deployment":
        return []
    spec = resource["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def pod_containers(resource: Resource) -> list[Resource]:
    """The containers of a Deployment's or a Job's pods (what kustomize's images rewrite)."""
    if resource["kind"] not in ("Deployment", "Job"):
        return []
    spec = resource["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


#: Custom resources (no schema in kubernetes-validate): checked by tests of their own.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def render(directory: Path) -> list[Resource]:
    """What `kustomize build directory` gives, for the features these manifests use; anything
    else in a kustomization.yaml fails here rather than being silently ignored."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    unsupported = set(kust) - {"apiVersion", "kind", "resources", "configMapGenerator", "images"}
    assert not unsupported, f"{directory}: teach render() about {sorted(unsupported)}"
    out: list[Resource] = []
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            out += render(path)
        else:
            out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for gen in kust.get("configMapGenerator", []):
        assert set(gen) <= {"name", "envs", "literals", "behavior"}, gen
        data: dict[str, str] = {}
        for name in gen.get("envs", []):
            data.update(env_file(directory / name))
        data.update(lit.split("=", 1) for lit in gen.get("literals", []))
        existing = [
            r for r in out if r["kind"] == "ConfigMap" and r["metadata"]["name"] == gen["name"]
        ]
        if gen.get("behavior", "create") == "merge":
            assert existing, f"{directory}: merge into a ConfigMap {gen['name']} that no base has"
            existing[0]["data"].update(data)
        else:
            assert not existing, f"{directory}: {gen['name']} generated twice"
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": gen["name"]},
                    "data": data,
                }
            )
    for image in kust.get("images", []):
        for resource in out:
            for container in pod_containers(resource):
                name = re.sub(r"[:@].*$", "", container["image"])
                if name == image["name"]:
                    tag = image.get("newTag")
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    return out


@pytest.fixture(scope="module", params=ROOTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def rendered(request: pytest.FixtureRequest) -> list[Resource]:
    resources = render(request.param)
    keys = [(r["kind"], r["metadata"]["name"]) for r in resources]
    assert len(keys) == len(set(keys)), f"duplicate resources: {keys}"
    return resources


def one(resources: list[Resource], kind: str, name: str) -> Resource:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_labels(deployment: Resource) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected(resources: list[Resource], selector: dict[str, str]) -> list[Resource]:
    return [d for d in resources if d["kind"] == "Deployment" and selects(selector, pod_labels(d))]


def kind(resources: list[Resource], name: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == name]


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- the app Deployment: the one the settings ConfigMap configures ------------------------------


def settings_configmaps(resources: list[Resource], container: Resource) -> list[Resource]:
    names = [e["configMapRef"]["name"] for e in container.get("envFrom", []) if "configMapRef" in e]
    return [one(resources, "ConfigMap", n) for n in names]


def app_deployment(resources: list[Resource]) -> tuple[Resource, Resource]:
    """The budgetserve Deployment and its container: the one given BUDGETSERVE_ settings."""
    found = [
        (d, c)
        for d in kind(resources, "Deployment")
        for c in containers(d)
        if any(
            k.startswith("BUDGETSERVE_")
            for cm in settings_configmaps(resources, c)
            for k in cm["data"]
        )
    ]
    assert len(found) == 1, f"expected one container configured by BUDGETSERVE_ settings: {found}"
    return found[0]


def app_env(resources: list[Resource], container: Resource) -> dict[str, str]:
    env: dict[str, str] = dict(load_image().env)  # the image's ENV, then envFrom, then env
    for cm in settings_configmaps(resources, container):
        env.update(cm["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def http_port(container: Resource) -> int:
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert "http" in ports, "the container port must be named http (Prometheus and probes)"
    port: int = ports["http"]
    return port


def resolve_port(container: Resource, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"no container port named {port!r} in {container['name']}"
    return int(named[0])


def routes() -> set[str]:
    app = create_app(Settings(models_dir=Path("/nonexistent")))
    return {r.path for r in app.routes if isinstance(r, APIRoute)} | {"/metrics"}


def uvicorn_graceful_timeouts() -> list[float]:
    tree = ast.parse((ROOT / "service" / "__main__.py").read_text())
    return [
        float(kw.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "timeout_graceful_shutdown"
        and isinstance(kw.value, ast.Constant)
        and isinstance(kw.value.value, int | float)
    ]


# --- tests ------------------------------------------------------------------------------------


def test_every_manifest_is_part_of_the_kustomization() -> None:
    """A manifest added to deploy/k8s but not listed would be neither applied nor checked."""

    def listed(directory: Path) -> Iterator[Path]:
        kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
        yield directory / "kustomization.yaml"
        for entry in kust.get("resources", []):
            path = (directory / entry).resolve()
            yield from listed(path) if path.is_dir() else [path]
        for gen in kust.get("configMapGenerator", []):
            yield from ((directory / e).resolve() for e in gen.get("envs", []))

    reached = {p for root in ROOTS for p in listed(root)}
    files = {p.resolve() for p in K8S.rglob("*") if p.is_file() and p.suffix != ".md"}
    assert files - reached == set(), "not referenced by any kustomization"
    assert {r["kind"] for r in render(K8S)} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_resources_match_the_kubernetes_schemas(rendered: list[Resource], version: str) -> None:
    errors = []
    for resource in rendered:
        name = f"{resource['kind']}/{resource['metadata']['name']}"
        if (resource["apiVersion"], resource["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{name}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{name}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_selectors_and_ports_agree(rendered: list[Resource]) -> None:
    for deployment in kind(rendered, "Deployment"):
        match = deployment["spec"]["selector"]["matchLabels"]
        assert selects(match, pod_labels(deployment)), deployment["metadata"]["name"]
        for spread in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert spread["labelSelector"]["matchLabels"] == match
    for service in kind(rendered, "Service"):
        name = service["metadata"]["name"]
        targets = selected(rendered, service["spec"]["selector"])
        assert len(targets) == 1, f"Service {name} selects {len(targets)} Deployments"
        for port in service["spec"]["ports"]:
            assert any(
                resolve_port(c, port.get("targetPort", port["port"]))
                in {p["containerPort"] for p in c.get("ports", [])}
                for c in containers(targets[0])
                if c.get("ports")
            ), f"Service {name} port {port} reaches no container port"
    deployment, _ = app_deployment(rendered)
    fronts = [
        s
        for s in kind(rendered, "Service")
        if selected(rendered, s["spec"]["selector"]) == [deployment]
    ]
    assert fronts, "no Service in front of the budgetserve Deployment"


def test_network_policies_admit_the_api_to_redis_only(rendered: list[Resource]) -> None:
    """Redis runs without auth: where it is in the rendering, a policy must cover its pods and
    let in exactly the API's pods, on the port its container listens on."""
    redis = [d for d in kind(rendered, "Deployment") if d["metadata"]["name"].endswith("redis")]
    if not redis:  # the external-redis overlay: nothing to protect here
        assert not kind(rendered, "NetworkPolicy")
        return
    (cache,) = redis
    api, _ = app_deployment(rendered)
    policies = [
        n
        for n in kind(rendered, "NetworkPolicy")
        if selects(n["spec"]["podSelector"]["matchLabels"], pod_labels(cache))
    ]
    assert len(policies) == 1, "Redis pods need exactly one NetworkPolicy"
    (policy,) = policies
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    cache_ports = {p["containerPort"] for c in containers(cache) for p in c.get("ports", [])}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            admitted = peer["podSelector"]["matchLabels"]
            assert selects(admitted, pod_labels(api)), "the API's pods are not admitted"
            assert not selects(admitted, pod_labels(cache)), "the policy admits Redis itself"
        assert {p["port"] for p in rule["ports"]} <= cache_ports


def test_app_container_port_probes_and_scrape_annotations(rendered: list[Resource]) -> None:
    deployment, container = app_deployment(rendered)
    port = http_port(container)
    env = app_env(rendered, container)
    assert int(env["BUDGETSERVE_PORT"]) == port, "BUDGETSERVE_PORT differs from the http port"
    exposed = load_image().exposed()
    assert port in exposed, f"the image EXPOSEs {exposed}, the pod uses {port}"
    served = routes()
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(probe_name)
        if probe is None and probe_name == "startupProbe":
            continue
        assert probe and "httpGet" in probe, f"{probe_name} must be an HTTP probe"
        get = probe["httpGet"]
        assert get["path"] in served, f"{probe_name} probes {get['path']}, not a route"
        assert resolve_port(container, get["port"]) == port, f"{probe_name} probes another port"
        if probe_name in expected:
            assert get["path"] == expected[probe_name]
    notes = deployment["spec"]["template"]["metadata"].get("annotations", {})
    assert notes.get("prometheus.io/scrape") == "true"
    assert notes.get("prometheus.io/port") == str(port)
    assert notes.get("prometheus.io/path") == "/metrics" and "/metrics" in served


def test_rollout_and_shutdown_timing(rendered: list[Resource]) -> None:
    deployment, container = app_deployment(rendered)
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert rolling["maxUnavailable"] in (0, "0%") and rolling["maxSurge"] not in (0, "0%")
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        drain = float(pre_stop["sleep"]["seconds"])
    else:
        command = pre_stop.get("exec", {}).get("command", [])
        assert command[:1] == ["sleep"] and len(command) == 2, "preStop must sleep (drain)"
        drain = float(command[1])
    assert drain > 0
    timeouts = uvicorn_graceful_timeouts()
    assert timeouts, "service/__main__.py passes no timeout_graceful_shutdown to uvicorn"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain + max(timeouts), (
        f"terminationGracePeriodSeconds {grace} <= preStop {drain} + uvicorn {max(timeouts)}: "
        "in-flight requests would be killed"
    )


def test_autoscaling_and_disruption_budget(rendered: list[Resource]) -> None:
    deployment, _ = app_deployment(rendered)
    (hpa,) = kind(rendered, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (deployment["apiVersion"], "Deployment")
    assert ref["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA owns replicas; apply would reset them"
    low = hpa["spec"]["minReplicas"]
    assert 2 <= low <= hpa["spec"]["maxReplicas"]
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Resource":
            resource = metric["resource"]["name"]
            for c in containers(deployment):
                assert resource in c["resources"]["requests"], (
                    f"HPA on {resource} utilisation needs a {resource} request in {c['name']}"
                )
    (pdb,) = kind(rendered, "PodDisruptionBudget")
    assert selected(rendered, pdb["spec"]["selector"]["matchLabels"]) == [deployment]
    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        allowed = spec["maxUnavailable"]
        assert allowed not in (0, "0%"), "the PDB would block every drain"
    else:
        assert isinstance(spec["minAvailable"], int) and spec["minAvailable"] < low, (
            "at minReplicas the PDB would block every drain"
        )


def test_settings_configmap_is_real_settings(
    rendered: list[Resource], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment, container = app_deployment(rendered)
    maps = settings_configmaps(rendered, container)
    assert maps, "the budgetserve container takes no ConfigMap (envFrom)"
    known = settings_env_names()
    for cm in maps:
        unknown = sorted(set(cm["data"]) - known)
        assert not unknown, f"ConfigMap {cm['metadata']['name']}: not settings: {unknown}"
    env = app_env(rendered, container)
    settings = settings_from(env, monkeypatch, "the pod's environment")
    assert str(settings.models_dir) == load_image().env["BUDGETSERVE_MODELS_DIR"]
    # Workers x extraction threads within the CPU request (0 threads = the node's CPUs).
    cpu = cpu_cores(container["resources"]["requests"]["cpu"])
    assert settings.extraction_threads > 0, "set BUDGETSERVE_EXTRACTION_THREADS: 0 counts the node"
    assert settings.workers * settings.extraction_threads <= max(cpu, 1)
    # Service links would add <SERVICE>_PORT etc.: BUDGETSERVE_PORT for a Service budgetserve.
    if deployment["spec"]["template"]["spec"].get("enableServiceLinks", True):
        for service in kind(rendered, "Service"):
            prefix = service["metadata"]["name"].upper().replace("-", "_")
            links = {f"{prefix}_PORT", f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT"}
            assert not links & known, f"Service links would set {sorted(links & known)}"
    # A REDIS_URL naming an in-cluster host must name a Service here, on its port.
    match = re.fullmatch(
        r"rediss?://(?:[^@/]*@)?([^:/]+)(?::(\d+))?(?:/.*)?", settings.redis_url or ""
    )
    if match and "." not in match.group(1):
        redis = one(rendered, "Service", match.group(1))
        assert int(match.group(2) or 6379) in {p["port"] for p in redis["spec"]["ports"]}


def test_pods_run_locked_down(rendered: list[Resource]) -> None:
    image = load_image()
    app, _ = app_deployment(rendered)
    for deployment in kind(rendered, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for c in containers(deployment):
            sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
            name = f"{deployment['metadata']['name']}/{c['name']}"
            assert sc.get("runAsNonRoot") is True, name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert sc.get("readOnlyRootFilesystem") is True, name
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), name
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), name
            assert "memory" in resources.get("limits", {}), name
            tag = c["image"].rpartition(":")[2] if ":" in c["image"] else ""
            assert tag and tag != "latest" and "/" not in tag, f"{name}: unpinned {c['image']}"
            if deployment is app:
                assert sc.get("runAsUser") == image.uid, "runAsUser differs from the image USER"
                # tempfile (the multi-worker metrics folder) needs a writable /tmp.
                mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
                assert "/tmp" in mounts, "readOnlyRootFilesystem without a writable /tmp"
            args = c.get("args", [])
            if "--maxmemory" in args:  # Redis: its cap fits the container's memory limit
                cap = args[args.index("--maxmemory") + 1]
                mib = int(re.sub(r"mb$", "", cap.lower()))
                limit = resources["limits"]["memory"]
                assert limit.endswith("Mi") and mib < int(limit[:-2]), f"{name}: {cap} vs {limit}"


@pytest.mark.parametrize("root", ROOTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kubectl_kustomize_renders_the_same(root: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # An optional cross-check: the project installs no kubectl (Debian's kubernetes-client
        # 1.20 embeds a kustomize too old to compare); the Python rendering, validated against
        # the schemas by the other tests, is what CI checks.
        pytest.skip("kubectl is not installed: the schema-validated Python rendering is checked")
    out = subprocess.run(
        [kubectl, "kustomize", str(root)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    ours = render(root)
    generated = {r["metadata"]["name"] for r in ours if r["kind"] == "ConfigMap"}
    # kustomize suffixes generated ConfigMaps with a content hash (and rewrites references).
    for name in generated:
        out = re.sub(rf"\b{re.escape(name)}-[a-z0-9]{{10}}\b", name, out)
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(r: Resource) -> tuple[str, str]:
        return r["kind"], r["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(ours, key=key)
