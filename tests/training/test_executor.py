"""Executors (training/executor.py): the lattice expansion and the DAG sweep give the same
results inline, on joblib workers and on Ray (a local instance, and a cluster started with
`ray start --head` that the CLI joins with --address); the CLI options reach the builders.

Ray runs on loopback only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray pick 127.0.0.1 as the
node address), with its authentication mode and token given in the environment (nothing is
written to ~/.ray), and every process it started is gone when a test ends.

About 460 lines, kept whole: every builder is checked against the same executors and the same
Ray fixtures (a local instance, a started cluster), which a split would duplicate.
"""

from __future__ import annotations

import json
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from service.bundle import read_manifest
from tests.conftest import ROUTER_COLUMNS, free_port
from training.bundles.digits import LatticeEvaluator, digits_features, make_extractors
from training.dag import DagClassifier, sweep
from training.data.synthetic import make_router_data
from training.executor import (
    INLINE,
    Executor,
    LocalExecutor,
    RayExecutor,
    make_executor,
)
from training.polydom import PolyDom

ROOT = Path(__file__).resolve().parents[2]
EXTRACTORS = ("thumbnail", "histogram", "projection", "hog")
COSTS = np.array([[0.01, 0.0], [0.01, 1e-6], [0.02, 2e-6], [0.05, 2e-5]])
SCALES = [0.0, 0.03, 0.3, 1.0]
ROUTER_SENSORS = {"r": [0], "a": [1, 2], "b": [3, 4]}
ROUTER_COSTS = {"r": 1.0, "a": 5.0, "b": 5.0}


def ray_env(token: bool) -> dict[str, str]:
    """Environment of the Ray processes here: loopback node address, no drain delay on
    SIGTERM, no usage statistics, and a throwaway token (or none: this process's Ray read
    its authentication mode when it was imported, so an in-process instance runs without)."""
    auth = (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
        if token
        else {"RAY_AUTH_MODE": "disabled"}
    )
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        **auth,
    }


def processes_under(folder: str) -> list[str]:
    """Command lines of the live processes that name ``folder`` (Ray's temp dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if folder in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def wait_gone(folder: str, seconds: float = 30.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := processes_under(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def ray_temp_dir() -> str:
    # Short: Ray's unix socket paths must stay under 107 characters.
    return tempfile.mkdtemp(prefix="bsray", dir="/tmp" if os.path.isdir("/tmp") else None)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[str]:
    """A local Ray instance for this module (2 CPUs, no dashboard, own temp dir)."""
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as ray_constants

    patch = pytest.MonkeyPatch()
    for key, value in ray_env(token=False).items():
        patch.setenv(key, value)
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    temp = ray_temp_dir()
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            object_store_memory=100 * 1024 * 1024,
            _temp_dir=temp,
        )
        yield temp
    finally:
        ray.shutdown()
        patch.undo()
        left = wait_gone(temp)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"Ray left processes behind: {left}"


# ------------------------------------------------------------------ the lattice expansion


@pytest.fixture(scope="module")
def features() -> Any:
    return digits_features(make_extractors(EXTRACTORS), (16, 32), seed=1, limit=240)


def expand(data: Any, executor: Executor) -> tuple[LatticeEvaluator, PolyDom]:
    """The Poly-Dom search plus every other set (the naive lattice) and the final fits."""
    evaluator = LatticeEvaluator(data, executor=executor)
    polydom = PolyDom(epsilon=0.02, delta=0.01).fit(evaluator, COSTS, (256.0, 4096.0))
    everything = list(range(1 << len(EXTRACTORS)))
    evaluator.prefetch(everything)
    evaluator.prefit(everything[1:])
    return evaluator, polydom


def coefficients(evaluator: LatticeEvaluator) -> dict[int, np.ndarray]:
    return {m: np.asarray(model[-1].coef_) for m, model in evaluator._fitted.items()}


@pytest.fixture(scope="module")
def inline_lattice(features: Any) -> tuple[LatticeEvaluator, PolyDom]:
    return expand(features, INLINE)


def assert_same_lattice(
    got: tuple[LatticeEvaluator, PolyDom], want: tuple[LatticeEvaluator, PolyDom]
) -> None:
    (evaluator, polydom), (ref, ref_polydom) = got, want
    assert evaluator.accuracy == ref.accuracy  # exact, every one of the 2^4 sets
    assert list(evaluator.accuracy) == list(ref.accuracy)  # computed in the same order
    assert polydom.expanded_ == ref_polydom.expanded_
    assert polydom.candidates_ == ref_polydom.candidates_
    assert polydom.stats_ == ref_polydom.stats_
    want_coef = coefficients(ref)
    got_coef = coefficients(evaluator)
    assert got_coef.keys() == want_coef.keys()
    for mask, coef in want_coef.items():
        np.testing.assert_array_equal(got_coef[mask], coef)


def test_lattice_is_what_the_evaluator_computes_one_set_at_a_time(
    features: Any, inline_lattice: tuple[LatticeEvaluator, PolyDom]
) -> None:
    evaluator, polydom = inline_lattice
    assert len(evaluator.accuracy) == 1 << len(EXTRACTORS)
    assert 0 < polydom.stats_.expansions <= 1 << len(EXTRACTORS)
    # Batches change nothing: without prefetch (a plain function) the search is the same.
    lone = LatticeEvaluator(features)
    plain = PolyDom(epsilon=0.02, delta=0.01).fit(lambda m: lone(m), COSTS, (256.0, 4096.0))
    assert plain.expanded_ == polydom.expanded_
    assert plain.stats_ == polydom.stats_
    for mask in (1, 6, 15):
        assert lone(mask) == evaluator.accuracy[mask]


def test_lattice_on_joblib_workers_is_the_same(
    features: Any, inline_lattice: tuple[LatticeEvaluator, PolyDom]
) -> None:
    with LocalExecutor(n_jobs=2) as ex:
        assert_same_lattice(expand(features, ex), inline_lattice)


def test_lattice_on_ray_is_the_same(
    ray_local: str, features: Any, inline_lattice: tuple[LatticeEvaluator, PolyDom]
) -> None:
    with make_executor("ray") as ex:
        assert isinstance(ex, RayExecutor)
        assert_same_lattice(expand(features, ex), inline_lattice)
        # The features went to the object store once, however many batches read them.
        assert len(ex._refs) == 1


# ------------------------------------------------------------------ the DAG sweep


@pytest.fixture(scope="module")
def router() -> tuple[np.ndarray, ...]:
    x, y = make_router_data(500, seed=3)
    x_val, y_val = make_router_data(400, seed=4)
    return x, y, x_val, y_val


def run_sweep(router: tuple[np.ndarray, ...], executor: Executor) -> list[Any]:
    x, y, x_val, y_val = router
    return sweep(
        x, y, x_val, y_val, SCALES, sensors=ROUTER_SENSORS, costs=ROUTER_COSTS, executor=executor
    )


def sweep_outputs(points: list[tuple[float, DagClassifier, float, float]]) -> list[Any]:
    base = points[0][1]
    bank = {
        s: (None if c is None else (c[-1].coef_.tolist(), c[-1].intercept_.tolist()))
        for s, c in base.classifiers_.items()
    }
    return [
        [
            (cs, cost, err, m.train_objective_, json.dumps(m.export_policies(), sort_keys=True))
            for cs, m, cost, err in points
        ],
        bank,
        {s: base._losses[s].tolist() for s in base.states_},
    ]


@pytest.fixture(scope="module")
def inline_sweep(router: tuple[np.ndarray, ...]) -> list[Any]:
    return run_sweep(router, INLINE)


def test_sweep_shares_the_bank_and_trains_policies_per_scale(inline_sweep: list[Any]) -> None:
    assert [p[0] for p in inline_sweep] == SCALES
    assert [p[1].cost_scale for p in inline_sweep] == SCALES
    assert all(p[1].classifiers_ is inline_sweep[0][1].classifiers_ for p in inline_sweep)
    costs = [p[2] for p in inline_sweep]
    assert costs[0] > costs[-1]  # a higher cost scale acquires less


@pytest.mark.parametrize("kind", ["joblib", "ray"])
def test_sweep_elsewhere_is_the_same(
    request: pytest.FixtureRequest,
    router: tuple[np.ndarray, ...],
    inline_sweep: list[Any],
    kind: str,
) -> None:
    if kind == "ray":
        request.getfixturevalue("ray_local")
    with make_executor("ray" if kind == "ray" else "local", n_jobs=2) as ex:
        points = run_sweep(router, ex)
    assert sweep_outputs(points) == sweep_outputs(inline_sweep)
    assert all(p[1].classifiers_ is points[0][1].classifiers_ for p in points)
    x_val = router[2]
    for (_, model, _, _), (_, ref, _, _) in zip(points, inline_sweep, strict=True):
        np.testing.assert_array_equal(
            model.predict_with_cost(x_val)[1], ref.predict_with_cost(x_val)[1]
        )


# ------------------------------------------------------------------ the executors themselves


@pytest.mark.parametrize("kind", ["inline", "joblib", "ray"])
def test_map_keeps_the_items_order(request: pytest.FixtureRequest, kind: str) -> None:
    if kind == "ray":
        request.getfixturevalue("ray_local")
    makers: dict[str, Callable[[], Executor]] = {
        "inline": lambda: INLINE,
        "joblib": lambda: LocalExecutor(2),
        "ray": RayExecutor,
    }
    ex = makers[kind]()
    items = list(range(40, 0, -3))
    with ex:
        assert ex.map(operator.sub, items, shared=(1000,)) == [1000 - i for i in items]
        assert ex.map(abs, []) == []
        with pytest.raises(ZeroDivisionError):
            ex.map(operator.truediv, [1, 0, 2], shared=(1.0,))


def test_make_executor_names_and_errors() -> None:
    assert isinstance(make_executor(), LocalExecutor)
    local = make_executor("local", n_jobs=3)
    assert isinstance(local, LocalExecutor) and local.n_jobs == 3
    remote = make_executor("ray", address="10.0.0.5:6379", n_jobs=4)
    assert isinstance(remote, RayExecutor) and remote.address == "10.0.0.5:6379"
    remote.close()  # never started: nothing to shut down
    with pytest.raises(ValueError, match="unknown executor 'spark'; choose one of 'local', 'ray'"):
        make_executor("spark")
    with pytest.raises(ValueError, match="only for the ray executor"):
        make_executor("local", address="10.0.0.5:6379")
    with pytest.raises(ValueError, match="n_jobs=0"):
        make_executor("local", n_jobs=0)


# ------------------------------------------------------------------ the CLI


class Recorder(Executor):
    """An inline executor that remembers how it was made and counts its batches."""

    made: ClassVar[list[tuple[str, str | None, int | None]]] = []
    batches: ClassVar[int] = 0

    def map(
        self, fn: Callable[..., Any], items: Iterable[Any], *, shared: Sequence[Any] = ()
    ) -> list[Any]:
        type(self).batches += 1
        return super().map(fn, items, shared=shared)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    import training.executor

    real = training.executor.make_executor
    Recorder.made, Recorder.batches = [], 0

    def fake(
        kind: str = "local", *, address: str | None = None, n_jobs: int | None = None
    ) -> Executor:
        real(kind, address=address, n_jobs=n_jobs)  # the real checks, then run inline
        Recorder.made.append((str(kind), address, n_jobs))
        return Recorder()

    monkeypatch.setattr(training.executor, "make_executor", fake)
    return Recorder


def write_router_csv(folder: Path, scales: list[float]) -> tuple[Path, Path]:
    x, y = make_router_data(400, seed=7)
    lines = [",".join([*ROUTER_COLUMNS, "label"])]
    lines += [",".join([*map(str, row), str(label)]) for row, label in zip(x, y, strict=True)]
    (folder / "data.csv").write_text("\n".join(lines) + "\n")
    spec = {
        "name": "router",
        "label": "label",
        "sensors": {"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
        "costs": ROUTER_COSTS,
        "cost_scales": scales,
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    return folder / "data.csv", folder / "spec.json"


def test_cli_passes_the_executor_options_through(
    tmp_path: Path, recorder: type[Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    import training.bundles.digits
    from training.cli import app

    csv, spec = write_router_csv(tmp_path, [0.0, 0.3])
    result = CliRunner().invoke(
        app,
        [
            "dag",
            "--csv",
            str(csv),
            "--spec",
            str(spec),
            "--out",
            str(tmp_path / "out"),
            "--executor",
            "ray",
            "--address",
            "10.1.2.3:6379",
            "--n-jobs",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert recorder.made == [("ray", "10.1.2.3:6379", 3)]
    assert recorder.batches >= 2  # the bank, then the second cost scale
    assert read_manifest(tmp_path / "out").name == "router"

    seen: dict[str, Any] = {}

    def fake_build(out: Path, config: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(training.bundles.digits, "build_bundle", fake_build)
    result = CliRunner().invoke(
        app,
        ["build", "--out", str(tmp_path / "digits"), "--executor", "ray", "--address", "head:6379"],
    )
    assert result.exit_code == 0, result.output
    assert recorder.made[-1] == ("ray", "head:6379", None)
    assert isinstance(seen["executor"], Recorder)
    result = CliRunner().invoke(app, ["build", "--out", str(tmp_path / "digits"), "--n-jobs", "2"])
    assert recorder.made[-1:] == [("local", None, 2)]


def plain(output: str) -> str:
    """CLI output without rich's box borders and line wrapping."""
    return " ".join(output.replace("│", " ").split())


def test_cli_rejects_unknown_executors_and_stray_addresses(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from training.cli import app

    csv, spec = write_router_csv(tmp_path, [0.0])
    common = ["dag", "--csv", str(csv), "--spec", str(spec), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, [*common, "--executor", "spark"])
    assert result.exit_code == 2
    assert "'spark' is not one of 'local', 'ray'" in plain(result.output)
    result = CliRunner().invoke(app, [*common, "--address", "10.1.2.3:6379"])
    assert result.exit_code == 2
    assert "only for the ray executor" in plain(result.output)
    assert not (tmp_path / "o").exists()


def test_cli_joins_a_ray_cluster_started_with_ray_start(tmp_path: Path) -> None:
    """`ray start --head` (its own process group), then `budgetserve-train dag --executor ray
    --address 127.0.0.1:PORT` in another process: the bundle is the one an inline build
    writes."""
    pytest.importorskip("ray")
    bin_dir = Path(sys.executable).parent
    csv, spec = write_router_csv(tmp_path, SCALES)
    env = {**os.environ, **ray_env(token=True)}
    temp, port = ray_temp_dir(), free_port()
    head = subprocess.Popen(
        [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--object-store-memory=100000000",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        joined = subprocess.run(
            [
                str(bin_dir / "budgetserve-train"),
                "dag",
                "--csv",
                str(csv),
                "--spec",
                str(spec),
                "--out",
                str(tmp_path / "on-ray"),
                "--executor",
                "ray",
                "--address",
                f"127.0.0.1:{port}",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        left = wait_gone(temp)
        for line in left:  # last resort, only what this test started (named by its temp dir)
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert not left, f"Ray left processes behind: {left}"
    from training.bundles.dag import DagSpec, build_dag_bundle, read_csv

    dag_spec = DagSpec.load(spec)
    x, y, columns = read_csv(csv, dag_spec)
    inline = build_dag_bundle(tmp_path / "inline", dag_spec, x, y, columns)
    on_ray = read_manifest(tmp_path / "on-ray")
    assert on_ray.provenance.parameters["operating_points"] == inline.points
    for onnx_file in sorted((tmp_path / "inline").glob("*.onnx")):
        assert (tmp_path / "on-ray" / onnx_file.name).read_bytes() == onnx_file.read_bytes()


# ------------------------------------------------------------------ the gating sweep (paper 001)


@pytest.mark.parametrize("kind", ["joblib", "ray"])
def test_gating_sweep_elsewhere_is_the_same(request: pytest.FixtureRequest, kind: str) -> None:
    from sklearn.datasets import make_classification
    from sklearn.neighbors import KNeighborsClassifier

    from training.gating import FittedF0
    from training.gating.sweep import Config
    from training.gating.sweep import sweep as gating_sweep

    if kind == "ray":
        request.getfixturevalue("ray_local")
    X, y = make_classification(500, 6, n_informative=4, n_classes=3, random_state=0)
    f0 = FittedF0.fit(KNeighborsClassifier(5), X[:300], y[:300])
    grid = [
        Config("adapt-gbrt", 0.3, 1e-3),
        Config("greedymiser", 0.0, 1e-2),
        Config("adapt-lin", 0.3, 1e-2),
        Config("l1", 0.0, 0.1),
    ]

    def run(ex: Any) -> list[tuple[str, float, float, float, float]]:
        points = gating_sweep(
            X[:300],
            y[:300],
            X[300:400],
            y[300:400],
            costs=np.ones(6),
            f0=f0,
            grid=grid,
            X_test=X[400:],
            y_test=y[400:],
            executor=ex,
        )
        for p in points:  # the shared f0 is re-attached, not a copy that travelled back
            assert getattr(p.estimator, "f0_", None) in (None, f0.model)
            assert p.method == "greedymiser" or p.estimator.f0_ is f0.model
        return [(p.id, p.val_accuracy, p.val_cost, p.test_accuracy, p.test_cost) for p in points]

    reference = run(INLINE)
    with make_executor("ray" if kind == "ray" else "local", n_jobs=2) as ex:
        assert run(ex) == reference
