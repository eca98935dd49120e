"""``budgetserve-serve`` run as a subprocess: help, settings errors, the models folder, and
the JSON request log with its request ids."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service import tracing
from tests.conftest import ROOT, free_port, png_b64

SERVE = Path(sys.executable).with_name("budgetserve-serve")


def env(**settings: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("BUDGETSERVE_") and k != "REDIS_URL"
    }
    return {**base, "PYTHONPATH": str(ROOT), **settings}


def run(timeout: float = 60, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SERVE)], env=env(**settings), capture_output=True, text=True, timeout=timeout
    )


def test_help_prints_every_setting_and_starts_nothing() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [str(SERVE), "--help"], env=env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    for setting in ("BUDGETSERVE_PORT", "BUDGETSERVE_MODELS_DIR", "BUDGETSERVE_ADMIN_TOKEN"):
        assert setting in done.stdout
    assert "Uvicorn running" not in done.stderr and "listening" not in done.stderr
    bad = subprocess.run(
        [str(SERVE), "--port", "9000"], env=env(), capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unrecognized arguments: --port" in bad.stderr


def test_a_bad_setting_is_one_readable_line_and_exit_2() -> None:
    done = run(BUDGETSERVE_PORT="80620")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "BUDGETSERVE_PORT='80620'" in lines[0] and "65535" in lines[0]
    two = run(BUDGETSERVE_WORKERS="zero", BUDGETSERVE_LOG_FORMAT="xml")
    assert two.returncode == 2 and len(two.stderr.strip().splitlines()) == 1
    assert "BUDGETSERVE_WORKERS='zero'" in two.stderr and "BUDGETSERVE_LOG_FORMAT" in two.stderr


def test_tracing_that_cannot_start_is_one_readable_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    done = run(BUDGETSERVE_TRACING="true", OTEL_TRACES_EXPORTER="jaeger")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "OTEL_TRACES_EXPORTER='jaeger'" in line and "otlp, console, none" in line
    # An exporter that is not installed (a None entry makes its import fail, as a missing
    # package does): named, with the install command, before any worker starts.
    module = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    problem = tracing.unavailable()
    assert problem is not None and module in problem and "[otel]" in problem
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.unavailable() is None


def test_a_missing_models_folder_is_an_error(tmp_path: Path) -> None:
    done = run(BUDGETSERVE_MODELS_DIR=str(tmp_path / "typo"))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "BUDGETSERVE_MODELS_DIR" in line and "does not exist" in line
    a_file = tmp_path / "file"
    a_file.write_text("")
    done = run(BUDGETSERVE_MODELS_DIR=str(a_file))
    assert done.returncode == 2 and "is not a folder" in done.stderr


def get(url: str, **headers: str) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def post(url: str, body: dict[str, Any] | None, **headers: str) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_an_empty_folder_starts_unready_then_a_reload_serves(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """Empty folder: a loud warning and /readyz 503; bundles copied in and reloaded then
    serve, and the JSON log has one line per request with its id."""
    models = tmp_path / "models"
    models.mkdir()
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(SERVE)],
            env=env(
                BUDGETSERVE_MODELS_DIR=str(models),
                BUDGETSERVE_PORT=str(port),
                BUDGETSERVE_ADMIN_TOKEN="t0k",
                BUDGETSERVE_LOG_FORMAT="json",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                status, _, ready = get(base + "/readyz")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(log_path.read_text()) from None
                time.sleep(0.2)
        assert status == 503 and ready["models"] == []
        shutil.copytree(tiny_bundle_dir, models / "tiny")
        status, headers, report = post(
            base + "/-/reload", None, Authorization="Bearer t0k", **{"x-request-id": "rl-1"}
        )
        assert status == 200 and [e["name"] for e in report["loaded"]] == ["tiny"]
        assert headers["x-request-id"] == "rl-1"
        assert get(base + "/readyz")[0] == 200
        item = {"png_base64": png_b64(np.full((32, 32), 0.3, dtype=np.float32))}
        status, headers, body = post(
            base + "/predict",
            {"model": "tiny", "item": item, "budget": 100},
            **{"x-request-id": "pr-1"},
        )
        assert status == 200 and headers["x-request-id"] == "pr-1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    warning = [r for r in records if r["level"] == "WARNING" and "NO BUNDLES" in r["message"]]
    assert warning, lines
    [line] = [r for r in records if r.get("request_id") == "pr-1" and r.get("path")]
    assert line["status"] == 200 and line["model"] == "tiny" and line["budget"] == 100
    assert line["spent"] == body["cost"]["spent"] and line["strategy"] == body["strategy"]
    assert line["cached"] == [] and line["extracted"] == body["cost"]["extracted"]
    assert any(
        r.get("request_id") == "rl-1" and r["logger"] == "budgetserve.registry" for r in records
    )


def test_two_workers_both_pick_up_a_new_version_by_watching(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """BUDGETSERVE_WORKERS=2 with BUDGETSERVE_WATCH_INTERVAL_S: a version copied in is served
    by every worker (requests on fresh connections, spread over both, all get it), while an
    admin call answers that it changed one worker of two."""
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    for label in ("1", "2"):
        shutil.copytree(tiny_bundle_dir, models / "tiny" / f".{label}")
        manifest = json.loads((models / "tiny" / f".{label}" / "manifest.json").read_text())
        manifest["version"] = f"v{label}"
        (models / "tiny" / f".{label}" / "manifest.json").write_text(json.dumps(manifest))
    (models / "tiny" / ".1").rename(models / "tiny" / "1")
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(SERVE)],
            env=env(
                BUDGETSERVE_MODELS_DIR=str(models),
                BUDGETSERVE_PORT=str(port),
                BUDGETSERVE_WORKERS="2",
                BUDGETSERVE_WATCH_INTERVAL_S="0.3",
                BUDGETSERVE_ADMIN_TOKEN="t0k",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    item = {"png_base64": png_b64(np.full((32, 32), 0.3, dtype=np.float32))}
    body = {"model": "tiny", "item": item, "budget": 100}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get(base + "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(log_path.read_text())
            time.sleep(0.2)
        while log_path.read_text().count("Application startup complete") < 2:
            assert time.monotonic() < deadline, log_path.read_text()  # both workers serve
            time.sleep(0.2)
        assert post(base + "/predict", body)[2]["model_version"] == "v1"
        (models / "tiny" / ".2").rename(models / "tiny" / "2")  # the new version, at once
        deadline = time.monotonic() + 60
        versions: list[str] = []
        while time.monotonic() < deadline:
            versions = [post(base + "/predict", body)[2]["model_version"] for _ in range(20)]
            if set(versions) == {"v2"}:
                break
            time.sleep(0.3)
        assert set(versions) == {"v2"}, versions
        status, _, report = post(base + "/-/reload", None, Authorization="Bearer t0k")
        assert status == 200 and report["scope"]["workers"] == 2
        assert "1 worker process of 2" in report["scope"]["note"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log_path.read_text()
    pids = set(re.findall(r"Started server process \[(\d+)\]", text))
    assert len(pids) == 2, text[-3000:]
    # each worker's watcher loaded version 2, then the admin call's worker once more
    assert text.count("bundle tiny (tiny/2) loaded") == 3, text[-3000:]
