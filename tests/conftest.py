"""Shared fixtures: real bundles (built by the real builder), real apps, real Redis."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.support.gating_bundle import GatingFixture

ROOT = Path(__file__).resolve().parents[1]
DIGITS_BUNDLE = ROOT / "models" / "digits"
SHARED = ROOT.parent / "shared"


def png_b64(image: np.ndarray) -> str:
    """Grayscale float image in [0, 1] → base64 PNG."""
    buf = io.BytesIO()
    Image.fromarray(np.clip(image * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L").save(
        buf, format="PNG"
    )
    return base64.b64encode(buf.getvalue()).decode()


def digit_image(index: int, side: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    from training.data.digits import render_digit

    images = load_digits().images
    return render_digit(
        np.asarray(images[index], dtype=np.float64), side, np.random.default_rng(index)
    )


@pytest.fixture(scope="session")
def digits_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/digits, seen through a models folder of its own (a symlink), so that tests
    which serve `digits_bundle_dir.parent` see this one bundle, not whatever else a
    developer has built into models/ (the OCR or parser bundles, say)."""
    if not (DIGITS_BUNDLE / "manifest.json").is_file():
        pytest.fail("models/digits is missing: run `make bundle` (make test builds it first)")
    link = tmp_path_factory.mktemp("models") / "digits"
    link.symlink_to(DIGITS_BUNDLE, target_is_directory=True)
    return link


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real bundle: 3 extractors, 400 digits, fixed (deliberately optimistic) costs
    so that tests control planning; built by the real builder, ONNX-verified."""
    from service.bundle import CostPolynomial
    from training.bundles.digits import BuildConfig, build_bundle

    root = tmp_path_factory.mktemp("bundles")
    costs = {
        "thumbnail": CostPolynomial(coefficients=[0.01]),
        "histogram": CostPolynomial(coefficients=[0.01, 1e-9]),
        "hog": CostPolynomial(coefficients=[0.02, 1e-9]),
    }
    config = BuildConfig(
        name="tiny",
        extractors=("thumbnail", "histogram", "hog"),
        limit=400,
        train_sides=(16, 32),
        profile_sides=(16, 256),
        epsilon=0.0,
        delta=0.02,
    )
    build_bundle(root / "tiny", config, costs=costs)
    return root / "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL if given (make test starts one), else a redis-server started here."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    try:
        port = free_port()
        proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        pytest.skip("redis-server is not installed and REDIS_URL is unset (make test sets it)")
    import time

    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.terminate()
        pytest.fail(f"redis-server on port {port} did not answer PING within 5 s")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


ROUTER_COLUMNS = ["r", "a1", "a2", "b1", "b2"]


@pytest.fixture(scope="session")
def router_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real DAG bundle (tabular, declared costs) on the constructed router problem: a cheap
    sensor r says which of two expensive sensors holds the label."""
    from training.bundles.dag import DagSpec, build_dag_bundle
    from training.data.synthetic import make_router_data

    spec = DagSpec(
        name="router",
        label="label",
        sensors={"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
        costs={"r": 1.0, "a": 5.0, "b": 5.0},
        cost_scales=[0.0, 0.03, 0.3],
        # the DAG's own walks, as trained (no fixed subsets to compete, the learner's bank):
        # tests/training/test_fixed_subsets.py covers those
        bank="learner",
        fixed=False,
        # the state's columns only: r's sign is the whole route, and the tests check each
        # walk against that construction (with the confidence inputs, the builder's default,
        # 29 of 2,000 held-out rows bought both expensive sensors instead of 3; error equal)
        policy_inputs="features",
    )
    x, y = make_router_data(2500, seed=2)
    root = tmp_path_factory.mktemp("dag")
    build_dag_bundle(root / "router", spec, x, y.astype(str), ROUTER_COLUMNS)
    return root / "router"


@pytest.fixture(scope="session")
def gating_bundle(tmp_path_factory: pytest.TempPathFactory) -> GatingFixture:
    """A real gating bundle (paper 001's format; tabular, declared costs): a gate on a cheap
    sensor choosing between a low-cost and a high-cost model (see tests/gating_bundle.py)."""
    from tests.support.gating_bundle import build_gating_bundle

    return build_gating_bundle(tmp_path_factory.mktemp("gating") / "gating")


@pytest.fixture(scope="session")
def gating_bundle_dir(gating_bundle: GatingFixture) -> Path:
    return gating_bundle.path


@pytest.fixture(scope="session")
def cstc_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real cstc bundle (paper 003; tabular, declared costs) built by the real builder
    (see tests/support/cstc_bundle.py)."""
    from tests.support.cstc_bundle import build

    return build(tmp_path_factory.mktemp("cstc") / "trees").path
