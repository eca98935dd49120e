"""The CSTC benchmark's core functions (benchmarks/cstc.py) on small synthetic data."""

from __future__ import annotations

import numpy as np

from benchmarks import cstc as b
from training.cstc.synthetic import imbalanced_cascade
from training.data.uci import Split


def _split() -> Split:
    X, y = imbalanced_cascade(600, seed=0)
    Xv, yv = imbalanced_cascade(300, seed=1)
    Xt, yt = imbalanced_cascade(300, seed=2)
    return Split(X, y, Xv, yv, Xt, yt)


def test_pareto_keeps_cost_sorted_strictly_rising_points() -> None:
    rows = [
        b.Row("m", "a", 0.8, 3.0, 0.8, 3.0),
        b.Row("m", "b", 0.7, 1.0, 0.7, 1.0),
        b.Row("m", "c", 0.7, 2.0, 0.9, 2.0),  # no better on validation than a cheaper one
        b.Row("m", "d", 0.9, 4.0, 0.9, 4.0),
    ]
    assert [r.setting for r in b.pareto(rows)] == ["b", "a", "d"]


def test_early_exit_spends_less_at_a_lower_threshold() -> None:
    costs = np.asarray([1.0, 10.0, 10.0, 10.0])
    rows = b._early_exit_rows(_split(), costs, "accuracy")
    by_tau = {r.setting: r for r in rows}
    assert by_tau["τ=0.6"].test_cost <= by_tau["τ=0.999"].test_cost <= costs.sum()
    assert all(r.test_cost >= 1.0 for r in rows)


def test_letter_a_subsamples_positives_to_the_ratio() -> None:
    rng = np.random.default_rng(0)
    y = np.asarray(["A"] * 50 + ["B"] * 1000)
    X = rng.normal(size=(len(y), 3))
    s = b._letter_a(Split(X, y, X, y, X, y), ratio=100)
    assert int(s.y_train.sum()) == 10 and len(s.y_train) == 1010
    assert set(np.unique(s.y_test)) == {0, 1}


def test_tree_rows_report_costs_in_their_own_units() -> None:
    costs = np.asarray([1.0, 10.0, 10.0, 10.0])
    free, priced_out = b._tree_rows(_split(), ("root-only",), costs, "accuracy", (0.0, 10.0))
    assert free.nodes == priced_out.nodes == 1
    assert priced_out.test_cost == 0.0  # λ = 10: no feature is worth its cost
    assert free.test_cost > 1.0 and free.test_cost in (11.0, 21.0, 31.0)  # λ = 0: weights
