"""ADAPT-GBRT, GreedyMiser, the gating export and the gating bundle builder (paper 001).

Why one module over 450 lines: the fits, their export and the bundle builder share the fitted
systems built once per module; the float32 export and the routing checks have files of their own.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pytest
from sklearn.datasets import make_classification
from sklearn.neighbors import KNeighborsClassifier

from service.bundle import GatingStrategy, read_manifest
from training.bundles.gating import GatingSpec, build_gating_bundle
from training.export.gating import (
    ExportedModel,
    GatingExportMismatch,
    export_f0,
    export_system,
    lightgbm_onnx,
    select_columns,
    verify_system,
)
from training.gating import AdaptGbrt, AdaptLin, FittedF0, L1Baseline, greedy_miser
from training.gating.sweep import Config, pareto, sweep


def _data(n_classes: int, n: int = 900, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    X, y = make_classification(
        n,
        8,
        n_informative=5,
        n_redundant=1,
        n_classes=n_classes,
        n_clusters_per_class=1,
        random_state=seed,
    )
    return X, np.asarray(["abcd"[i] for i in y])


def _small_f0() -> Any:
    return lgb.LGBMClassifier(n_estimators=60, num_leaves=15, n_jobs=1, verbose=-1)


@pytest.fixture(scope="module")
def multiclass() -> tuple[np.ndarray, np.ndarray, FittedF0]:
    X, y = _data(3)
    return X, y, FittedF0.fit(_small_f0(), X[:600], y[:600])


def test_adapt_gbrt_respects_p_full_and_reports_consistent_costs(
    multiclass: tuple[np.ndarray, np.ndarray, FittedF0],
) -> None:
    X, y, f0 = multiclass
    costs = np.arange(1.0, 9.0)
    m = AdaptGbrt(
        p_full=0.3, lam=0.003, feature_costs=costs, f0=f0, n_rounds=4, route_rule="expected"
    ).fit(X[:600], y[:600])
    assert m.q_.mean() <= 0.3 + 1e-9
    # "expected" routes the training fraction mean(q); the paper's g > 0 may route fewer
    assert m.route(X[:600]).mean() == pytest.approx(m.q_.mean(), abs=0.01)
    assert m.route(X[:600]).mean() >= m.set_params(route_rule="zero").route(X[:600]).mean()
    m.set_params(route_rule="expected")
    assert len(m.objective_) == 4 and np.all(np.isfinite(m.objective_))
    Xte = X[600:]
    proba = m.predict_proba(Xte)
    assert proba.shape == (300, 3) and np.allclose(proba.sum(axis=1), 1.0)
    routed = m.route(Xte)
    assert 0.0 < routed.mean() < 1.0  # the gate really splits the items
    # routed rows answer with f0, the others with f1
    f0p = f0.model.predict_proba(Xte)
    assert np.allclose(proba[routed], f0p[routed])
    assert np.allclose(proba[~routed], m.f1_proba(Xte)[~routed])
    cost = m.feature_cost(Xte)
    assert np.allclose(cost[routed], costs.sum())
    assert np.allclose(cost[~routed], costs[m.low_cost_features_].sum())
    assert set(m.low_cost_features_) == set(m.f1_features_) | set(m.gate_features_)
    assert (m.predict(Xte) == y[600:]).mean() > 0.7


def test_larger_lambda_buys_fewer_features_and_greedymiser_never_routes(
    multiclass: tuple[np.ndarray, np.ndarray, FittedF0],
) -> None:
    X, y, f0 = multiclass
    used = []
    for lam in (0.0, 0.01, 0.1, 10.0):
        m = AdaptGbrt(p_full=0.3, lam=lam, f0=f0, n_rounds=3).fit(X[:600], y[:600])
        used.append(len(m.low_cost_features_))
    assert used[0] >= used[1] >= used[2] >= used[3]
    assert used[0] > used[2] and used[3] == 0  # a prohibitive λ buys nothing
    gm = greedy_miser(lam=0.01, n_rounds=3).fit(X[:600], y[:600])
    assert gm.gate_booster_ is None and gm.f0_ is None and gm.p_full == 0.0
    assert not gm.route(X[600:]).any()
    assert np.allclose(gm.feature_cost(X[600:]), gm.low_cost_)


@pytest.mark.parametrize(
    ("kwargs", "exc", "msg"),
    [
        ({"p_full": 2.0}, ValueError, r"p_full must be in \[0, 1\]"),
        ({"lam": -1.0}, ValueError, "lam must be finite and >= 0"),
        ({"n_rounds": 0}, ValueError, "n_rounds must be >= 1"),
        ({"num_leaves": 1}, ValueError, "num_leaves must be >= 2"),
        ({"learning_rate": 0.0}, ValueError, "learning_rate must be > 0"),
        ({"f0": "forest"}, TypeError, "f0 must be a classifier with predict_proba"),
    ],
)
def test_adapt_gbrt_parameter_validation(kwargs: dict[str, Any], exc: type, msg: str) -> None:
    X, y = _data(2, n=60)
    with pytest.raises(exc, match=msg):
        AdaptGbrt(**kwargs).fit(X, y)


def test_fitted_f0_must_match_the_rows(multiclass: tuple[np.ndarray, np.ndarray, FittedF0]) -> None:
    X, y, f0 = multiclass
    with pytest.raises(ValueError, match="fitted on 600 rows, X has 300"):
        AdaptGbrt(f0=f0).fit(X[600:], y[600:])


@pytest.mark.parametrize("n_classes", [2, 3])
def test_every_method_exports_and_the_export_reproduces_the_fit(n_classes: int) -> None:
    X, y = _data(n_classes)
    f0 = FittedF0.fit(_small_f0(), X[:600], y[:600])
    grid = [
        Config("adapt-gbrt", 0.3, 0.003),
        Config("greedymiser", 0.0, 0.01),
        Config("adapt-lin", 0.3, 0.01),
        Config("l1", 0.0, 0.1),
    ]
    points = sweep(
        X[:600],
        y[:600],
        X[600:750],
        y[600:750],
        costs=np.ones(8),
        f0=f0,
        grid=grid,
        X_test=X[750:],
        y_test=y[750:],
    )
    assert {p.method for p in points} == {"adapt-gbrt", "greedymiser", "adapt-lin", "l1"}
    for point in points:
        system = export_system(point.estimator, X[:600])
        err = verify_system(point.estimator, system, X[750:], label=point.id)
        assert err <= 1e-4
        assert np.isfinite(point.test_accuracy) and 0 <= point.test_cost <= 8
        if point.method == "greedymiser":
            assert system.gate.onnx is None and not system.always_full
    f0_onnx = export_f0(f0.model, 8, X[:600]).onnx
    assert f0_onnx is not None
    from training.export.sklearn import onnx_probabilities

    got = onnx_probabilities(f0_onnx, X[750:].astype(np.float32))
    assert np.abs(got - f0.model.predict_proba(X[750:])).max() <= 1e-4


def test_a_tampered_export_is_caught(multiclass: tuple[np.ndarray, np.ndarray, FittedF0]) -> None:
    X, y, f0 = multiclass
    m = AdaptGbrt(p_full=0.3, lam=0.001, f0=f0, n_rounds=3).fit(X[:600], y[:600])
    system = export_system(m, X[:600])
    assert len(system.f1.columns) >= 2
    cols = system.f1.columns
    assert system.f1.onnx is not None
    # the same trees wired to the wrong columns must not pass verification
    swapped = [cols[1], cols[0], *cols[2:]]
    f1_onnx, splits = lightgbm_onnx(m.f1_booster_, 8, X[:600])
    system.f1 = ExportedModel(select_columns(f1_onnx, cols, 8), swapped, splits=splits)
    with pytest.raises(GatingExportMismatch, match="f1 ONNX differs"):
        verify_system(m, system, X[600:], label="tampered")


def test_pareto_keeps_only_undominated_points(
    multiclass: tuple[np.ndarray, np.ndarray, FittedF0],
) -> None:
    X, y, f0 = multiclass
    points = sweep(
        X[:600],
        y[:600],
        X[600:],
        y[600:],
        costs=np.ones(8),
        f0=f0,
        grid=[Config("l1", 0.0, c) for c in (0.01, 0.1, 1.0)],
    )
    front = pareto(points)
    assert front and len(front) <= len(points)
    for a, b in itertools.pairwise(front):
        assert a.val_cost <= b.val_cost and a.val_accuracy < b.val_accuracy
    for p in points:  # brute force: nothing on the front is dominated by any point
        for f in front:
            assert not (p.val_cost < f.val_cost and p.val_accuracy >= f.val_accuracy)


def _write_csv(path: Path, X: np.ndarray, y: np.ndarray) -> list[str]:
    cols = [f"f{i}" for i in range(X.shape[1])]
    lines = [",".join([*cols, "label"])]
    lines += [
        ",".join([*(f"{v:.6g}" for v in row), str(lab)]) for row, lab in zip(X, y, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return cols


def test_cli_builds_a_valid_gating_bundle(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from training.cli import app

    X, y = _data(3, n=700, seed=1)
    cols = _write_csv(tmp_path / "data.csv", X, y)
    spec = {
        "name": "toy-gating",
        "label": "label",
        "sensors": cols,
        "costs": {c: float(i + 1) for i, c in enumerate(cols)},
        "grid": [
            {"method": "adapt-gbrt", "p_full": 0.3, "regularisation": 0.003},
            {"method": "greedymiser", "p_full": 0.0, "regularisation": 0.01},
            {"method": "l1", "p_full": 0.0, "regularisation": 0.1},
        ],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "bundle"
    result = CliRunner().invoke(
        app,
        [
            "gating",
            "--csv",
            str(tmp_path / "data.csv"),
            "--spec",
            str(tmp_path / "spec.json"),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    # readable by a service running as another user (the image mounts bundles read-only)
    assert out.stat().st_mode & 0o777 == 0o755
    strategy = manifest.strategy()
    assert isinstance(strategy, GatingStrategy) and manifest.default_strategy == "gating"
    ids = [p.id for p in strategy.points]
    assert ids[0] == "f0" and len(ids) >= 2
    full = sum(range(1, 9))
    for point in strategy.points:
        low_file = manifest.model(point.low_model).file
        assert low_file is None or (out / low_file).is_file()
        if point.gate_file:
            assert (out / point.gate_file).is_file()
        assert 0 <= point.mean_cost <= full + 1e-9
    # the exported points (after f0) are the validation Pareto set: on validation rows they
    # rise in accuracy with cost; the manifest's own numbers, which the service chooses by,
    # are the validation rows' too (never a test row's)
    sweep = {p["id"]: p for p in manifest.provenance.parameters["sweep"]}
    rest = [sweep[p.id] for p in strategy.points[1:]]
    for a, b in itertools.pairwise(rest):
        assert a["validation_cost"] <= b["validation_cost"]
        assert a["validation_accuracy"] < b["validation_accuracy"]
    for point in strategy.points[1:]:
        assert point.accuracy == sweep[point.id]["validation_accuracy"]
        assert point.mean_cost == pytest.approx(sweep[point.id]["validation_cost"])
        assert point.fraction_full == sweep[point.id]["validation_fraction_full"]
    f0_val = manifest.provenance.parameters["f0_accuracy"]["validation"]
    assert manifest.model("f0").accuracy == f0_val


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        ({"sensors": {"ab": ["f0", "f1"]}, "methods": ["adapt-lin"]}, "one column per sensor"),
        ({"fixed": {"learners": ["svm"]}}, "fixed learners must be"),
        ({"methods": ["adapt-xyz"]}, "unknown gating method"),
        ({"grid": [{"method": "l1"}]}, "grid entries are"),
        ({"f0": "svm"}, "f0 must be one of"),
    ],
)
def test_gating_spec_errors_say_what_is_wrong(change: dict[str, Any], msg: str) -> None:
    raw: dict[str, Any] = {"name": "x", "label": "label", "sensors": ["f0", "f1"]}
    raw.update(change)
    with pytest.raises(ValueError, match=msg):
        GatingSpec(**raw).check()


def test_adapt_lin_and_l1_on_synthetic_knn_f0_export_round_trip() -> None:
    """The linear exports fold the standardisation into raw-unit weights exactly."""
    from training.data.synthetic import make_synthetic2

    data = make_synthetic2(50, seed=2)
    Xs = data.X * np.array([10.0, 0.1]) + np.array([5.0, -3.0])  # unequal scales and offsets
    for est in (
        AdaptLin(p_full=0.5, gamma=0.02, f0=KNeighborsClassifier(3)),
        L1Baseline(C=1.0, f0=KNeighborsClassifier(3)),
    ):
        est.fit(Xs, data.y)
        system = export_system(est, Xs)
        assert verify_system(est, system, Xs, label=type(est).__name__) <= 1e-4


def test_a_system_that_buys_no_feature_exports_as_a_prior(tmp_path: Path) -> None:
    """λ so large that g and f1 use no feature: f1 is exported as a constant prior model, the
    gate as no gate (or the point is dropped when the constant gate sends everything to f0)."""
    X, y = _data(2, n=400, seed=3)
    cols = [f"f{i}" for i in range(8)]
    spec = GatingSpec(
        name="only-f0",
        label="label",
        sensors=list(cols),  # type: ignore[arg-type]
        grid=[{"method": "adapt-gbrt", "p_full": 0.3, "regularisation": 1e6}],
    )
    result = build_gating_bundle(tmp_path / "b", spec, X, y, cols)
    strategy = result.manifest.strategy()
    assert isinstance(strategy, GatingStrategy)
    assert strategy.points[0].id == "f0" and len(strategy.points) > 1
    for point in strategy.points[1:]:
        low = result.manifest.model(point.low_model)
        assert low.prior is not None and low.features == []
        assert point.gate_file is None and point.gate_features == []
        assert point.mean_cost == 0.0


def test_a_trained_gating_bundle_is_served_exactly_as_trained(
    tmp_path: Path, redis_url: str
) -> None:
    """Build with the real builder, serve with the real app: for every exported operating point
    (pinned with a one-point strategy, budget covering every feature) each held-out row is
    routed, answered and predicted exactly as the fitted estimator does offline, and spends
    the features the estimator says it acquires (rows in a real Redis, requests send ids)."""
    from fastapi.testclient import TestClient

    from service.bundle import write_manifest
    from service.cache import InProcessCache
    from service.http import create_app
    from service.settings import Settings
    from tests.support.sensor_store import SensorStore

    X, y = _data(3, n=900, seed=4)
    cols = [f"f{i}" for i in range(8)]
    costs = {c: float(i + 1) for i, c in enumerate(cols)}
    spec = GatingSpec(
        name="served",
        label="label",
        sensors=list(cols),  # type: ignore[arg-type]
        costs=costs,
        grid=[
            {"method": "adapt-gbrt", "p_full": 0.3, "regularisation": 0.003},
            {"method": "adapt-lin", "p_full": 0.3, "regularisation": 0.01},
            {"method": "l1", "p_full": 0.0, "regularisation": 0.1},
        ],
        pareto=False,  # every configuration, so both routing rules and both branches are served
        fixed=False,  # (the fixed points are served by tests/service; f0 as the high model)
    )
    out = tmp_path / "served"
    result = build_gating_bundle(out, spec, X, y, cols)
    manifest = result.manifest
    strategy = manifest.strategy()
    assert isinstance(strategy, GatingStrategy) and len(strategy.points) >= 3
    pinned = [
        strategy.model_copy(update={"name": f"only-{p.id}", "points": [p]}) for p in strategy.points
    ]
    write_manifest(out, manifest.model_copy(update={"strategies": [strategy, *pinned]}))
    full = sum(costs.values())
    rows = X[:40]
    store = SensorStore(redis_url, cols)
    settings = Settings(models_dir=tmp_path, sensor_sources={"served": {"*": store.source()}})
    app = create_app(settings, cache=InProcessCache(1 << 20))
    routed_somewhere = False
    with TestClient(app) as client:
        for point in strategy.points:
            est = result.estimators[point.id]
            if point.id == "f0":
                expected_pred = np.unique(y)[est.predict(rows)]
                expected_route = np.ones(len(rows), dtype=bool)
                expected_cost = np.full(len(rows), full)
            else:
                expected_pred = est.predict(rows)
                expected_route = est.route(rows)
                expected_cost = est.feature_cost(rows)  # its own account, in the same costs
            for i, row in enumerate(rows):
                body = {
                    "model": "served",
                    "strategy": f"only-{point.id}",
                    "budget": full + 1,
                    "item": store.item(row, f"{point.id}/{i}"),  # a fresh id: nothing cached
                }
                r = client.post("/predict", json=body)
                assert r.status_code == 200, r.text
                answer = r.json()
                assert answer["prediction"] == str(expected_pred[i]), (point.id, i)
                high = answer["answered_by"] == point.high_model
                assert high == bool(expected_route[i]), (point.id, i, answer["decision"])
                assert answer["cost"]["spent"] == pytest.approx(expected_cost[i]), (point.id, i)
                routed_somewhere |= high and point.id != "f0"
    assert routed_somewhere  # some gate really sent rows to f0


def test_non_finite_gate_thresholds_cannot_be_written() -> None:
    from pydantic import ValidationError

    from service.bundle import GatePoint

    base: dict[str, Any] = {
        "id": "p",
        "method": "adapt-gbrt",
        "p_full": 0.3,
        "regularisation": 0.01,
        "low_model": "a",
        "high_model": "b",
        "mean_cost": 1.0,
        "fraction_full": 0.1,
        "accuracy": 0.9,
    }
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="finite number"):
            GatePoint(**base, threshold=bad)


def test_csv_with_a_missing_value_needs_a_declared_imputation(tmp_path: Path) -> None:
    from training.data.tabular import read_csv

    (tmp_path / "d.csv").write_text("f0,f1,label\n1,2,a\n3,nan,b\n")
    spec = GatingSpec(name="x", label="label", sensors=["f0", "f1"])  # type: ignore[arg-type]
    x, y, _ = read_csv(tmp_path / "d.csv", spec)  # a gap (issue 26), not an error
    assert np.isnan(x[1, 1])
    with pytest.raises(ValueError, match=r"1 missing cells \(empty or NA\) in f1 \(1\).*impute"):
        spec.split(x, y)


def test_points_that_f0_dominates_are_not_exported(tmp_path: Path) -> None:
    """GreedyMiser with a tiny λ buys every feature: at full cost, unless it beats f0 on
    validation, f0 alone dominates it and it is left out."""
    X, y = _data(2, n=500, seed=5)
    cols = [f"f{i}" for i in range(8)]
    spec = GatingSpec(
        name="dom",
        label="label",
        sensors=list(cols),  # type: ignore[arg-type]
        grid=[{"method": "greedymiser", "p_full": 0.0, "regularisation": 0.0}],
        pareto=False,
    )
    result = build_gating_bundle(tmp_path / "b", spec, X, y, cols)
    [swept] = result.points
    f0_val = result.f0_accuracy["validation"]
    strategy = result.manifest.strategy()
    assert isinstance(strategy, GatingStrategy)
    exported = [p.id for p in strategy.points]
    assert swept["validation_cost"] == 8.0  # every feature bought
    if swept["validation_accuracy"] > f0_val:
        assert swept["id"] in exported
    else:
        assert exported == ["f0"]


@pytest.mark.parametrize("f0", ["random-forest", "rbf-svm"])
def test_other_f0_kinds_export_and_verify(tmp_path: Path, f0: str) -> None:
    X, y = _data(3, n=400, seed=6)
    cols = [f"f{i}" for i in range(8)]
    spec = GatingSpec(
        name="kinds",
        label="label",
        sensors=list(cols),  # type: ignore[arg-type]
        f0=f0,
        grid=[{"method": "l1", "p_full": 0.0, "regularisation": 0.1}],
    )
    result = build_gating_bundle(tmp_path / "b", spec, X, y, cols)  # verifies every export
    assert (tmp_path / "b" / "f0.onnx").is_file()
    assert result.manifest.model("f0").accuracy > 0.6
