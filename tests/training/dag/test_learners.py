"""The DAG's non-linear learners (training/dag/learners.py), their exports, and the adaptive
cost-scale grid of the sweep."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.dag import DagClassifier, sweep
from training.dag.learners import Float32Lgbm, f32_floor, lgbm_trees, tree_scores
from training.dag.policies import node_margin
from training.data.synthetic import ROUTER_COSTS, ROUTER_SENSORS, make_router_data
from training.export.dag import export_policy, lgbm_classifier_onnx, verify_policy
from training.export.sklearn import onnx_probabilities


def test_f32_floor_is_the_largest_float32_not_above() -> None:
    rng = np.random.default_rng(0)
    for v in [*rng.normal(size=200).tolist(), 0.1, -0.1, 1e-30, 0.0, 3.0]:
        f = f32_floor(v)
        assert float(np.float32(f)) == f and f <= v
        assert float(np.nextafter(np.float32(f), np.float32(np.inf))) > v


def test_tree_threshold_between_adjacent_float32_values_keeps_both_sides() -> None:
    """LightGBM splits between two adjacent float32 values a < b at their double midpoint,
    which rounds to b in float32: a tree stored that way sends b left. The exported threshold
    (the float32 floor) keeps every training value on its fitted side."""
    a = np.float32(0.1)
    b = np.nextafter(a, np.float32(1))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    X = np.hstack([np.where(y == 1, b, a).astype(np.float64)[:, None], rng.normal(size=(400, 1))])
    est = Float32Lgbm(n_estimators=5).fit(X, y)
    t = est.model_.booster_.dump_model()["tree_info"][0]["tree_structure"]["threshold"]
    assert float(a) < t < float(b) and float(np.float32(t)) == float(b), "the case under test"
    assert np.all(est.predict(X) == y)
    p = onnx_probabilities(lgbm_classifier_onnx(est, 2), X.astype(np.float32))
    assert np.all(p.argmax(axis=1) == y)
    assert np.abs(p - est.predict_proba(X)).max() < 1e-5


@pytest.mark.parametrize("n_classes", [2, 4])
def test_exported_trees_are_lightgbm(n_classes: int) -> None:
    """The exported arrays (numpy) and the ONNX graph against LightGBM's own prediction."""
    rng = np.random.default_rng(n_classes)
    X = rng.normal(size=(600, 3)) * [1.0, 1e3, 1e-3]
    y = (X[:, 0] > 0).astype(int) + (n_classes > 2) * 2 * (X[:, 1] > 0)
    est = Float32Lgbm(n_estimators=30).fit(X, y)
    trees = lgbm_trees(est)
    n_out = 1 if n_classes == 2 else n_classes
    raw = est.raw_score(X).reshape(len(X), n_out)
    np.testing.assert_allclose(tree_scores(trees, X, n_out), raw, rtol=0, atol=1e-9)
    p = onnx_probabilities(lgbm_classifier_onnx(est, 3), X.astype(np.float32))
    np.testing.assert_allclose(p, est.predict_proba(X), rtol=0, atol=1e-5)
    for tree in trees:
        thr = np.asarray(tree["threshold"])
        assert np.array_equal(thr.astype(np.float32).astype(np.float64), thr)


@pytest.fixture(scope="module")
def router_data() -> tuple[Any, Any, Any, Any]:
    X, y = make_router_data(1200, seed=0)
    X_val, y_val = make_router_data(1500, seed=100)
    return X, y, X_val, y_val


@pytest.mark.parametrize(
    ("learner", "policy_learner"), [("poly2", None), ("poly3", "poly2"), ("gbrt", None)]
)
def test_nonlinear_dag_learns_the_router_and_exports(
    router_data: tuple[Any, Any, Any, Any], learner: str, policy_learner: str | None, tmp_path: Path
) -> None:
    X, y, X_val, y_val = router_data
    model = DagClassifier(
        sensors=ROUTER_SENSORS,
        costs=ROUTER_COSTS,
        cost_scale=0.03,
        learner=learner,
        policy_learner=policy_learner,
    ).fit(X, y)
    assert model.policy_learner_ == (policy_learner or learner)
    pred, spent, _ = model.predict_with_cost(X_val)
    # Buy r, then the sensor r points to (cost 6), nearly always right.
    assert 5.5 <= spent.mean() <= 6.5 and np.mean(pred != y_val) < 0.1
    for s in model.states_:
        cols = model.state_columns(s)
        for data in (X, X_val):
            assert np.array_equal(
                model.decide(s, data[:, cols]), model.policy_action(s, data[:, cols])
            )
        fitted = model.policies_[s]
        Z = X_val[:, cols]
        if fitted.mean is not None and fitted.scale is not None:
            Z = (Z - fitted.mean) / fitted.scale
        for node, fit in zip(model.policy_nodes(s), fitted.nodes, strict=True):
            if "action" in node or node["constant"]:
                continue
            assert ("trees" in node) == (model.policy_learner_ == "gbrt")
            assert ("powers" in node) == model.policy_learner_.startswith("poly")
            # The exported node (arrays only) decides as the fitted estimator does.
            margin = node_margin(node, X_val[:, cols])
            right = np.asarray(fit.estimator.predict(Z)) == 1
            clear = np.abs(margin) > 1e-9
            assert clear.mean() > 0.99
            assert np.array_equal((margin > 0)[clear], right[clear])
    # The ONNX policy graph reproduces every node's margin and every decision.
    width = X.shape[1]
    goc = {c: c for c in range(width)}
    policy = export_policy(tmp_path, "p.onnx", model, width, goc)
    verify_policy(tmp_path / "p.onnx", policy, model, X_val, goc)


def test_unknown_learner_is_refused() -> None:
    X, y = make_router_data(200, seed=1)
    with pytest.raises(ValueError, match="learner must be one of linear, poly2, poly3, gbrt"):
        DagClassifier(sensors=ROUTER_SENSORS, learner="svm").fit(X, y)
    with pytest.raises(ValueError, match="policy_learner must be one of"):
        DagClassifier(sensors=ROUTER_SENSORS, policy_learner="poly9").fit(X, y)


def test_adaptive_grid_closes_cost_gaps(router_data: tuple[Any, Any, Any, Any]) -> None:
    X, y, X_val, y_val = router_data
    kw: dict[str, Any] = {"sensors": ROUTER_SENSORS, "costs": ROUTER_COSTS}
    coarse = sweep(X, y, X_val, y_val, [0.0, 1.0], **kw)
    assert abs(coarse[0][2] - coarse[1][2]) > 1.0, "a gap to close"
    cap = 12
    fine = sweep(X, y, X_val, y_val, [0.0, 1.0], refine=cap, **kw)
    assert [p[0] for p in fine[:2]] == [0.0, 1.0]
    added = fine[2:]
    assert 0 < len(added) <= cap
    assert [p[0] for p in added] == sorted(p[0] for p in added)
    assert all(0.0 < p[0] < 1.0 for p in added)
    points = sorted(fine, key=lambda p: p[0])
    gaps = [
        (lo[0], hi[0])
        for lo, hi in itertools.pairwise(points)
        if abs(lo[2] - hi[2]) > 1.0 and not (lo[0] > 0 and hi[0] / lo[0] < 1.01)
    ]
    # Every gap wider than the cheapest sensor is closed, unless the cap stopped the grid.
    assert not gaps or len(added) == cap
    # Intermediate costs now exist between the extremes.
    costs = sorted(p[2] for p in fine)
    assert max(np.diff(costs)) < abs(coarse[0][2] - coarse[1][2])
    with pytest.raises(ValueError, match="refine must be an int >= 0"):
        sweep(X, y, X_val, y_val, [0.0], refine=-1, **kw)
