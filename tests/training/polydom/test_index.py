"""The Poly-Dom index sweep (Algorithm 3) against Index-All, Naive-Lookup and from-scratch
skylines (paper 002, Section 3.2)."""

from __future__ import annotations

import numpy as np
import pytest

from service.strategies.polydom_index import naive_lookup
from service.types import FloatArray
from training.polydom import build_index, index_all, index_all_size, skyline_at
from training.polydom.synthetic import random_costs

DOMAIN = (1.0, 1000.0)


def _random_candidates(k: int, degree: int, seed: int) -> tuple[FloatArray, FloatArray]:
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 1.0, k), random_costs(k, rng, degree)


def _check_structure(acc: FloatArray, costs: FloatArray, seed: int) -> None:
    idx = build_index(acc, costs, DOMAIN)
    full = index_all(acc, costs, DOMAIN)
    assert idx.compiled is not None and full.compiled is not None
    bps = np.asarray(idx.breakpoints)
    assert bps[0] == DOMAIN[0]
    assert np.all(np.diff(bps) > 0)
    assert np.all(np.diff(np.asarray(full.breakpoints)) > 0)
    for sk in idx.skylines:
        assert sk and np.all(np.diff(acc[sk]) > 0), "accuracy strictly rising"
    assert idx.size <= full.size
    assert index_all_size(acc, costs, DOMAIN) == (full.size, full.n_ranges)
    assert idx.n_ranges <= idx.interesting + 1 <= idx.visited + 1

    rng = np.random.default_rng(seed + 1000)
    # The stored skyline equals the from-scratch skyline at random sizes in every range.
    ends = [*idx.breakpoints[1:], DOMAIN[1]]
    for start, end, sk in zip(idx.breakpoints, ends, idx.skylines, strict=True):
        for n in rng.uniform(start, end, 3):
            assert sk == skyline_at(acc, costs, float(n))
            values = costs @ (float(n) ** np.arange(costs.shape[1]))
            assert np.all(np.diff(values[sk]) >= 0), "skyline cost-sorted at n"

    # Same accuracy from the index, Index-All and Naive-Lookup at random queries.
    for _ in range(1000):
        n = float(rng.uniform(*DOMAIN))
        top = float(np.max(costs @ (n ** np.arange(costs.shape[1]))))
        budget = float(rng.uniform(-0.05 * top, 1.05 * top))
        a = idx.compiled.lookup(n, budget)
        b = full.compiled.lookup(n, budget)
        c = naive_lookup(acc, costs, n, budget)
        if c is None:
            assert a is None and b is None
            continue
        assert a is not None and b is not None
        assert acc[a] == acc[b] == acc[c]
        values = costs @ (n ** np.arange(costs.shape[1]))
        assert values[a] <= budget


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("degree", [1, 2, 3])
def test_sweep_matches_index_all_and_naive(seed: int, degree: int) -> None:
    acc, costs = _random_candidates(40, degree, seed)
    _check_structure(acc, costs, seed)


def test_sweep_prunes_uninteresting_points() -> None:
    acc, costs = _random_candidates(80, 2, 7)
    idx = build_index(acc, costs, DOMAIN)
    full = index_all(acc, costs, DOMAIN)
    assert idx.visited == full.n_ranges - 1, "sweep visits every crossing once"
    assert idx.interesting < idx.visited
    assert idx.size < full.size


def test_coincident_curves_and_ties() -> None:
    rng = np.random.default_rng(11)
    base = random_costs(12, rng, 2)
    costs = np.vstack([base, base[:4], np.zeros((1, 3))])  # duplicates and a free curve
    acc = np.concatenate([rng.uniform(0.6, 0.9, 12), [0.95, 0.6, 0.75, 0.75], [0.55]])
    _check_structure(acc, costs, 11)


def test_concurrent_and_tangent_crossings() -> None:
    # Three lines through (500, 1000); a parabola tangent to one of them at n = 500.
    lines = np.array([[0.0, 2.0, 0.0], [500.0, 1.0, 0.0], [750.0, 0.5, 0.0], [1000.0, 0.0, 0.0]])
    k = 1e-3  # 1000 + (n - 500) + k (n - 500)^2 is tangent to line 1 at 500
    tangent = np.array([[500.0 + k * 250000.0, 1.0 - 1000.0 * k, k]])
    costs = np.vstack([lines, tangent, [[100.0, 0.0, 0.0]]])
    for acc in ([0.6, 0.7, 0.8, 0.9, 0.95, 0.55], [0.9, 0.8, 0.7, 0.6, 0.85, 0.5]):
        _check_structure(np.asarray(acc), costs, 3)


def test_single_candidate_and_constant_curves() -> None:
    idx = build_index([0.7], np.array([[3.0, 0.0, 0.0]]), DOMAIN)
    assert idx.breakpoints == [1.0] and idx.skylines == [[0]]
    assert idx.compiled is not None
    assert idx.compiled.lookup(10.0, 2.0) is None
    assert idx.compiled.lookup(10.0, 3.0) == 0
    costs = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    idx = build_index([0.9, 0.8, 0.95], costs, DOMAIN)
    assert idx.skylines == [[0, 2]] and idx.visited == 0


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="one row of coefficients per candidate"):
        build_index([0.5, 0.6], np.zeros((3, 2)), DOMAIN)
    with pytest.raises(ValueError, match="lo < hi"):
        build_index([0.5], np.zeros((1, 2)), (5.0, 5.0))
    with pytest.raises(ValueError, match="at least one"):
        build_index([], np.zeros((0, 2)), DOMAIN)


def _search(costs: FloatArray, skyline: list[int], n: float, budget: float) -> int | None:
    """Binary search of ``skyline`` at n over every curve, by plain Horner (the reference:
    the lookup before it learned to bracket)."""

    def cost(p: int) -> float:
        total = 0.0
        for c in reversed(costs[p].tolist()):
            total = total * n + c
        return total

    lo, hi = 0, len(skyline)
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(skyline[mid]) <= budget:
            lo = mid + 1
        else:
            hi = mid
    return skyline[lo - 1] if lo else None


@pytest.mark.parametrize(("degree", "shift"), [(2, 0.0), (3, 0.0), (5, 0.0), (2, -0.3)])
def test_bracketed_lookup_equals_a_full_search_at_the_edges(degree: int, shift: float) -> None:
    """The lookup skips the curves that the range's ends show fit (or do not); at the
    range ends themselves, at budgets equal to a curve's exact cost, past the domain and
    with a negative coefficient (no bracket then) it answers as searching every curve does."""
    rng = np.random.default_rng(7 + degree)
    acc, costs = _random_candidates(40, degree, 11 * degree)
    costs = costs + shift * np.eye(costs.shape[0], costs.shape[1])  # shift < 0: non-monotone
    idx = build_index(acc, costs, DOMAIN)
    assert idx.compiled is not None and idx.n_ranges > 1
    compiled = idx.compiled
    sizes = [*idx.breakpoints, DOMAIN[1], DOMAIN[1] * 1.5, *rng.uniform(*DOMAIN, 20).tolist()]
    for n in sizes:
        sky = compiled.skyline_at(n)
        exact = [float(costs[p] @ (n ** np.arange(costs.shape[1]))) for p in sky]
        budgets = [*exact, *(float(np.nextafter(e, -np.inf)) for e in exact), -1.0, 1e12]
        for budget in budgets:
            assert compiled.lookup(n, budget) == _search(costs, sky, n, budget), (n, budget)
