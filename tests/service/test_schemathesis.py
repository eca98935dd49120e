"""Schemathesis over every operation of the published OpenAPI schema, every check
(``--checks all``), against a real uvicorn serving an image bundle (digits) and a tabular
one (router).

The run is seeded (``BUDGETSERVE_SCHEMATHESIS_SEED`` overrides the seed, ``..._EXAMPLES``
the examples per operation) so CI is repeatable; a few hundred test cases in all, ~10-20 s.
Allowances, configured below: a request valid by the schema may still be refused with
422 by ``POST /predict``, because no JSON Schema can say "base64 of a decodable PNG" or
"exactly this bundle's columns", and by the skyline for a size the bundle's items cannot
have.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
SEED = int(os.environ.get("BUDGETSERVE_SCHEMATHESIS_SEED", "20261123"))
EXAMPLES = int(os.environ.get("BUDGETSERVE_SCHEMATHESIS_EXAMPLES", "30"))

CONFIG = """
[generation]
database = "none"

[parameters]
"path.name" = { dictionary = "models", probability = 0.8 }

[dictionaries.models]
values = ["digits", "router"]

# One criterion per block: schemathesis includes an operation matching *any* criterion of
# a block (include-path and include-method would take in every POST).
[[operations]]
include-path = "/predict"
# The schema cannot express a decodable PNG or a bundle's exact columns (see the module).
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "422"]

[[operations]]
include-path-regex = "^/models/[^/]+/skyline$"
# A size must be one the bundle's items can have (8 x 8 to max_pixels for digits, 1 for a
# table row): per bundle, which one schema for every bundle cannot say.
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "422"]
[[operations]]
include-path-regex = "^/v2/models/.+/infer$"
# The same for the Open Inference Protocol: a tensor's shape and datatype must agree with
# its data and the model's inputs (400), and its item must decode (422).
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "422"]
"""


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, digits_bundle_dir: Path, router_bundle_dir: Path
) -> Iterator[str]:
    root = tmp_path_factory.mktemp("schemathesis")
    models = root / "models"
    models.mkdir()
    (models / "digits").symlink_to(digits_bundle_dir.resolve(), target_is_directory=True)
    (models / "router").symlink_to(router_bundle_dir.resolve(), target_is_directory=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(
        BUDGETSERVE_MODELS_DIR=str(models),
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_PORT=str(port),
        PYTHONPATH=str(ROOT),
    )
    log = (root / "service.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _ready(f"{base}/readyz"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the service did not become ready:\n"
                    f"{(root / 'service.log').read_text()[-3000:]}"
                )
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_every_operation_passes_every_check(server: str, tmp_path: Path) -> None:
    if not SCHEMATHESIS.is_file():
        pytest.fail(f"{SCHEMATHESIS} is missing: install the dev extra (pip install -e '.[dev]')")
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    argv = [
        str(SCHEMATHESIS),
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{server}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(SEED),
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--report",
        "junit",
        "--report-junit-path",
        str(tmp_path / "junit.xml"),
    ]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-12000:]
    # It did run every operation and a few hundred cases, not an empty selection.
    with urllib.request.urlopen(f"{server}/openapi.json", timeout=10) as response:
        paths = json.load(response)["paths"]
    operations = sum(len(methods) for methods in paths.values())
    assert operations >= 17, sorted(paths)
    assert f"Selected: {operations}/{operations}" in output, output[-3000:]
    assert f"Tested: {operations}" in output, output[-3000:]
    counted = re.search(r"Test cases:\s+(\d+) generated", output)
    assert counted is not None and int(counted.group(1)) >= 200, output[-3000:]
