"""Policies that see the state's classifier confidence (``policy_inputs``) and the adaptive
cost-scale grid's bisection rule (:func:`training.dag.sweep.refine_midpoints`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from training.dag import DagClassifier, sweep
from training.dag.policies import confidence
from training.dag.sweep import refine_midpoints
from training.export.dag import DagExportMismatch, _walk_tree, export_policy, verify_policy
from training.export.sklearn import onnx_probabilities

SENSORS = {"cheap": [0], "exact": [1]}
COSTS = {"cheap": 0.05, "exact": 1.0}
LAMBDA = 0.2  # acquiring `exact` costs 0.2 of a misclassification


def settled_data(n: int, seed: int) -> tuple[Any, Any, Any]:
    """Binary rows: `cheap` settles 70 % of them (|x| about 2, sign = label) and says nothing
    about the rest (x near 0, label a coin flip); `exact` gives every label. Returns X, y and
    the mask of settled rows (where the oracle policy stops)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    settled = rng.random(n) < 0.7
    sign = 2.0 * y - 1.0
    cheap = np.where(
        settled, sign * (2.0 + 0.3 * rng.standard_normal(n)), 0.3 * rng.standard_normal(n)
    )
    exact = sign + 0.1 * rng.standard_normal(n)
    return np.column_stack([cheap, exact]), y, settled


def _objective(model: DagClassifier, X: Any, y: Any) -> tuple[float, float, float]:
    pred, spent, _ = model.predict_with_cost(X)
    error = float(np.mean(pred != y))
    cost = float(spent.mean())
    return error + LAMBDA * cost, error, cost


def test_confidence_inputs_beat_raw_features_on_held_out_rows() -> None:
    X, y, _ = settled_data(3000, seed=0)
    X_test, y_test, settled = settled_data(4000, seed=1)
    kw: dict[str, Any] = {"sensors": SENSORS, "costs": COSTS, "cost_scale": LAMBDA}
    raw = DagClassifier(policy_inputs="features", **kw).fit(X, y)
    conf = DagClassifier(policy_inputs="features+confidence", **kw).fit(X, y)
    obj_raw, _, _ = _objective(raw, X_test, y_test)
    obj_conf, err_conf, cost_conf = _objective(conf, X_test, y_test)
    # The oracle: buy `cheap`, stop on the settled rows, buy `exact` on the others:
    # error about 0, cost 0.05 + 0.3 (objective about 0.07).
    oracle = LAMBDA * (COSTS["cheap"] + np.mean(~settled) * COSTS["exact"])
    assert obj_conf <= oracle + 0.02, (obj_conf, oracle)
    # A linear policy on the raw value cannot say "|x| is large" (stop on both tails): the
    # best it does is stop always or buy always, objective >= 0.15.
    assert obj_raw >= 0.14
    assert obj_conf < obj_raw - 0.06
    assert err_conf < 0.04
    # It stops exactly on the settled rows (where `cheap`'s classifier is confident).
    _, paths = conf.acquisition(X_test)
    bought_exact = np.array([len(p) == 3 for p in paths])
    assert np.mean(bought_exact == ~settled) > 0.93
    assert 0.3 < cost_conf < 0.42


def test_confidence_columns_and_exported_decisions_agree() -> None:
    X, y, _ = settled_data(800, seed=2)
    X_val, _, _ = settled_data(400, seed=3)
    for learner in ("linear", "poly2"):
        model = DagClassifier(
            sensors=SENSORS,
            costs=COSTS,
            cost_scale=LAMBDA,
            learner=learner,
            policy_inputs="features+confidence",
        ).fit(X, y)
        exported = model.export_policies()
        for st in exported["states"]:
            s = st["state"]
            cols = model.state_columns(s)
            assert st["inputs"] == [*cols, "top1", "margin"]
            fitted = model.policy_action(s, X_val[:, cols])
            decided = model.decide(s, X_val[:, cols])
            np.testing.assert_array_equal(fitted, decided)
            inp = model.policy_input(s, X_val[:, cols])
            assert inp.shape == (len(X_val), len(cols) + 2)
            clf = model.classifiers_[s]
            if clf is not None:
                p = clf.predict_proba(X_val[:, cols])
                np.testing.assert_allclose(inp[:, -2], p.max(axis=1))
                np.testing.assert_allclose(inp[:, -1], np.abs(p[:, 0] - p[:, 1]))


def test_confidence_oracle_values() -> None:
    got = confidence(np.array([[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 1.0]]))
    np.testing.assert_allclose(got, [[0.5, 0.2], [1 / 3, 0.0], [1.0, 1.0]])


def test_unknown_policy_inputs_are_refused() -> None:
    X, y, _ = settled_data(100, seed=4)
    with pytest.raises(ValueError, match="policy_inputs must be one of features, features"):
        DagClassifier(sensors=SENSORS, policy_inputs="logits").fit(X, y)


def test_grid_bisects_the_widest_cost_gaps_first() -> None:
    # (scale, validation cost): gaps 1.86 (0.1-0.3), 0.05 (0.3-0.31), 0.9 (0.31-1), none.
    points = [(0.0, 3.0), (0.1, 2.96), (0.3, 1.1), (0.31, 1.05), (1.0, 0.15), (2.0, 0.15)]
    mids = refine_midpoints(points, step=1.0)
    # Only gaps at least half as wide as the widest (1.86) and wider than 0.25 sensor.
    assert mids == [pytest.approx(np.sqrt(0.1 * 0.3))]
    # Equal-width gaps: both, widest first; a gap between scales within 1 % is never split.
    points = [(0.0, 2.0), (0.5, 1.0), (0.504, 0.0), (1.0, 0.0)]
    assert refine_midpoints(points, step=1.0) == [pytest.approx(0.5 / 8)]
    points = [(0.0, 2.0), (0.2, 1.0), (0.5, 0.0)]
    assert refine_midpoints(points, step=1.0) == [
        pytest.approx(0.2 / 8),
        pytest.approx(np.sqrt(0.1)),
    ]
    # Gaps of at most a quarter of the cheapest sensor are closed.
    assert refine_midpoints([(0.1, 1.0), (0.2, 0.8)], step=1.0) == []
    assert refine_midpoints([(0.1, 1.0), (0.2, 0.7)], step=1.0) == [pytest.approx(np.sqrt(0.02))]


def test_grid_fills_the_gap_between_one_and_two_sensors() -> None:
    X, y, _ = settled_data(1500, seed=5)
    X_val, y_val, _ = settled_data(1500, seed=6)
    kw: dict[str, Any] = {"sensors": SENSORS, "costs": {"cheap": 1.0, "exact": 1.0}}
    coarse = sweep(X, y, X_val, y_val, [0.0, 10.0], **kw)
    fine = sweep(X, y, X_val, y_val, [0.0, 10.0], refine=10, **kw)
    gap = abs(coarse[0][2] - coarse[1][2])
    assert gap > 1.5, "a two-sensor gap to fill"
    # An operating point at one sensor now exists between the extremes.
    assert any(0.25 * gap < p[2] < 0.75 * gap for p in fine)


@pytest.mark.parametrize(
    ("learner", "policy_learner"),
    [("linear", None), ("poly2", "linear"), ("poly2", None), ("gbrt", "linear"), ("gbrt", None)],
)
def test_confidence_policy_graph_reads_the_confidence_it_is_given(
    learner: str, policy_learner: str | None, tmp_path: Path
) -> None:
    X, y, _ = settled_data(1500, seed=7)
    X_val, _, _ = settled_data(1000, seed=8)
    model = DagClassifier(
        sensors=SENSORS,
        costs=COSTS,
        cost_scale=LAMBDA,
        learner=learner,
        policy_learner=policy_learner,
        policy_inputs="features+confidence",
    ).fit(X, y)
    width = X.shape[1]
    goc = {c: c for c in range(width)}
    policy = export_policy(tmp_path, "p.onnx", model, width, goc)
    assert policy.confidence_inputs
    onx = onnx.load(str(tmp_path / "p.onnx"))
    assert [i.name for i in onx.graph.input] == ["features"]
    assert onx.graph.input[0].type.tensor_type.shape.dim[1].dim_value == width + 2
    assert not any(n.op_type == "TopK" for n in onx.graph.node), "no classifier inside"
    # Every ONNX logit equals its node's margin, every decision the fitted policy's (raises).
    verify_policy(tmp_path / "p.onnx", policy, model, X_val, goc)
    # The decisions taken as the runtime takes them (service/strategies/dag.py: the state's
    # classifier's confidence appended, ONNX logits, the tree) agree with the fitted DAG's
    # on the state that has a choice to make.
    cheap = next(s for s in model.states_ if model.state_sensors(s) == ["cheap"])
    spec = next(st for st in policy.states if st.groups == cheap)
    cols = model.state_columns(cheap)
    proba = model.classifiers_[cheap].predict_proba(X_val[:, cols])
    inputs = np.hstack([X_val, confidence(proba)]).astype(np.float32)
    logits = onnx_probabilities((tmp_path / "p.onnx").read_bytes(), inputs)
    walked = np.array([_walk_tree(spec.tree, row)[0] for row in logits])
    fitted = model.policy_action(cheap, X_val[:, cols])
    assert np.mean(walked == fitted) > 0.995
    assert 0.1 < np.mean(fitted != 0) < 0.9, "the policy both stops and buys on these rows"


def test_a_corrupted_confidence_graph_is_refused(tmp_path: Path) -> None:
    X, y, _ = settled_data(1500, seed=7)
    X_val, _, _ = settled_data(1000, seed=8)
    model = DagClassifier(
        sensors=SENSORS, costs=COSTS, cost_scale=LAMBDA, policy_inputs="features+confidence"
    ).fit(X, y)
    goc = {0: 0, 1: 1}
    policy = export_policy(tmp_path, "p.onnx", model, 2, goc)
    onx = onnx.load(str(tmp_path / "p.onnx"))
    for init in onx.graph.initializer:  # read the margin where the top probability belongs
        if init.name == "W":
            w = onnx.numpy_helper.to_array(init).copy()
            assert np.abs(w[2:]).sum() > 0, "the nodes read the confidence columns"
            w[[2, 3]] = w[[3, 2]]
            init.CopyFrom(onnx.numpy_helper.from_array(w, "W"))
    onnx.save(onx, str(tmp_path / "p.onnx"))
    with pytest.raises(DagExportMismatch, match="ONNX differs from the exported node"):
        verify_policy(tmp_path / "p.onnx", policy, model, X_val, goc)
