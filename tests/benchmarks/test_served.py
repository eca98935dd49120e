"""The served benchmarks' verdicts (benchmarks/served.py) on hand-made answers: the paired
interval, the fixed-subset rule and the goal's wording, which the reports quote."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from benchmarks import served


@dataclass
class _Fit:
    sensors: tuple[str, ...]
    cost: float
    val_accuracy: float


def test_the_best_fixed_subset_is_the_runtimes_rule() -> None:
    fits = [_Fit((), 0.0, 0.5), _Fit(("a",), 1.0, 0.7), _Fit(("a", "b"), 2.0, 0.7)]
    assert served.best_fixed(fits, 0.5).sensors == ()
    assert served.best_fixed(fits, 1.0).sensors == ("a",)
    assert served.best_fixed(fits, 5.0).sensors == ("a",), "equal accuracy: the cheaper"


def test_paired_interval() -> None:
    a = np.array([True] * 60 + [False] * 40)
    b = np.array([True] * 50 + [False] * 50)
    d, lo, hi = served.diff_interval(a, b)
    assert d == pytest.approx(0.10)
    assert lo > 0 and hi == pytest.approx(2 * d - lo)
    assert served.diff_interval(a, a) == (0.0, 0.0, 0.0)


def _served(diffs: dict[float, int], kinds: dict[float, str]) -> served.Served:
    task = served.Task(
        "t", "t", np.zeros((1, 1)), np.zeros(1), ["c"], {"s": ["c"]}, {"s": 4.0}, list(diffs)
    )
    res = served.Served("m", task)
    for budget, extra in diffs.items():
        base = np.array([True] * 500 + [False] * 500)
        mine = base.copy()
        if extra > 0:
            mine[500 : 500 + extra] = True
        else:
            mine[:-extra] = False
        res.right[budget], res.fixed_right[budget] = mine, base
        res.kinds[budget] = [kinds[budget]] * 1000
    return res


def test_the_goal_is_missed_by_a_loss_beyond_half_a_point_and_says_where() -> None:
    res = _served({1.0: 0, 2.0: 20, 4.0: -8}, {1.0: "fixed", 2.0: "dag", 4.0: "dag"})
    v = served.verdict(res, [1.0, 2.0])
    assert not v["within"] and v["losses"] == [4.0] and v["better"] == [2.0]
    assert v["adaptive"] == [2.0, 4.0] and v["wins"] == [2.0]
    line = served.summary_line(res, [1.0, 2.0])
    assert "**missed** (worst -0.80 points at 4" in line
    assert "adaptive points served at 2 of 3 budgets, ahead of the best fixed subset at 1" in line
    assert "**where we lose**" in line


def test_the_goal_is_met_within_half_a_point() -> None:
    res = _served({1.0: -4, 2.0: 30, 4.0: 0}, {1.0: "dag", 2.0: "dag", 4.0: "fixed"})
    v = served.verdict(res, [1.0, 2.0])
    assert v["within"] and v["clearly"] == [2.0]
    assert res.points == {} and Counter(res.kinds[4.0]) == {"fixed": 1000}


def test_the_best_fixed_mixture_is_the_hull_of_the_fixed_subsets_at_the_mean_budget() -> None:
    # brute force: every share of every pair whose average cost is the budget
    fits = [_Fit((), 0.0, 0.5), _Fit(("a",), 1.0, 0.6), _Fit(("a", "b"), 3.0, 0.9)]
    for budget in (0.5, 1.0, 2.0, 2.5, 3.0, 4.0):
        lo, hi, p = served.best_mixture(fits, budget)
        value = p * lo.val_accuracy + (1 - p) * hi.val_accuracy
        assert p * lo.cost + (1 - p) * hi.cost <= budget + 1e-9
        best = max(
            [f.val_accuracy for f in fits if f.cost <= budget]
            + [
                q * a.val_accuracy + (1 - q) * b.val_accuracy
                for a in fits
                for b in fits
                if a.cost <= budget < b.cost
                for q in [(b.cost - budget) / (b.cost - a.cost)]
            ]
        )
        assert value == pytest.approx(best), budget
    lo, hi, p = served.best_mixture(fits, 2.0)
    # the hull skips {a}: the prior and {a,b} mixed beat it at 2
    assert lo.sensors == () and hi.sensors == ("a", "b") and p == pytest.approx(1 / 3)
    assert served.best_mixture(fits, 4.0) == (fits[2], fits[2], 1.0), "above every cost: one subset"
