"""deploy/prometheus and the Grafana dashboard against the real thing.

promtool checks the configs and runs the alert unit tests (and fails them when an alert is
weakened). A real Prometheus, started on loopback with a config derived from
deploy/prometheus/*.yml, scrapes a real budgetserve process that has answered a few
/predict requests: the counts come back through the HTTP API, the Kubernetes relabelling
finds the annotated pod, the alert rules load and evaluate (a dead target makes
BudgetserveDown pending), and every dashboard and alert expression evaluates and refers only
to metric names the service exposes.

Needs `prometheus` and `promtool` on PATH: `make test` installs them
(scripts/ensure-prometheus.sh); without them these tests are skipped.

Why one module over 450 lines: every test here shares one real Prometheus and one real
budgetserve process (module fixtures); split, each file would start its own.

Why one module over 450 lines: the promtool checks and the live-stack tests share the
expression extraction and the one started stack (Prometheus scraping a real service).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from scripts.check_deploy import (
    DASHBOARD,
    PROMETHEUS_DIR,
    k8s_with_file_sd,
    promtool_commands,
)
from tests.conftest import ROOT, digit_image, free_port, png_b64


@pytest.fixture(autouse=True, scope="module")
def _prometheus_installed() -> None:
    """`make test` installs Prometheus (scripts/ensure-prometheus.sh): under CI a missing one
    is a failure; a developer running pytest by hand without it gets a skip saying how."""
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        missing = "prometheus/promtool not installed: run scripts/ensure-prometheus.sh"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing + " (make test does)")


ALERTS = PROMETHEUS_DIR / "alerts.yml"
START_TIMEOUT_S = 90.0
WAIT_TIMEOUT_S = 60.0
RATE_WINDOW = "10s"
# Series that Prometheus itself attaches to every target.
SCRAPE_SERIES = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}


# --- PromQL: the metric names an expression refers to ---------------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
    "start",
    "end",
}


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (Grafana variables allowed): what is left
    once strings, label matchers, ranges, grouping clauses and function names are removed."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$:])[A-Za-z_:][\w:]*", text):
        name = match.group(0)
        rest = text[match.end() :].lstrip()
        if name.lower() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(name)
    return names


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus would receive it from Grafana, with every bundle
    selected; label_values() (a Grafana variable query) as the PromQL it stands for."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", ".*")
    expr = expr.replace("$job", ".*")
    found = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expr, flags=re.S)
    return f"group by ({found.group(2)}) ({found.group(1)})" if found else expr


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    panels = list(dash["panels"])
    for panel in list(panels):
        panels.extend(panel.get("panels", []))  # collapsed rows
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_expressions() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


def exposed_names(exposition: str) -> set[str]:
    """Every sample name on a /metrics page (histograms as _bucket/_sum/_count...)."""
    return {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def unknown_names(exprs: list[str], exposed: set[str]) -> dict[str, set[str]]:
    """Expressions that refer to a metric name the service does not expose."""
    allowed = exposed | SCRAPE_SERIES
    bad = {e: metric_names(grafana_to_promql(e)) - allowed for e in exprs}
    return {e: names for e, names in bad.items() if names}


def test_metric_names_of_promql() -> None:
    assert metric_names(
        "histogram_quantile(0.99, sum by (model, le) (rate(budgetserve_request_duration_seconds"
        '_bucket{job="budgetserve", model=~"$model"}[$__rate_interval])))'
    ) == {"budgetserve_request_duration_seconds_bucket"}
    assert metric_names(
        'sum(rate(a_total{x="y"}[5m])) by (le) / ignoring(x) group_left(z) b offset 5m > 1e-3'
    ) == {"a_total", "b"}
    assert metric_names('absent(up{job="budgetserve"}) or vector(0) and on() c:rule') == {
        "up",
        "c:rule",
    }


def test_a_renamed_metric_is_caught() -> None:
    exposition = (
        "# TYPE budgetserve_request_spent_seconds histogram\n"
        'budgetserve_request_spent_seconds_bucket{model="d",le="+Inf"} 1\n'
        'budgetserve_request_spent_seconds_sum{model="d"} 2.0\n'
        'budgetserve_request_spent_seconds_count{model="d"} 1\n'
    )
    exposed = exposed_names(exposition)
    good = 'sum(rate(budgetserve_request_spent_seconds_sum{model=~"$model"}[$__rate_interval]))'
    renamed = 'sum(rate(budgetserve_spent_sum{model=~"$model"}[$__rate_interval]))'
    assert unknown_names([good, "up == 0"], exposed) == {}
    assert unknown_names([good, renamed], exposed) == {renamed: {"budgetserve_spent_sum"}}


# --- promtool -------------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(4), ids=["config", "config-k8s", "rules", "test-rules"])
def test_promtool(index: int, tmp_path: Path) -> None:
    argv = promtool_commands(tmp_path)[index]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("alert", "weaken"),
    [
        ("BudgetserveBudgetExceededRate", ("> 0.05", "> 0.5")),
        ("BudgetserveHighP99Latency", (") > 0.1", ") > 0.5")),
        ("BudgetserveRedisErrors", ('result=~"error|write_error"', 'result="write_error"')),
        ("BudgetserveDown", ('up{job="budgetserve"} == 0', 'up{job="budgetserve"} < 0')),
        ("BudgetserveRedisCircuitOpen", ('result="bypass"', 'result="bypassed"')),
    ],
)
def test_alert_unit_tests_catch_a_weakened_alert(
    alert: str, weaken: tuple[str, str], tmp_path: Path
) -> None:
    rules = ALERTS.read_text()
    assert rules.count(weaken[0]) == 1, f"{weaken[0]!r} should occur once in alerts.yml"
    (tmp_path / "alerts.yml").write_text(rules.replace(*weaken))
    shutil.copy(PROMETHEUS_DIR / "alerts.test.yml", tmp_path / "alerts.test.yml")
    done = subprocess.run(
        ["promtool", "test", "rules", str(tmp_path / "alerts.test.yml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert f"alertname: {alert}" in done.stdout + done.stderr


# --- a real service scraped by a real Prometheus ----------------------------------------------


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_TIMEOUT_S) -> None:
    """Poll ``check`` until it holds; fail (not hang) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def get(url: str, **params: Any) -> httpx.Response:
    """GET from a local server (never through a proxy from the environment)."""
    return httpx.get(url, timeout=10, trust_env=False, **params)


def answers(url: str) -> bool:
    return get(url).status_code == 200


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        if self.popen.poll() is not None:
            pytest.fail(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")
        return True

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)


def start(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Proc(name, popen, log)


@dataclass
class Stack:
    service: str
    prometheus: str
    service_target: str
    dead_target: str
    responses: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    tabular: list[dict[str, Any]] = field(default_factory=list)
    exposition: str = ""

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = get(f"{self.prometheus}/api/v1/query", params={"query": expr})
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def api(self, path: str) -> Any:
        reply = get(f"{self.prometheus}/api/v1/{path}")
        reply.raise_for_status()
        return reply.json()["data"]


def service_env(port: int, models_dir: Path = ROOT / "models") -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "REDIS_URL" and not k.startswith(("BUDGETSERVE_", "PROMETHEUS_"))
    }
    env.update(
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_PORT=str(port),
        BUDGETSERVE_MODELS_DIR=str(models_dir),
        BUDGETSERVE_WORKERS="1",
        BUDGETSERVE_EXTRACTION_THREADS="1",
    )
    return env


def send_requests(base: str, stack: Stack) -> None:
    item = {"png_base64": png_b64(digit_image(3, 64))}
    other = {"png_base64": png_b64(digit_image(5, 48))}
    bodies = [
        # Generous budgets: deadline accounting counts from receipt, and a freshly started
        # process on a loaded CI machine once spent 20 ms before extracting anything.
        {"model": "digits", "item": item, "budget": 500.0},
        {"model": "digits", "item": item, "budget": 500.0},  # served from the cache
        {"model": "digits", "item": other, "budget": 2.5},
        {"model": "digits", "item": other, "budget": 1e-4},  # cannot be met
    ]
    with httpx.Client(base_url=base, timeout=30, trust_env=False) as client:
        for body in bodies:
            reply = client.post("/predict", json=body)
            assert reply.status_code == 200, reply.text
            stack.responses.append(reply.json())
        # A tabular item with only an id and no sensor source: answered from what is in hand,
        # naming the sensor to collect (budgetserve_sensor_unavailable_total).
        reply = client.post(
            "/predict", json={"model": "router", "item": {"id": "patient-1"}, "budget": 6.0}
        )
        assert reply.status_code == 200 and reply.json()["next_sensor"] == "r", reply.text
        stack.tabular.append(reply.json())
        reply = client.post("/predict", json={"model": "nosuch", "item": item, "budget": 5.0})
        assert reply.status_code == 404, reply.text
        stack.errors.append(reply.json())
        stack.exposition = client.get("/metrics").text


def prometheus_config(stack: Stack, sd_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its budgetserve target on loopback (and a dead
    target beside it), plus the Kubernetes job of prometheus.k8s.yml on file discovery."""
    compose = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    k8s = k8s_with_file_sd(
        yaml.safe_load((PROMETHEUS_DIR / "prometheus.k8s.yml").read_text()), sd_file
    )
    job = next(j for j in compose["scrape_configs"] if j["job_name"] == "budgetserve")
    for group in job["static_configs"]:
        assert group["targets"] == ["budgetserve:8000"], "the compose target moved"
        group["targets"] = [stack.service_target]
    job["static_configs"].append({"targets": [stack.dead_target]})
    k8s_job = next(j for j in k8s["scrape_configs"] if j["job_name"] == "budgetserve")
    k8s_job["job_name"] = "budgetserve-k8s"
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [job, k8s_job],
    }


def k8s_pods(service_port: int) -> list[dict[str, Any]]:
    """Targets as Kubernetes pod discovery would hand them over: one per container port."""
    meta = "__meta_kubernetes_"
    annotation = f"{meta}pod_annotation_prometheus_io_"

    def pod(
        name: str, port_name: str, port: int, annotated: bool, phase: str = "Running"
    ) -> dict[str, Any]:
        labels = {
            f"{meta}namespace": "serving",
            f"{meta}pod_name": name,
            f"{meta}pod_phase": phase,
            f"{meta}pod_container_port_name": port_name,
            f"{meta}pod_node_name": "node-1",
            f"{meta}pod_label_app_kubernetes_io_name": "budgetserve",
        }
        if annotated:
            labels |= {
                f"{annotation}scrape": "true",
                f"{annotation}port": str(service_port),
                f"{annotation}path": "/metrics",
            }
        return {"targets": [f"127.0.0.1:{port}"], "labels": labels}

    return [
        pod("budgetserve-0", "http", service_port, annotated=True),
        pod("budgetserve-0", "debug", 1, annotated=True),  # not the http port
        pod("other-0", "http", 2, annotated=False),  # did not opt in
        pod("budgetserve-1", "http", 3, annotated=True, phase="Pending"),
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, router_bundle_dir: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus")
    models = tmp / "models"  # the digits bundle, and a tabular (DAG) one
    models.mkdir()
    (models / "digits").symlink_to(ROOT / "models" / "digits", target_is_directory=True)
    (models / "router").symlink_to(router_bundle_dir, target_is_directory=True)
    service_port, prom_port, dead_port = free_port(), free_port(), free_port()
    stack = Stack(
        service=f"http://127.0.0.1:{service_port}",
        prometheus=f"http://127.0.0.1:{prom_port}",
        service_target=f"127.0.0.1:{service_port}",
        dead_target=f"127.0.0.1:{dead_port}",
    )
    procs: list[Proc] = []
    try:
        serve = start(
            "budgetserve-serve",
            [str(Path(sys.executable).parent / "budgetserve-serve")],
            tmp / "service.log",
            env=service_env(service_port, models),
        )
        procs.append(serve)
        wait_for(
            "budgetserve /readyz",
            lambda: serve.alive() and answers(f"{stack.service}/readyz"),
            START_TIMEOUT_S,
        )
        send_requests(stack.service, stack)

        sd_file = tmp / "pods.json"
        sd_file.write_text(json.dumps(k8s_pods(service_port)))
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(stack, sd_file), sort_keys=False))
        prom = start(
            "prometheus",
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            tmp / "prometheus.log",
        )
        procs.append(prom)
        wait_for(
            "prometheus /-/ready",
            lambda: prom.alive() and answers(f"{stack.prometheus}/-/ready"),
            START_TIMEOUT_S,
        )
        wait_for(
            "a scrape of the service",
            lambda: bool(
                stack.query(f'up{{job="budgetserve", instance="{stack.service_target}"}} == 1')
            ),
        )
        yield stack
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_prometheus_reads_back_the_requests_made(stack: Stack) -> None:
    answered = stack.responses
    job = 'job="budgetserve"'
    sel = f'{job}, model="digits"'
    assert stack.value(f'budgetserve_requests_total{{{sel}, status="ok"}}') == len(answered)
    assert stack.value(f"budgetserve_request_duration_seconds_count{{{sel}}}") == len(answered)
    assert stack.value(f"budgetserve_request_budget_seconds_sum{{{sel}}}") == pytest.approx(
        sum(r["cost"]["budget"] for r in answered) / 1000.0
    )
    assert stack.value(f"budgetserve_request_spent_seconds_sum{{{sel}}}") == pytest.approx(
        sum(r["cost"]["spent"] for r in answered) / 1000.0, rel=1e-6
    )
    exceeded = sum(r["deadline_exceeded"] for r in answered)
    assert exceeded >= 1, "the 1e-4 ms budget should not have been met"
    assert stack.value(f"budgetserve_budget_exceeded_total{{{sel}}}") == exceeded
    cached = sum(len(r["cost"]["cached"]) for r in answered)
    assert cached >= 1, "the repeated image should have been served from the cache"
    assert stack.value(f'budgetserve_cache_requests_total{{{job}, result="hit"}}') == cached
    extracted = [name for r in answered for name in r["cost"]["extracted"]]
    for name in set(extracted):
        assert stack.value(
            f'budgetserve_extraction_seconds_count{{{job}, extractor="{name}"}}'
        ) == extracted.count(name)
    status = stack.errors[0]["error"]["type"]
    assert (
        stack.value(f'budgetserve_requests_total{{{job}, model="_unknown", status="{status}"}}')
        == 1
    )
    assert stack.value('budgetserve_models_loaded{job="budgetserve"}') >= 2
    [tabular] = stack.tabular
    assert stack.value(
        f'budgetserve_sensor_unavailable_total{{{job}, model="router", sensor="r"}}'
    ) == len(tabular["unavailable"])


def test_kubernetes_relabelling_finds_the_annotated_pod(stack: Stack) -> None:
    def scraped() -> bool:
        return bool(stack.query('up{job="budgetserve-k8s"} == 1'))

    wait_for("a scrape through the Kubernetes job", scraped)
    targets = stack.api("targets")
    active = [t for t in targets["activeTargets"] if t["labels"]["job"] == "budgetserve-k8s"]
    assert len(active) == 1, active
    labels = active[0]["labels"]
    assert labels["instance"] == stack.service_target
    assert (labels["namespace"], labels["pod"], labels["node"]) == (
        "serving",
        "budgetserve-0",
        "node-1",
    )
    assert labels["app_kubernetes_io_name"] == "budgetserve"
    assert active[0]["scrapeUrl"] == f"http://{stack.service_target}/metrics"
    dropped = [
        t["discoveredLabels"]
        for t in targets["droppedTargets"]
        if t["discoveredLabels"].get("job") == "budgetserve-k8s"
    ]
    assert sorted(d["__address__"] for d in dropped) == [
        "127.0.0.1:1",
        "127.0.0.1:2",
        "127.0.0.1:3",
    ]
    assert stack.value(
        'budgetserve_requests_total{job="budgetserve-k8s", model="digits", status="ok"}'
    ) == len(stack.responses)


def test_alert_rules_load_evaluate_and_a_dead_target_goes_pending(stack: Stack) -> None:
    def rules() -> list[dict[str, Any]]:
        return [r for g in stack.api("rules")["groups"] for r in g["rules"]]

    wait_for("every rule evaluated", lambda: all(r["health"] != "unknown" for r in rules()))
    loaded = {r["name"]: r for r in rules()}
    assert set(loaded) == set(alert_expressions())
    assert {name: r["health"] for name, r in loaded.items() if r["health"] != "ok"} == {}

    def firing_or_pending() -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = stack.api("alerts")["alerts"]
        return alerts

    wait_for(
        "BudgetserveDown for the dead target",
        lambda: any(a["labels"]["alertname"] == "BudgetserveDown" for a in firing_or_pending()),
    )
    down = [a for a in firing_or_pending() if a["labels"]["alertname"] == "BudgetserveDown"]
    assert [a["labels"]["instance"] for a in down] == [stack.dead_target]
    assert down[0]["state"] == "pending"  # `for: 1m` has not elapsed
    others = {a["labels"]["alertname"] for a in firing_or_pending()} - {"BudgetserveDown"}
    assert others == set(), "a healthy service should raise no other alert"


def test_every_expression_evaluates_in_prometheus(stack: Stack) -> None:
    def enough_samples() -> bool:
        counts = stack.query(
            f'count_over_time(up{{instance="{stack.service_target}"}}[{RATE_WINDOW}])'
        )
        return bool(counts) and min(float(c["value"][1]) for c in counts) >= 3

    wait_for(f"three scrapes within {RATE_WINDOW}", enough_samples)
    empty = [e for e in dashboard_expressions() if not stack.query(grafana_to_promql(e))]
    assert empty == [], "dashboard queries with no data"
    for expr in alert_expressions().values():
        stack.query(expr)  # asserts the query is valid PromQL for this Prometheus


def test_expressions_use_only_metrics_the_service_exposes(stack: Stack) -> None:
    exposed = exposed_names(stack.exposition)
    assert "budgetserve_request_duration_seconds_bucket" in exposed
    exprs = dashboard_expressions() + list(alert_expressions().values())
    assert unknown_names(exprs, exposed) == {}
    used = set().union(*(metric_names(grafana_to_promql(e)) for e in exprs))
    families = {
        f.name
        for f in text_string_to_metric_families(stack.exposition)
        if f.name.startswith("budgetserve_") and not f.name.endswith("_created")
    }
    unused = {f for f in families if not any(n.startswith(f) for n in used)}
    assert unused == set(), "metrics shown on no panel and in no alert"
