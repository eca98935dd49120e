"""The README's tabular commands run as written: its DAG and gating blocks, literally, on pima.

Each block is run by bash in a fresh folder laid out as a checkout is (``.venv`` and
``../shared`` beside it), so what a newcomer pastes is what is tested: the spec the block
writes, the training command with its flags, and (for the DAG block) the ``curl`` it shows,
sent to a real ``budgetserve-serve`` started there on a free port instead of 8000.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SHARED, free_port

README = ROOT / "README.md"
PIMA = SHARED / "datasets" / "pima" / "pima-indians-diabetes.csv"
# One pima row of the README's curl: its values, for the request sent to the gating bundle.
PIMA_ROW = {
    "pregnancies": 2,
    "glucose": 138,
    "pressure": 62,
    "skin": 35,
    "insulin": 0,
    "bmi": 33.6,
    "pedigree": 0.127,
    "age": 47,
}

pytestmark = pytest.mark.skipif(
    not PIMA.is_file(),
    reason="the shared datasets are not beside this checkout (../shared/datasets/pima): "
    "the README's commands read them; CI runs with ../shared beside the clone",
)


def readme_block(command: str) -> str:
    """The README's one bash block that runs ``budgetserve-train <command>``."""
    bodies = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    found = [b for b in bodies if re.search(rf"budgetserve-train {command}\b", b)]
    assert len(found) == 1, f"README has {len(found)} bash blocks running `{command}`"
    return str(found[0])


def checkout_like(tmp_path: Path) -> Path:
    """A working folder with ``.venv`` and ``../shared`` where the README expects them."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "shared").symlink_to(SHARED)
    return work


def clean_env() -> dict[str, str]:
    """The caller's environment without this suite's service settings (``make serve`` has
    none: embedded default, no Redis)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("BUDGETSERVE_") and k != "REDIS_URL"
    }


def run_bash(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"README block failed (exit {done.returncode}):\n{script}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
    return done


@contextmanager
def serving(work: Path) -> Iterator[int]:
    """``budgetserve-serve`` in ``work`` (its ``models/``), as ``make serve`` runs it."""
    port = free_port()
    env = clean_env() | {"BUDGETSERVE_HOST": "127.0.0.1", "BUDGETSERVE_PORT": str(port)}
    log_path = work / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(work / ".venv" / "bin" / "budgetserve-serve")],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"budgetserve-serve exited: {log_path.read_text()}"
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                conn.close()
            assert time.monotonic() < deadline, "budgetserve-serve was not ready within 120 s"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/predict", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_readme_dag_block_trains_and_its_curl_is_answered(tmp_path: Path) -> None:
    block = readme_block("dag")
    head, sep, curl = block.partition("curl ")
    assert sep, "the README's DAG block shows a curl request"
    work = checkout_like(tmp_path)
    run_bash(head, work, timeout=900)
    manifests = list((work / "models").glob("*/manifest.json"))
    assert [m.parent.name for m in manifests] == ["pima"], manifests
    with serving(work) as port:
        request = "curl " + curl.replace("localhost:8000", f"127.0.0.1:{port}")
        answer = json.loads(run_bash(request, work, timeout=60).stdout)
        # Values far outside the training range: finite probabilities (the tuned bank and
        # the fixed subsets are trees or logistic regressions), or, from a model they
        # overflow (a poly2 bank), a clear 422 naming it; never a 200 with null ones.
        huge = {"pregnancies": 1e30, "age": 1e30, "pedigree": 1e30}
        status, error = post(port, {"model": "pima", "budget": 8, "item": {"values": huge}})
    assert answer.get("model") == "pima", answer
    assert answer["prediction"] in answer["probabilities"], answer
    if status == 422:
        assert "non-finite probabilities" in error["error"]["message"], error
    else:
        assert status == 200, error
        probabilities = list(error["probabilities"].values())
        assert all(math.isfinite(p) for p in probabilities), error
        assert abs(sum(probabilities) - 1.0) < 1e-3, error


def test_readme_gating_block_trains_a_bundle_that_serves(tmp_path: Path) -> None:
    work = checkout_like(tmp_path)
    run_bash(readme_block("gating"), work, timeout=900)
    manifest = json.loads((work / "models" / "pima-gating" / "manifest.json").read_text())
    assert manifest["name"] == "pima-gating"
    with serving(work) as port:
        status, answer = post(
            port, {"model": "pima-gating", "budget": 30, "item": {"values": PIMA_ROW}}
        )
    assert status == 200, answer
    assert answer["prediction"] in answer["probabilities"], answer
