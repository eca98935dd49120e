"""The side-by-side benchmark's helpers (benchmarks/cstc_side_by_side.py) on tiny data."""

from __future__ import annotations

import numpy as np

from benchmarks import cstc_side_by_side as b
from benchmarks.cstc import Row
from training.data.uci import Split


def _rows() -> list[Row]:
    return [
        Row("a", "cheap", 0.80, 5.0, 0.80, 5.0),
        Row("a", "dear", 0.90, 50.0, 0.90, 50.0),
        Row("b", "mid", 0.85, 20.0, 0.85, 32.0),  # test cost runs over T = 30
    ]


def test_budget_table_chooses_on_validation_cost() -> None:
    lines = b.budget_table(_rows(), (10.0, 30.0, 60.0))
    assert lines[2] == "| a | 0.8000 @ 5.0 | 0.8000 @ 5.0 | 0.9000 @ 50.0 |"
    assert lines[3] == "| b | — | 0.8500 @ 32.0 | 0.8500 @ 32.0 |"


def test_where_each_loses_is_computed_from_the_picks() -> None:
    a, bb = b.where_each_loses(_rows(), (10.0, 30.0, 60.0))
    assert a.startswith("* **a**: cheapest validation point 5.0;")
    assert "at 1 of the 3 budgets it answers (T = 30); largest gap 5.00 points at T = 30" in a
    assert "most accurate (or tied) at T = 60" in a
    assert "the only method with a point at T = 10" in a
    assert "no point within T = 10" in bb
    assert "at 1 of the 2 budgets it answers (T = 60)" in bb
    assert "more than 5 % over T at T = 30" in bb and "over T" not in a


def test_dag_rows_report_costs_in_their_own_units() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 3))
    y = (X[:, 2] + 0.2 * rng.normal(size=600) > 0).astype(int)  # only the dear sensor helps
    split = Split(X[:300], y[:300], X[300:450], y[300:450], X[450:], y[450:])
    costs = np.asarray([1.0, 10.0, 100.0])
    rows, model = b.dag_rows(
        split, costs, (100.0, 0.0), refine=0, learner="linear", folds=2, n_subsets=None
    )
    free, priced_out = rows  # sorted by scale
    assert (free.setting, priced_out.setting) == ("λ=0", "λ=100")
    assert priced_out.test_cost == 0.0 and priced_out.val_cost == 0.0  # nothing worth its cost
    assert 100.0 <= free.test_cost <= 111.0  # Yahoo-like units, not the normalised ones
    assert free.test_score > 0.9 > priced_out.test_score
    assert len(model.states_) == 8  # exhaustive DAG over 3 single-feature sensors
