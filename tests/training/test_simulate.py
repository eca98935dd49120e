"""The synthetic-workload simulator (training/simulate.py) and what it shows of the runtimes:
exact costs never overrun, anytime strategies overrun by at most one extraction's
misprediction, static Poly-Dom meets the paper's ε guarantee, anytime Poly-Dom never loses
to static Poly-Dom when costs are exactly as planned."""

from __future__ import annotations

import numpy as np
import pytest

from service.execution import StrategyFault
from service.strategies.base import Acquire, Answer, Observation
from tests.support.scripted_strategy import ScriptedRuntime
from training.simulate import (
    ANYTIME,
    STRATEGIES,
    SimBundle,
    simulate,
    sweep,
    synthetic_bundle,
)

CONFIGS = [(10, 0.0, 11), (10, 0.5, 12), (10, 1.0, 13), (8, 1.0, 14)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"m{c[0]}-g{c[1]:g}-s{c[2]}")
def exact(request: pytest.FixtureRequest) -> SimBundle:
    m, gamma, seed = request.param
    return synthetic_bundle(m, gamma, seed, sigma=0.0)


@pytest.fixture(scope="module", params=CONFIGS[:3], ids=lambda c: f"m{c[0]}-g{c[1]:g}")
def noisy(request: pytest.FixtureRequest) -> SimBundle:
    m, gamma, seed = request.param
    return synthetic_bundle(m, gamma, seed, sigma=0.5)


def _queries(bundle: SimBundle, count: int, seed: int) -> list[tuple[int, float]]:
    """Random sizes over the domain and budgets from nothing to above the full set's cost
    (generic budgets: none sits exactly on a set's cost)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 1001))
        full = sum(bundle.p95_at(n).values())
        out.append((n, float(rng.uniform(0.0, 1.1 * full))))
    return out


def _candidate_best(bundle: SimBundle, n: int, budget: float) -> float:
    """Naive-Lookup over the candidates with the shipped costs (chance if none fits)."""
    rt = bundle.runtimes["polydom"]
    per = bundle.p95_at(n)
    fits = [
        rt.accuracy[c]
        for c in bundle.manifest.polydom().candidates
        if sum(per[f] for f in rt.model_features[c]) <= budget
    ]
    return max(fits, default=rt.accuracy["prior"])


def test_manifest_holds_every_answerable_model(exact: SimBundle) -> None:
    ids = {m.id for m in exact.manifest.models}
    for name in STRATEGIES:
        rt = exact.runtimes[name]
        assert set(rt.answerable()) <= ids
        for model in rt.answerable():
            mask = sum(1 << exact.names.index(f) for f in rt.model_features[model])
            assert rt.accuracy[model] == exact.table[mask], "accuracies come from the oracle"
    # The shipped curves are the medians when there is no spread.
    assert np.array_equal(exact.p95_costs, exact.median_costs)


def test_p95_curves_scale_the_medians() -> None:
    bundle = synthetic_bundle(6, 1.0, 3, sigma=0.5)
    factor = np.exp(1.645 * 0.5)
    np.testing.assert_allclose(bundle.p95_costs, bundle.median_costs * factor)
    p95, med = bundle.p95_at(400), bundle.median_at(400)
    for f in bundle.names:
        assert p95[f] == pytest.approx(med[f] * factor)
    # Log-normal noise around the median: about 5% of extractions exceed the p95 cost.
    rng = np.random.default_rng(0)
    draws = rng.lognormal(0.0, 0.5, 20_000)
    assert np.mean(draws > factor) == pytest.approx(0.05, abs=0.006)


@pytest.mark.parametrize("name", STRATEGIES)
def test_exact_costs_fit_the_budget_with_extracted_features(exact: SimBundle, name: str) -> None:
    runtime = exact.runtimes[name]
    rng = np.random.default_rng(0)
    for n, budget in _queries(exact, 300, seed=1):
        r = simulate(runtime, exact.median_costs, n, budget, rng, sigma=0.0)
        assert not r.over_budget and r.spent <= budget, (n, budget, r)
        assert not r.stopped_early
        assert set(runtime.model_features[r.answer]) <= set(r.extracted), r
        assert r.accuracy == runtime.accuracy[r.answer]


@pytest.mark.parametrize("name", ANYTIME)
def test_anytime_strategies_overrun_by_at_most_one_misprediction(
    noisy: SimBundle, name: str
) -> None:
    runtime = noisy.runtimes[name]
    rng = np.random.default_rng(7)
    overruns = 0
    for n, budget in _queries(noisy, 600, seed=2):
        r = simulate(runtime, noisy.median_costs, n, budget, rng, sigma=0.5)
        predicted = noisy.p95_at(n)
        worst = max((c - predicted[f] for f, c in r.extracted.items()), default=0.0)
        assert r.spent <= budget + max(worst, 0.0) + 1e-9, (n, budget, r)
        assert set(runtime.model_features[r.answer]) <= set(r.extracted), r
        overruns += r.over_budget
    assert overruns < 0.1 * 600, "p95 provisioning keeps overruns rare"


def test_static_polydom_is_the_best_candidate_within_epsilon(exact: SimBundle) -> None:
    runtime = exact.runtimes["polydom"]
    rng = np.random.default_rng(0)
    for n, budget in _queries(exact, 400, seed=3):
        r = simulate(runtime, exact.median_costs, n, budget, rng, sigma=0.0)
        assert r.accuracy == _candidate_best(exact, n, budget), (n, budget, r)
        assert r.accuracy >= exact.optimum(n, budget) - exact.epsilon - 1e-12, (n, budget, r)


def test_anytime_polydom_is_at_least_static_with_exact_costs(exact: SimBundle) -> None:
    static, anytime = exact.runtimes["polydom"], exact.runtimes["polydom-anytime"]
    rng = np.random.default_rng(0)
    for n, budget in _queries(exact, 400, seed=4):
        s = simulate(static, exact.median_costs, n, budget, rng, sigma=0.0)
        a = simulate(anytime, exact.median_costs, n, budget, rng, sigma=0.0)
        assert a.accuracy >= s.accuracy, (n, budget, s, a)
        assert a.accuracy >= exact.optimum(n, budget) - exact.epsilon - 1e-12


def test_anytime_polydom_is_at_least_static_at_exact_set_costs() -> None:
    bundle = synthetic_bundle(8, 0.5, 0, sigma=0.0)
    static, anytime = bundle.runtimes["polydom"], bundle.runtimes["polydom-anytime"]
    rng = np.random.default_rng(0)
    for n in range(1, 1001, 50):
        per = bundle.p95_at(n)
        for c in bundle.manifest.polydom().candidates:
            budget = sum(per[f] for f in static.model_features[c])
            s = simulate(static, bundle.median_costs, n, budget, rng, sigma=0.0)
            a = simulate(anytime, bundle.median_costs, n, budget, rng, sigma=0.0)
            assert a.accuracy >= s.accuracy, (n, budget, c, s, a)


def test_anytime_polydom_upgrades_when_extractions_run_fast() -> None:
    # Costs at their median, plans at p95: anytime Poly-Dom spends the slack on upgrades.
    bundle = synthetic_bundle(10, 1.0, 13, sigma=0.5)
    queries = _queries(bundle, 200, seed=5)
    rng = np.random.default_rng(0)
    gains = []
    for n, budget in queries:
        s = simulate(bundle.runtimes["polydom"], bundle.median_costs, n, budget, rng, 0.5)
        a = simulate(bundle.runtimes["polydom-anytime"], bundle.median_costs, n, budget, rng, 0.5)
        gains.append(a.accuracy - s.accuracy)
    assert np.mean(gains) > 0


def test_sweep_aggregates_cells() -> None:
    bundle = synthetic_bundle(6, 1.0, 3, sigma=0.5)
    cells = sweep(bundle, [100, 500], [100.0, 1000.0, 5000.0], 20, seed=1)
    assert len(cells) == len(STRATEGIES) * 2 * 3
    for cell in cells:
        assert cell.requests == 20
        assert 0.5 <= cell.accuracy <= 1.0
        assert 0.0 <= cell.overrun_rate <= 1.0
    again = sweep(bundle, [500], [1000.0], 20, seed=1, strategies=["greedy"])
    first = next(c for c in cells if c.strategy == "greedy" and c.n == 500 and c.budget == 1000)
    assert again[0] == first, "a cell's numbers do not depend on the other cells run"
    exact = synthetic_bundle(6, 1.0, 3, sigma=0.0)
    assert all(
        c.requests == 1 and c.overrun_rate == 0 for c in sweep(exact, [500], [100.0, 1000.0], 20)
    )


# -- the simulator runs the service's loop, contract checks included -------------------------


def test_a_strategy_acquiring_twice_is_stopped_before_a_second_draw() -> None:
    bundle = synthetic_bundle(6, 1.0, 3, sigma=0.5)
    runtime = ScriptedRuntime(bundle.runtimes["greedy"], lambda obs, i: Acquire("f02"))
    rng, twin = np.random.default_rng(9), np.random.default_rng(9)
    with pytest.raises(StrategyFault, match=r"'f02', which it already has"):
        simulate(runtime, bundle.median_costs, 500, 1e9, rng, sigma=0.5)
    assert len(runtime.steps) == 2
    twin.lognormal(0.0, 0.5)
    assert rng.random() == twin.random(), "one extraction drew its cost, the repeat none"


def test_a_strategy_that_never_answers_is_stopped_within_one_step_per_feature() -> None:
    bundle = synthetic_bundle(6, 1.0, 3, sigma=0.0)
    names = bundle.names
    runtime = ScriptedRuntime(
        bundle.runtimes["greedy"], lambda obs, i: Acquire(names[i % len(names)])
    )
    with pytest.raises(StrategyFault):
        simulate(runtime, bundle.median_costs, 500, 1e12, np.random.default_rng(0), 0.0)
    assert len(runtime.steps) == len(names) + 1
    assert sorted(runtime.steps[-1].features) == names
    # A feature the workload has no cost for is a contract breach too, not a KeyError.
    stray = ScriptedRuntime(bundle.runtimes["greedy"], lambda obs, i: Acquire("f99"))
    with pytest.raises(StrategyFault, match="'f99', which is not one of the features"):
        simulate(stray, bundle.median_costs, 500, 1e12, np.random.default_rng(0), 0.0)


def test_a_well_behaved_script_is_charged_its_median_costs() -> None:
    bundle = synthetic_bundle(6, 1.0, 3, sigma=0.0)
    order = ["f03", "f00"]
    greedy = bundle.runtimes["greedy"]

    def script(obs: Observation, i: int) -> Acquire | Answer:
        return (
            Acquire(order[i])
            if i < len(order)
            else Answer(greedy.best_computable(set(obs.features)))
        )

    runtime = ScriptedRuntime(greedy, script)
    median = bundle.median_at(500)
    r = simulate(runtime, bundle.median_costs, 500, 1e12, np.random.default_rng(0), 0.0)
    assert r.extracted == {f: median[f] for f in order}
    assert r.spent == median["f03"] + median["f00"]
    assert [obs.spent for obs in runtime.steps] == [0.0, median["f03"], r.spent]
    assert set(greedy.model_features[r.answer]) <= set(order)
