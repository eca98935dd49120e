"""The Greedy family (paper 002, Algorithm 4) against a naive greedy over full accuracy tables."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from service.types import FloatArray
from training.greedy import (
    VARIANTS,
    GreedySequences,
    default_lambdas,
    greedy,
    greedy_acc,
    greedy_cost,
)
from training.polydom.synthetic import (
    SIZE_DOMAIN,
    SyntheticWorkload,
    make_workload,
    random_costs,
    saturating_accuracies,
)

INF = math.inf


def _counting(table: FloatArray) -> tuple[Callable[[int], float], list[int]]:
    calls: list[int] = []

    def evaluate(mask: int) -> float:
        calls.append(mask)
        return float(table[mask])

    return evaluate, calls


def _cost_at(row: FloatArray, n: float) -> float:
    value = 0.0
    for a in reversed(row.tolist()):
        value = value * n + a
    return value


def _naive_order(table: FloatArray, costs: FloatArray, ref: float, lam: float) -> list[int]:
    """Deliberately plain greedy: every remaining feature's gain read off the full table."""
    m = costs.shape[0]
    c = [_cost_at(costs[j], ref) for j in range(m)]
    chosen: list[int] = []
    mask = 0
    for _ in range(m):
        best = -1
        best_acc_gain = 0.0
        best_score = 0.0
        for j in range(m):
            if mask >> j & 1:
                continue
            acc_gain = float(table[mask | 1 << j]) - float(table[mask])
            if lam == INF:
                better = (
                    best < 0 or c[j] < c[best] or (c[j] == c[best] and acc_gain > best_acc_gain)
                )
            else:
                score = acc_gain - lam * c[j]
                better = best < 0 or score > best_score or (score == best_score and c[j] < c[best])
            if better:
                best, best_acc_gain = j, acc_gain
                best_score = acc_gain - lam * c[j] if lam != INF else 0.0
        chosen.append(best)
        mask |= 1 << best
    return chosen


def _workloads() -> list[tuple[str, SyntheticWorkload]]:
    out = []
    for m in (1, 2, 5, 8):
        for gamma in (0.0, 1.0):
            for seed in range(3):
                out.append((f"m{m}-g{gamma}-s{seed}", make_workload(m, gamma, 100 * m + seed)))
    rng = np.random.default_rng(7)
    table = saturating_accuracies(7, rng)
    out.append(("saturating", SyntheticWorkload(random_costs(7, rng), table[:0], 0.0, table)))
    # Exact cost ties (duplicated rows) and γ = 0 (many zero gains) exercise the tie-breaks.
    tied = make_workload(6, 0.0, 3)
    dup = tied.costs.copy()
    dup[[1, 3, 4]] = dup[0]
    out.append(("ties", SyntheticWorkload(dup, tied.single, 0.0, tied.table)))
    return out


WORKLOADS = _workloads()


@pytest.mark.parametrize("reference_size", [None, 1.0, 500.0])
@pytest.mark.parametrize(("name", "w"), WORKLOADS, ids=[n for n, _ in WORKLOADS])
def test_orders_match_naive_greedy(
    name: str, w: SyntheticWorkload, reference_size: float | None
) -> None:
    evaluate, calls = _counting(w.table)
    model = GreedySequences(reference_size=reference_size).fit(evaluate, w.costs, SIZE_DOMAIN)
    ref = model.reference_size_
    if reference_size is None:
        assert ref == pytest.approx(math.sqrt(SIZE_DOMAIN[0] * SIZE_DOMAIN[1]))
    assert model.lambdas_[0] == 0.0 and model.lambdas_[-1] == INF
    assert model.lambdas_ == sorted(model.lambdas_)
    by_lambda = {lam: seq.order for seq in model.sequences_ for lam in seq.lambdas}
    assert sorted(by_lambda) == model.lambdas_
    for lam in model.lambdas_:
        assert by_lambda[lam] == _naive_order(w.table, w.costs, ref, lam), lam
    # An explicit grid with a few hand-picked λ gives the same orders too.
    extra = [0.0, 1e-6, 1e-4, 1e-3, 0.05, 3.0, INF]
    other = GreedySequences(lambdas=extra, reference_size=ref).fit(w.evaluate, w.costs, SIZE_DOMAIN)
    for seq in other.sequences_:
        for lam in seq.lambdas:
            assert seq.order == _naive_order(w.table, w.costs, ref, lam), lam
    # Memoised: every mask evaluated once.
    assert len(calls) == len(set(calls)) == len(model.expanded_)


@pytest.mark.parametrize(("name", "w"), WORKLOADS, ids=[n for n, _ in WORKLOADS])
def test_sequences_expansions_and_prefixes(name: str, w: SyntheticWorkload) -> None:
    m = w.m
    model = greedy().fit(w.evaluate, w.costs, SIZE_DOMAIN)
    orders = [tuple(s.order) for s in model.sequences_]
    assert len(set(orders)) == len(orders), "sequences must be deduplicated"
    mins = [min(s.lambdas) for s in model.sequences_]
    assert mins == sorted(mins)
    assert model.stats_.sequences == len(model.sequences_)
    assert model.stats_.lambdas == len(model.lambdas_)
    assert model.stats_.expansions == len(model.expanded_)
    assert model.stats_.expansions <= m * (m + 1) // 2 * len(model.sequences_) + 1
    for seq in model.sequences_:
        assert seq.lambdas == sorted(seq.lambdas)
        assert sorted(seq.order) == list(range(m))
        assert len(seq.prefix_masks) == len(seq.prefix_accuracies) == m + 1
        assert seq.prefix_masks[0] == 0 and seq.prefix_masks[-1] == (1 << m) - 1
        assert seq.prefix_costs.shape == (m + 1, w.costs.shape[1])
        for k, mask in enumerate(seq.prefix_masks):
            if k:
                assert mask == seq.prefix_masks[k - 1] | 1 << seq.order[k - 1]
            assert seq.prefix_accuracies[k] == w.evaluate(mask) == model.expanded_[mask]
            members = [j for j in range(m) if mask >> j & 1]
            want = w.costs[members].sum(axis=0)
            np.testing.assert_allclose(seq.prefix_costs[k], want, rtol=1e-12, atol=0)
    assert set(model.expanded_) >= {mk for s in model.sequences_ for mk in s.prefix_masks}


@pytest.mark.parametrize(("name", "w"), WORKLOADS, ids=[n for n, _ in WORKLOADS])
def test_variants(name: str, w: SyntheticWorkload) -> None:
    acc = greedy_acc().fit(w.evaluate, w.costs, SIZE_DOMAIN)
    cost = greedy_cost().fit(w.evaluate, w.costs, SIZE_DOMAIN)
    assert acc.lambdas_ == [0.0] and cost.lambdas_ == [INF]
    assert len(acc.sequences_) == len(cost.sequences_) == 1
    ref = acc.reference_size_
    c = np.array([_cost_at(w.costs[j], ref) for j in range(w.m)])
    np.testing.assert_array_equal(acc.feature_costs_, c)
    gains = w.table[1 << np.arange(w.m)]
    first = acc.sequences_[0].order[0]
    assert gains[first] == gains.max()
    assert c[first] == c[gains == gains.max()].min()
    order = cost.sequences_[0].order
    assert c[order[0]] == c.min()
    assert gains[order[0]] == gains[c == c.min()].max()
    assert all(c[a] <= c[b] for a, b in itertools.pairwise(order))
    # Without cost ties Greedy-Cost expands only its own prefixes.
    if len(set(c.tolist())) == w.m:
        assert cost.stats_.expansions == w.m + 1
    assert set(VARIANTS) == {"greedy", "greedy-acc", "greedy-cost"}
    assert VARIANTS["greedy-cost"]().lambdas == [INF]


@pytest.mark.parametrize(("name", "w"), WORKLOADS, ids=[n for n, _ in WORKLOADS])
def test_skyline_and_choose_match_brute_force(name: str, w: SyntheticWorkload) -> None:
    model = greedy().fit(w.evaluate, w.costs, SIZE_DOMAIN)
    pairs = [
        (seq.prefix_ref_costs[k], seq.prefix_accuracies[k], s, k)
        for s, seq in enumerate(model.sequences_)
        for k in range(w.m + 1)
    ]
    for seq in model.sequences_:
        for k in range(w.m + 1):
            assert seq.prefix_ref_costs[k] == _cost_at(seq.prefix_costs[k], model.reference_size_)
            assert seq.cost_at(k, 37.0) == _cost_at(seq.prefix_costs[k], 37.0)
    sky = model.skyline_
    costs = model.skyline_costs_
    accs = model.skyline_accuracies_
    assert costs == sorted(costs)
    assert all(a < b for a, b in itertools.pairwise(accs))
    assert [model.sequences_[s].prefix_ref_costs[k] for s, k in sky] == costs
    assert model.stats_.skyline_size == len(sky)
    # Skyline property: best accuracy affordable at any cost threshold is on the skyline.
    for c, _, _, _ in pairs:
        best_all = max(a for cc, a, _, _ in pairs if cc <= c)
        best_sky = max(a for cc, a in zip(costs, accs, strict=True) if cc <= c)
        assert best_sky == best_all

    rng = np.random.default_rng(len(name))
    top = max(p[0] for p in pairs)
    budgets = [-1.0, 0.0, *rng.uniform(0.0, 1.2 * top, 60).tolist(), *costs, INF]
    sizes = [SIZE_DOMAIN[0], model.reference_size_, SIZE_DOMAIN[1], 3000.0]
    for budget in budgets:
        affordable = [p for p in pairs if p[0] <= budget]
        if affordable:
            best_acc = max(p[1] for p in affordable)
            target = min(p[0] for p in affordable if p[1] == best_acc)
        else:
            target = min(p[0] for p in pairs)
            best_acc = max(p[1] for p in pairs if p[0] == target)
        for n in sizes:
            s, k = model.choose(n, budget)
            seq = model.sequences_[s]
            # The chosen sequence holds a skyline pick for this budget at the reference size.
            assert any(
                seq.prefix_ref_costs[i] == target and seq.prefix_accuracies[i] == best_acc
                for i in range(w.m + 1)
            )
            fits = [i for i in range(w.m + 1) if _cost_at(seq.prefix_costs[i], n) <= budget]
            assert k == (max(fits) if fits else 0)
            assert model.lookup(n, budget) == seq.prefix_masks[k]
            if n == model.reference_size_ and affordable:
                assert seq.prefix_accuracies[k] >= best_acc


def test_default_lambdas_scale() -> None:
    grid = default_lambdas([10.0, 1000.0, 0.0, 100.0])
    assert grid[0] == 0.0 and grid[-1] == INF
    assert grid[1] == pytest.approx(1e-3 / 100.0) and grid[-2] == pytest.approx(1e3 / 100.0)
    assert grid == sorted(grid)
    assert default_lambdas([0.0, 0.0])[1] == pytest.approx(1e-3)


def test_parameter_validation() -> None:
    w = make_workload(3, 1.0, 0)

    def fit(model: GreedySequences, costs: object = None, domain: object = SIZE_DOMAIN) -> None:
        model.fit(w.evaluate, w.costs if costs is None else costs, domain)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"lambdas contains -0\.5; every λ must be .*>= 0"):
        fit(GreedySequences(lambdas=[0.0, -0.5]))
    with pytest.raises(ValueError, match="lambdas contains nan"):
        fit(GreedySequences(lambdas=[math.nan]))
    with pytest.raises(ValueError, match="at least one"):
        fit(GreedySequences(lambdas=[]))
    with pytest.raises(ValueError, match="a sequence of numbers"):
        fit(GreedySequences(lambdas=0.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"size_domain=\(5, 1\); finite 0 <= lo < hi"):
        fit(GreedySequences(), domain=(5, 1))
    with pytest.raises(ValueError, match="a pair"):
        fit(GreedySequences(), domain="big")
    with pytest.raises(ValueError, match=r"costs has shape \(3,\); a 2-D"):
        fit(GreedySequences(), costs=np.ones(3))
    with pytest.raises(ValueError, match="negative or non-finite"):
        fit(GreedySequences(), costs=-np.ones((3, 2)))
    with pytest.raises(ValueError, match="outside size_domain"):
        fit(GreedySequences(reference_size=5000.0))
    with pytest.raises(ValueError, match="a callable"):
        GreedySequences().fit(None, w.costs, SIZE_DOMAIN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a finite accuracy"):
        GreedySequences().fit(lambda mask: math.nan, w.costs, SIZE_DOMAIN)
    with pytest.raises(RuntimeError, match="not fitted"):
        GreedySequences().choose(10.0, 100.0)
    model = greedy_acc().fit(w.evaluate, w.costs, SIZE_DOMAIN)
    with pytest.raises(ValueError, match=r"n=-1\.0"):
        model.choose(-1.0, 100.0)
    with pytest.raises(ValueError, match="budget=nan"):
        model.choose(1.0, math.nan)
    assert GreedySequences(lambdas=[0.0]).get_params() == {
        "lambdas": [0.0],
        "reference_size": None,
    }
    # lo == 0: the geometric mean would be 0, so the midpoint is used.
    assert greedy_acc().fit(w.evaluate, w.costs, (0.0, 10.0)).reference_size_ == 5.0
