"""Poly-Dom on the real digits lattice against the brute-force oracle (all 2^7 sets).

Real accuracies are not exactly monotone; the guarantee holds for δ >= the largest
violation, which the test measures from the full lattice and passes to Poly-Dom.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.bundle import read_manifest
from service.strategies.polydom_index import poly_eval
from training.bundles.digits import LatticeEvaluator, digits_features, make_extractors
from training.polydom import PolyDom


def _max_violation(acc: dict[int, float]) -> float:
    worst = 0.0
    for sub, a_sub in acc.items():
        for sup, a_sup in acc.items():
            if sub != sup and sub & sup == sub:
                worst = max(worst, a_sub - a_sup)
    return worst


@pytest.fixture(scope="module")
def lattice(digits_bundle_dir: Path) -> tuple[LatticeEvaluator, np.ndarray, tuple[float, float]]:
    manifest = read_manifest(digits_bundle_dir)
    extractors = make_extractors([e.name for e in manifest.extractors])
    data = digits_features(extractors, (16, 24, 32), seed=3, limit=900)
    evaluator = LatticeEvaluator(data)
    m = len(extractors)
    for mask in range(1 << m):
        evaluator(mask)
    width = max(len(e.cost.coefficients) for e in manifest.extractors)
    costs = np.zeros((m, width))
    for i, e in enumerate(manifest.extractors):
        costs[i, : len(e.cost.coefficients)] = e.cost.coefficients
    return evaluator, costs, manifest.polydom().size_domain


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [0.0, 0.02, 0.05])
def test_digits_index_within_epsilon_of_brute_force(
    lattice: tuple[LatticeEvaluator, np.ndarray, tuple[float, float]], epsilon: float
) -> None:
    evaluator, costs, (lo, hi) = lattice
    acc = dict(evaluator.accuracy)
    m = costs.shape[0]
    delta = _max_violation(acc)
    called: set[int] = set()

    def evaluate(mask: int) -> float:
        called.add(mask)
        return acc[mask]

    model = PolyDom(epsilon=epsilon, delta=delta).fit(evaluate, costs, (lo, hi))
    masks = np.arange(1 << m)
    member = (masks[:, None] >> np.arange(m)[None, :]) & 1
    all_costs = member @ costs
    all_acc = np.array([acc[int(k)] for k in masks])

    rng = np.random.default_rng(7)
    sizes = np.exp(rng.uniform(np.log(lo), np.log(hi), 1000))
    for n in sizes:
        c = poly_eval(all_costs, float(n))
        budget = float(rng.uniform(0.0, 1.1 * np.max(c)))
        best = float(np.max(all_acc[np.asarray(c) <= budget]))
        got = model.lookup(float(n), budget)
        assert got is not None
        assert poly_eval(costs[(got >> np.arange(m)) & 1 == 1].sum(axis=0), float(n)) <= budget
        assert acc[got] >= best - epsilon - 1e-12, (n, budget, acc[got], best)
    assert len(called) == model.stats_.expansions
    if epsilon >= 0.05:
        assert len(called) < (1 << m) // 2, "with ε = 0.05 Poly-Dom must prune the lattice"
    print(
        f"digits eps={epsilon} delta={delta:.4f}: {len(called)} of {1 << m} sets expanded "
        f"({(1 << m) / len(called):.2f}x fewer), {len(model.candidates_)} candidates"
    )


def test_shipped_digits_index_is_within_epsilon_of_its_expanded_sets(
    digits_bundle_dir: Path,
) -> None:
    """The committed index, replayed against brute force over every set its build expanded
    (unexpanded sets are covered by the lattice guarantee tested above)."""
    from service.registry import load_bundle

    bundle = load_bundle(digits_bundle_dir, max_pixels=1 << 24)
    manifest = bundle.manifest
    expanded: dict[str, float] = manifest.provenance.parameters["expanded_accuracies"]
    costs = {e.name: e.cost for e in manifest.extractors}
    lo, hi = manifest.polydom().size_domain
    epsilon = manifest.polydom().epsilon
    runtime = bundle.runtimes["polydom"]
    rng = np.random.default_rng(11)
    for _ in range(1000):
        n = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        set_cost = {
            sid: sum(costs[f](n) for f in (sid.split("+") if sid != "prior" else []))
            for sid in expanded
        }
        budget = float(rng.uniform(0.0, 1.1 * max(set_cost.values())))
        best = max(a for sid, a in expanded.items() if set_cost[sid] <= budget)
        chosen, planned = runtime.plan(  # type: ignore[attr-defined]
            int(n), budget, frozenset(), bundle.costs.at(int(n))
        )
        assert planned <= budget + 1e-9
        assert manifest.model(chosen).accuracy >= best - epsilon - 1e-12, (n, budget, chosen)
