"""The sensor-acquisition DAG (training/dag/): Graph-Reduce, filter-tree export, Alg. 2."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from training.dag import DagClassifier, select_subsets, sweep
from training.data.synthetic import (
    ROUTER_COSTS,
    ROUTER_SENSORS,
    make_informative_data,
    make_router_data,
    router_noise_floor,
)

ROUTER_SCALE = 0.03  # λ: 6λ ≈ 0.18 per routed row, far below the 0.5 error of stopping early


@pytest.fixture(scope="module")
def router() -> tuple[DagClassifier, Any, Any, Any, Any]:
    X, y = make_router_data(1500, seed=0)
    X_val, y_val = make_router_data(3000, seed=100)
    model = DagClassifier(sensors=ROUTER_SENSORS, costs=ROUTER_COSTS, cost_scale=ROUTER_SCALE)
    return model.fit(X, y), X, y, X_val, y_val


def _state_of(model: DagClassifier, names: set[str]) -> int:
    return next(s for s in model.states_ if set(model.state_sensors(s)) == names)


def test_router_reaches_the_optimal_adaptive_policy(router: Any) -> None:
    model, _X, _y, X_val, y_val = router
    pred, spent, final = model.predict_with_cost(X_val)
    cost = float(spent.mean())
    error = float(np.mean(pred != y_val))
    floor = router_noise_floor()
    assert 5.5 <= cost <= 6.5
    assert error <= floor + 0.015

    # It buys r, then the expensive sensor that r points to.
    ra, rb = _state_of(model, {"r", "a"}), _state_of(model, {"r", "b"})
    pos = X_val[:, 0] > 0
    assert np.mean(final[pos] == ra) > 0.95
    assert np.mean(final[~pos] == rb) > 0.95

    # Every fixed subset (same classifier family: the bank's state classifiers): none as cheap
    # reaches that error; the most accurate fixed subset costs more and errs more.
    fixed: dict[frozenset[str], tuple[float, float]] = {}
    for s in model.states_:
        clf = model.classifiers_[s]
        if clf is None:
            err = float(np.mean(y_val != np.argmax(model.prior_)))
        else:
            err = float(np.mean(clf.predict(X_val[:, model.state_columns(s)]) != y_val))
        fixed[frozenset(model.state_sensors(s))] = (model.state_cost(s), err)
    assert len(fixed) == 8
    for subset_cost, subset_err in fixed.values():
        if subset_cost <= cost:
            assert subset_err > error + 0.15
    best_cost, best_err = min(fixed.values(), key=lambda ce: (ce[1], ce[0]))
    assert best_cost >= 10.0 and best_err > error
    assert fixed[frozenset({"r", "a", "b"})][0] == 11.0
    at_least_as_good = [c for c, e in fixed.values() if e <= error + 0.005]
    assert all(c > cost for c in at_least_as_good)


def test_paths_are_monotone_chains_and_budgets_are_caps(router: Any) -> None:
    model, _X, _y, X_val, _y_val = router
    allowed = {s: {nxt: step for _g, nxt, step in model.transitions(s)} for s in model.states_}
    for budget in [None, 0.0, 0.5, 1.0, 5.0, 5.99, 6.0, 10.0, 11.0, 100.0]:
        spent, paths = model.acquisition(X_val, budget=budget)
        final = model.predict_with_cost(X_val, budget=budget)[2]
        if budget is not None:
            assert np.all(spent <= budget + 1e-9)
        for i, path in enumerate(paths):
            assert path[0] == 0
            total = 0.0
            for s, nxt in itertools.pairwise(path):
                assert s & nxt == s and nxt != s  # strictly grows: no group twice
                assert set(model.state_sensors(s)) < set(model.state_sensors(nxt))
                total += allowed[s][nxt]
            assert path[-1] == final[i]
            assert total == pytest.approx(spent[i])
            # Paying for the final state's sensors exactly once.
            assert spent[i] == pytest.approx(model.state_cost(path[-1]))
    spent0, paths0 = model.acquisition(X_val, budget=0.0)
    assert np.all(spent0 == 0) and all(p == [0] for p in paths0)
    spent5, _ = model.acquisition(X_val, budget=5.0)
    assert np.all(spent5 <= 1.0)  # r fits, then 5 more does not


def test_exported_policies_match_sklearn_policies(router: Any) -> None:
    model, X, _y, X_val, _y_val = router
    for s in model.states_:
        cols = model.state_columns(s)
        nodes = model.policy_nodes(s)
        actions = model.state_actions(s)
        assert actions[0] is None
        assert actions[1:] == sorted(a for a in actions[1:] if a is not None)
        leaves = sorted(n["action"] for n in nodes if "action" in n)
        assert leaves == list(range(len(actions)))
        for node in nodes:
            if "action" not in node:
                assert node["weights"].shape == (len(cols),)
        for data in (X, X_val):
            Xs = data[:, cols]
            ref = model.policy_action(s, Xs)
            assert np.array_equal(model.decide(s, Xs), ref)
        for i in range(0, X.shape[0], 97):
            assert model.decide(s, X[i, cols]) == model.policy_action(s, X[i, cols])[0]
    # The root sees nothing: a constant policy.
    assert model.state_columns(0) == []
    json.dumps(model.export_policies())


def test_predict_proba_and_labels() -> None:
    X, y01 = make_router_data(600, seed=3)
    y = np.where(y01 == 1, "pos", "neg")
    model = DagClassifier(sensors=ROUTER_SENSORS, costs=ROUTER_COSTS, cost_scale=0.03).fit(X, y)
    assert list(model.classes_) == ["neg", "pos"]
    for budget in [None, 0.0, 1.0, 6.0]:
        proba = model.predict_proba(X, budget=budget)
        assert proba.shape == (600, 2)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0)
        pred = model.predict(X, budget=budget)
        assert set(pred) <= {"neg", "pos"}
        np.testing.assert_array_equal(pred, model.classes_[np.argmax(proba, axis=1)])
    np.testing.assert_allclose(model.predict_proba(X, budget=0.0), np.tile(model.prior_, (600, 1)))


def test_sweep_cost_grows_as_cost_scale_falls() -> None:
    X, y = make_router_data(1000, seed=5)
    X_val, y_val = make_router_data(1500, seed=6)
    scales = [1.0, 0.3, 0.1, 0.03, 0.01, 0.0]
    res = sweep(X, y, X_val, y_val, scales, sensors=ROUTER_SENSORS, costs=ROUTER_COSTS)
    assert [r[0] for r in res] == scales
    costs = [r[2] for r in res]
    errors = [r[3] for r in res]
    assert costs[0] == 0.0 and errors[0] > 0.4  # too expensive: classify with the prior
    for a, b in itertools.pairwise(costs):
        assert b >= a - 0.25
    assert costs[-1] >= 6.0 and errors[-1] < 0.05
    assert res[1][1].classifiers_ is res[0][1].classifiers_  # the bank is shared
    assert [r[1].cost_scale for r in res] == scales


def test_alg2_picks_informative_sensors_first() -> None:
    X, y = make_informative_data(800, n_sensors=10, n_informative=3, seed=0)
    sensors = {f"x{i}": [i] for i in range(10)}
    sel = select_subsets(X, y, sensors=sensors, n_subsets=2)
    first = [name for _j, name, _g in sel.steps[:3]]
    assert set(first) == {"x0", "x1", "x2"}
    rewards = [g for _j, _n, g in sel.steps]
    assert all(b > a for a, b in itertools.pairwise([sel.prior_reward, *rewards]))
    assert sum(len(s) for s in sel.subsets) <= sel.budget == 20.0
    tight = select_subsets(X, y, sensors=sensors, n_subsets=2, budget=2.0)
    assert sum(len(s) for s in tight.subsets) <= 2


def test_dag_over_alg2_groups() -> None:
    X, y = make_informative_data(600, n_sensors=12, n_informative=3, seed=1)
    sensors = {f"x{i}": [i] for i in range(12)}
    model = DagClassifier(sensors=sensors, n_subsets=2, cost_scale=0.01).fit(X, y)
    names = model.sensor_names_
    assert model.groups_[-1] == names  # the full set is a group
    assert all(g for g in model.groups_)
    group_sets = [set(g) for g in model.groups_]
    all_groups = (1 << len(model.groups_)) - 1
    assert model.states_[0] == 0 and model.states_[-1] == all_groups
    seen = set()
    for s in model.states_:
        union = set().union(*(group_sets[g] for g in range(len(group_sets)) if s >> g & 1))
        assert set(model.state_sensors(s)) == union
        # Closed: holds every group it already covers; distinct states, distinct sensor sets.
        assert all(s >> g & 1 for g, gs in enumerate(group_sets) if gs <= union)
        seen.add(frozenset(union))
    assert len(seen) == len(model.states_)
    assert set(model.state_sensors(all_groups)) == set(names)
    spent, _paths = model.acquisition(X)
    assert np.all(spent <= 12.0)
    assert np.mean(model.predict(X) != y) < 0.2


def _fit(**kw: Any) -> DagClassifier:
    X, y = make_router_data(60, seed=0)
    params: dict[str, Any] = {"sensors": ROUTER_SENSORS, "costs": ROUTER_COSTS}
    params.update(kw)
    data = params.pop("data", (X, y))
    return DagClassifier(**params).fit(*data)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"sensors": {}}, "non-empty mapping"),
        ({"sensors": {"r": [0], "a": [0, 1]}, "costs": None}, "column 0 belongs to both"),
        ({"sensors": {"r": []}, "costs": None}, "has no columns"),
        ({"sensors": {"r": [9]}, "costs": None}, "column 9 but X has only 5 columns"),
        ({"costs": {"r": 1.0, "a": 5.0}}, r"missing \['b'\]"),
        ({"costs": {"r": 1.0, "a": 5.0, "b": -1.0}}, "finite and >= 0"),
        ({"cost_scale": -0.1}, "cost_scale must be a finite number >= 0, got -0.1"),
        ({"C": 0.0}, "C must be a finite number > 0, got 0.0"),
        ({"policy_C": float("nan")}, "policy_C must be"),
        ({"folds": 1}, "folds must be an int >= 2, got 1"),
        ({"n_subsets": 0}, r"n_subsets must be None or an int in \[1, 12\], got 0"),
        ({"subset_budget": 3.0}, "requires n_subsets"),
        ({"n_subsets": 2, "subset_budget": 0.0}, "subset_budget must be a finite number > 0"),
        (
            {
                "sensors": {f"s{i}": [i] for i in range(9)},
                "costs": None,
                "data": (np.zeros((20, 9)), np.arange(20) % 2),
            },
            "at most 8 sensors, got 9; pass n_subsets",
        ),
        ({"data": (np.zeros((10, 5)), np.zeros(10))}, "at least 2 classes, got 1"),
        ({"data": (np.zeros((10, 5)), np.array([0] * 8 + [1] * 2))}, "the smallest class has 2"),
        ({"data": (np.zeros((10, 5)), np.zeros(9))}, "one label per row of X"),
        ({"data": (np.zeros(10), np.zeros(10))}, "X must be 2-D"),
    ],
)
def test_parameter_validation(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _fit(**kw)


def test_prediction_validation(router: Any) -> None:
    model, X, _y, _X_val, _y_val = router
    with pytest.raises(ValueError, match="X must be 2-D with 5 columns, got shape"):
        model.predict(X[:, :3])
    with pytest.raises(ValueError, match="budget must be None or a number >= 0, got -1"):
        model.predict(X, budget=-1.0)
    with pytest.raises(ValueError, match="state 99 is not a state of this DAG"):
        model.policy_nodes(99)
    with pytest.raises(NotFittedError):
        DagClassifier(sensors=ROUTER_SENSORS).predict(X)
    with pytest.raises(ValueError, match="cost_scales must hold at least one value"):
        sweep(X, _y, X, _y, [], sensors=ROUTER_SENSORS)
