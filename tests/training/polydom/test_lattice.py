"""Poly-Dom end to end against the brute-force oracle over all 2^m feature sets
(paper 002, Sections 3.1-3.2: sandwich 3.3/3.11, covering 3.4, candidates 3.6/3.7)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from service.types import FloatArray
from training.polydom import PolyDom, expand_all, expand_polydom, set_costs
from training.polydom.synthetic import (
    SIZE_DOMAIN,
    combiner_accuracies,
    make_workload,
    perturb,
    random_costs,
    saturating_accuracies,
    single_accuracies,
)


def _table_evaluate(table: FloatArray) -> tuple[Callable[[int], float], list[int]]:
    calls: list[int] = []

    def evaluate(mask: int) -> float:
        calls.append(mask)
        return float(table[mask])

    return evaluate, calls


def _assert_oracle(
    model: PolyDom, table: FloatArray, costs: FloatArray, seed: int, queries: int = 1000
) -> float:
    """Every answer fits and is within ε of the best affordable set; returns the worst gap."""
    m = costs.shape[0]
    all_costs = set_costs(np.arange(1 << m), costs)
    rng = np.random.default_rng(seed)
    lo, hi = SIZE_DOMAIN
    ns = rng.uniform(lo, hi, queries)
    ns[:2] = (lo, hi)
    values = all_costs @ (ns[None, :] ** np.arange(costs.shape[1])[:, None])  # 2^m x Q
    budgets = rng.uniform(-0.02, 1.05, queries) * values.max(axis=0)
    affordable = values <= budgets[None, :]
    best = np.where(affordable, table[:, None], -np.inf).max(axis=0)
    worst = 0.0
    compiled = model.compiled_
    for q in range(queries):
        pos = compiled.lookup(float(ns[q]), float(budgets[q]))
        if pos is None:
            assert not affordable[:, q].any()
            continue
        mask = model.candidates_[pos]
        assert values[mask, q] <= budgets[q], "answer must be affordable"
        assert model.candidate_accuracies_[pos] == table[mask]
        gap = float(best[q] - table[mask])
        worst = max(worst, gap)
    assert worst <= float(model.epsilon) + 1e-12
    return worst


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("epsilon", [0.0, 0.01, 0.05])
def test_oracle_combiner_workload(seed: int, gamma: float, epsilon: float) -> None:
    w = make_workload(8 + seed, gamma, seed=100 * seed + int(10 * gamma))
    evaluate, calls = _table_evaluate(w.table)
    model = PolyDom(epsilon=epsilon).fit(evaluate, w.costs, SIZE_DOMAIN)
    assert len(calls) == len(set(calls)) == model.stats_.expansions
    assert set(model.candidates_) <= set(model.expanded_)
    _assert_oracle(model, w.table, w.costs, seed)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_oracle_saturating_family_cubic_costs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = 9
    costs = random_costs(m, rng, degree=3)
    table = saturating_accuracies(m, rng)
    model = PolyDom(epsilon=0.02).fit(lambda s: float(table[s]), costs, SIZE_DOMAIN)
    _assert_oracle(model, table, costs, seed)


@pytest.mark.parametrize("seed", [6, 7])
def test_oracle_relaxed_monotonicity(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m, delta = 9, 0.02
    costs = random_costs(m, rng)
    base = combiner_accuracies(single_accuracies(m, rng), gamma=0.3)
    table = perturb(base, delta, rng)
    subset_max = table.copy()  # check the violations really are <= delta (Axiom 3.10)
    for j in range(m):
        view = subset_max.reshape(-1, 2, 1 << j)
        np.maximum(view[:, 1, :], view[:, 0, :], out=view[:, 1, :])
    assert np.all(subset_max <= table + delta + 1e-12)
    assert np.any(subset_max > table + 1e-6), "the table must actually be non-monotone"
    model = PolyDom(epsilon=0.02, delta=delta).fit(lambda s: float(table[s]), costs, SIZE_DOMAIN)
    _assert_oracle(model, table, costs, seed)


def test_expansions_far_fewer_than_expand_all() -> None:
    ratios = []
    for seed in range(3):
        w = make_workload(10, 0.0, seed=seed)
        ours = expand_polydom(10, w.evaluate, 0.005)
        naive = expand_all(10, w.evaluate)
        assert naive.expansions == 1 << 10
        ratios.append(naive.expansions / ours.expansions)
        assert ours.closure_expansions <= ours.expansions
    print(f"Naive-Expand-All / Poly-Dom expansions at m=10, gamma=0: {ratios}")
    assert min(ratios) >= 5.0


def test_every_unexpanded_set_is_dominated_by_expanded_subset() -> None:
    for gamma in (0.0, 0.5, 1.0):
        w = make_workload(9, gamma, seed=21)
        res = expand_polydom(9, w.evaluate, 0.01, 0.0)
        exp = np.full(1 << 9, -np.inf)
        keys = np.fromiter(res.accuracies, dtype=np.int64)
        exp[keys] = w.table[keys]
        for j in range(9):  # best expanded subset of every mask
            view = exp.reshape(-1, 2, 1 << j)
            np.maximum(view[:, 1, :], view[:, 0, :], out=view[:, 1, :])
        assert np.all(w.table <= exp + 0.01 + 1e-12)


def test_single_feature() -> None:
    costs = np.array([[2.0, 0.1, 0.0]])
    table = np.array([0.5, 0.8])
    model = PolyDom(epsilon=0.0).fit(lambda s: float(table[s]), costs, SIZE_DOMAIN)
    assert model.stats_.expansions == 2
    assert sorted(model.candidates_) == [0, 1]
    assert model.lookup(10.0, 2.0) == 0
    assert model.lookup(10.0, 3.0) == 1
    assert model.lookup(10.0, -1.0) is None
    _assert_oracle(model, table, costs, 0)


def test_all_accuracies_equal() -> None:
    m = 7
    costs = random_costs(m, np.random.default_rng(0))
    table = np.full(1 << m, 0.7)
    evaluate, calls = _table_evaluate(table)
    model = PolyDom(epsilon=0.0).fit(evaluate, costs, SIZE_DOMAIN)
    assert sorted(calls) == [0, (1 << m) - 1]
    assert model.candidates_ == [0]
    _assert_oracle(model, table, costs, 1)


def test_zero_cost_feature_and_coincident_costs() -> None:
    rng = np.random.default_rng(5)
    costs = np.round(random_costs(6, rng) * 1000) / 1000
    costs[0] = 0.0  # a free feature
    costs[1] = costs[2]  # two features with the same cost curve
    costs[3] = costs[4] + costs[5]  # one feature costing exactly as much as two others
    for gamma in (0.0, 1.0):
        table = combiner_accuracies(single_accuracies(6, rng, 0.7), gamma)
        for eps in (0.0, 0.01):
            evaluate, _ = _table_evaluate(table)
            model = PolyDom(epsilon=eps).fit(evaluate, costs, SIZE_DOMAIN)
            _assert_oracle(model, table, costs, 2)


def test_closure_pass_is_reported() -> None:
    w = make_workload(8, 0.5, seed=3)
    res = expand_polydom(8, w.evaluate, 0.005)
    assert res.expansions == res.traversal_expansions + res.closure_expansions
    stats = PolyDom(epsilon=0.01).fit(w.evaluate, w.costs, SIZE_DOMAIN).stats_.as_dict()
    assert {"expansions", "closure_expansions", "candidates", "index_size", "ranges"} <= set(stats)


@pytest.mark.parametrize(
    ("kwargs", "args", "match"),
    [
        ({"epsilon": -0.1}, None, "epsilon=-0.1 was given; a value >= 0"),
        ({"epsilon": float("nan")}, None, "epsilon=nan was given; a finite number"),
        ({"epsilon": "0.1"}, None, "a finite number is required"),
        ({"delta": -1}, None, "delta=-1 was given"),
        ({}, {"costs": np.ones(3)}, "a 2-D"),
        ({}, {"costs": -np.ones((3, 2))}, "negative or non-finite"),
        ({}, {"costs": np.full((3, 2), np.inf)}, "negative or non-finite"),
        ({}, {"costs": np.ones((30, 2))}, "at most"),
        ({}, {"size_domain": (5.0, 1.0)}, "0 <= lo < hi"),
        ({}, {"size_domain": (-1.0, 1.0)}, "0 <= lo < hi"),
        ({}, {"size_domain": 3.0}, "a pair"),
        ({}, {"evaluate": 3}, "a callable"),
        ({}, {"evaluate": lambda s: float("nan")}, "a finite accuracy"),
    ],
)
def test_parameter_validation(
    kwargs: dict[str, object], args: dict[str, object] | None, match: str
) -> None:
    fit_args: dict[str, object] = {
        "evaluate": lambda s: 0.5,
        "costs": np.ones((3, 2)),
        "size_domain": (1.0, 10.0),
    }
    fit_args.update(args or {})
    with pytest.raises(ValueError, match=match):
        PolyDom(**kwargs).fit(**fit_args)  # type: ignore[arg-type]


def test_lookup_before_fit() -> None:
    with pytest.raises(RuntimeError, match="not fitted"):
        PolyDom().lookup(1.0, 1.0)


def test_closure_pass_completes_any_partial_traversal() -> None:
    from training.polydom.lattice import _Lattice, close_lattice

    w = make_workload(8, 0.5, seed=9)
    lat = _Lattice(8, w.evaluate)
    lat.expand(0)
    lat.expand(255)
    added = close_lattice(lat, 0.01, 0.0)
    assert added > 0 and len(lat.acc) == added + 2
    lat.refresh()
    assert lat.unsandwiched_unexpanded(0.01, 0.0).size == 0
    exp = np.full(256, -np.inf)
    keys = np.fromiter(lat.acc, dtype=np.int64)
    exp[keys] = w.table[keys]
    for j in range(8):
        view = exp.reshape(-1, 2, 1 << j)
        np.maximum(view[:, 1, :], view[:, 0, :], out=view[:, 1, :])
    assert np.all(w.table <= exp + 0.01 + 1e-12)


GRID_EPSILONS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1)


def _epsilon_sweep(m: int, gamma: float, seed: int) -> None:
    """Property 3.9 as counts: at every larger ε the fitted model expands no more sets,
    and every index answer stays within ε of brute force over all 2^m sets."""
    w = make_workload(m, gamma, seed=1000 * seed + m)
    counts: list[int] = []
    for epsilon in GRID_EPSILONS:
        evaluate, calls = _table_evaluate(w.table)
        model = PolyDom(epsilon=epsilon).fit(evaluate, w.costs, SIZE_DOMAIN)
        assert len(calls) == len(set(calls)) == model.stats_.expansions
        counts.append(model.stats_.expansions)
        _assert_oracle(model, w.table, w.costs, seed, queries=300)
    assert counts == sorted(counts, reverse=True), (
        f"expansions {counts} at epsilon {GRID_EPSILONS} (m={m}, gamma={gamma}, seed={seed})"
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("m", [8, 9, 10, 11, 12])
def test_expansions_non_increasing_in_epsilon(m: int, gamma: float, seed: int) -> None:
    _epsilon_sweep(m, gamma, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("gamma", [0.0, 1.0])
@pytest.mark.parametrize("m", [13, 14])
def test_expansions_non_increasing_in_epsilon_large(m: int, gamma: float, seed: int) -> None:
    _epsilon_sweep(m, gamma, seed)


def test_larger_epsilon_expands_a_subset_when_accuracies_are_distinct() -> None:
    """With γ = 1 every feature adds accuracy (no ties), and the sets expanded at a larger ε
    are a subset of those at a smaller one (the paper's Property 3.9 as stated). With ties
    (γ = 0, a set's accuracy is its best feature's) only the counts are monotone."""
    for m, seed in ((9, 0), (10, 1), (11, 2)):
        w = make_workload(m, 1.0, seed=1000 * seed + m)
        expanded = [set(expand_polydom(m, w.evaluate, e / 2).accuracies) for e in GRID_EPSILONS]
        for larger, smaller in zip(expanded[1:], expanded[:-1], strict=True):
            assert larger <= smaller


def test_ties_are_crossed_in_one_round() -> None:
    """γ = 0: a(F) is F's best feature's accuracy. The sets "all but the k best features"
    bound everything below them; reaching them through exact ties keeps the search near
    2m + 1 expansions (paper: ~30-50 at m = 10), far below 2^m / 10."""
    for seed in range(3):
        w = make_workload(10, 0.0, seed=seed)
        for epsilon in (0.0, 0.005, 0.01):
            res = expand_polydom(10, w.evaluate, epsilon)
            assert res.expansions <= (1 << 10) // 10, (seed, epsilon, res.expansions)
