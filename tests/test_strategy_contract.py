"""The contract every strategy runtime honours, run against every strategy of every bundle.

Later strategies (DAG, gating, trees) join by registering a runtime and shipping a bundle;
this suite then covers them unchanged.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from service.registry import Bundle, load_bundle
from service.strategies.base import Acquire, Answer, Observation, StrategyRuntime
from service.strategies.polydom import PolyDomRuntime
from service.strategies.polydom_index import naive_lookup

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["polydom", "polydom-anytime", "greedy", "greedy-acc", "greedy-cost"]


@pytest.fixture(scope="module", params=["digits", "tiny"])
def bundle(
    request: pytest.FixtureRequest, digits_bundle_dir: Path, tiny_bundle_dir: Path
) -> Bundle:
    path = digits_bundle_dir if request.param == "digits" else tiny_bundle_dir
    return load_bundle(path, max_pixels=1 << 24)


@pytest.fixture(params=STRATEGIES)
def runtime(request: pytest.FixtureRequest, bundle: Bundle) -> StrategyRuntime:
    return bundle.runtimes[request.param]


def _queries(bundle: Bundle, count: int, seed: int) -> list[tuple[int, float, frozenset[str]]]:
    rng = np.random.default_rng(seed)
    names = list(bundle.extractors)
    out = []
    for _ in range(count):
        side = int(rng.integers(8, 400))
        n = side * side
        full = sum(bundle.costs.at(n).values())
        budget = float(rng.uniform(0.0, 1.2 * full))
        cached = frozenset(f for f in names if rng.random() < 0.25)
        out.append((n, budget, cached))
    return out


def _walk(
    bundle: Bundle,
    runtime: StrategyRuntime,
    n: int,
    budget: float,
    cached: frozenset[str],
    noise: np.random.Generator | None = None,
) -> tuple[str, list[str], float, float]:
    """Drive a session; extraction 'takes' its predicted cost times a log-normal factor when
    ``noise`` is given. Returns the answer, the acquisitions, the cost spent and the largest
    misprediction (actual − predicted) of a single extraction."""
    session = runtime.begin(n, budget, cached)
    in_hand = {f: np.zeros(bundle.extractors[f].dims, np.float32) for f in cached}
    per_feature = bundle.costs.at(n)
    spent, worst = 0.0, 0.0
    acquired: list[str] = []
    for _ in range(len(bundle.extractors) + 1):
        obs = Observation(size=n, budget=budget, spent=spent, features=in_hand)
        step = session.fallback(obs) if spent > budget else session.step(obs)
        if isinstance(step, Answer):
            return step.model, acquired, spent, worst
        assert isinstance(step, Acquire)
        assert step.feature in bundle.extractors, "acquire only the bundle's extractors"
        assert step.feature not in in_hand, "never acquire a feature twice or one in hand"
        in_hand[step.feature] = np.zeros(bundle.extractors[step.feature].dims, np.float32)
        acquired.append(step.feature)
        predicted = per_feature[step.feature]
        actual = predicted * (float(noise.lognormal(0.0, 0.5)) if noise is not None else 1.0)
        spent += actual
        worst = max(worst, actual - predicted)
    pytest.fail("session did not answer within one step per extractor")


def test_sessions_answer_with_computed_features_within_budget(
    bundle: Bundle, runtime: StrategyRuntime
) -> None:
    for n, budget, cached in _queries(bundle, 200, seed=1):
        answer, acquired, spent, _ = _walk(bundle, runtime, n, budget, cached)
        assert answer in bundle.models
        features = set(runtime.model_features[answer])
        assert features <= set(cached) | set(acquired), "answer uses only features in hand"
        assert spent <= budget + 1e-9, "with exact costs the plan fits the budget"


@pytest.mark.parametrize("name", [s for s in STRATEGIES if s != "polydom"])
def test_anytime_strategies_overrun_by_at_most_one_extraction(
    bundle: Bundle, name: str
) -> None:
    # Static Poly-Dom is excluded by design: it follows the plan made at the start.
    runtime = bundle.runtimes[name]
    rng = np.random.default_rng(5)
    for n, budget, cached in _queries(bundle, 300, seed=2):
        answer, acquired, spent, worst = _walk(bundle, runtime, n, budget, cached, noise=rng)
        assert set(runtime.model_features[answer]) <= set(cached) | set(acquired)
        assert spent <= budget + worst + 1e-9, (spent, budget, worst)


def test_fallback_answers_from_features_in_hand(bundle: Bundle, runtime: StrategyRuntime) -> None:
    rng = np.random.default_rng(2)
    names = list(bundle.extractors)
    for _ in range(100):
        in_hand = {f: np.zeros(bundle.extractors[f].dims, np.float32)
                   for f in names if rng.random() < 0.5}
        session = runtime.begin(1024, 5.0, frozenset())
        answer = session.fallback(Observation(size=1024, budget=5.0, spent=9.0, features=in_hand))
        assert set(runtime.model_features[answer.model]) <= set(in_hand)


def test_skyline_is_cost_sorted_with_rising_accuracy(
    bundle: Bundle, runtime: StrategyRuntime
) -> None:
    for side in (16, 64, 256):
        points = runtime.skyline(side * side)
        assert points, "the empty model is always on the skyline"
        assert [p[0] for p in points] == sorted(p[0] for p in points)
        assert all(b[1] > a[1] for a, b in itertools.pairwise(points))


def test_polydom_fallback_is_the_best_computable(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    rng = np.random.default_rng(3)
    for _ in range(100):
        hand = {f for f in bundle.extractors if rng.random() < 0.5}
        chosen = runtime.best_computable(hand)
        best = max(a for m, a in runtime.accuracy.items()
                   if set(runtime.model_features[m]) <= hand)
        assert runtime.accuracy[chosen] == best


def test_polydom_index_matches_naive_lookup_over_candidates(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    acc = np.array([runtime.accuracy[c] for c in runtime.candidates])
    costs = np.stack([bundle.costs.set_coefficients(runtime.model_features[c])
                      for c in runtime.candidates])
    for n, budget, _ in _queries(bundle, 1000, seed=3):
        via_index, _ = runtime.plan(n, budget, frozenset())
        naive = naive_lookup(acc, costs, n, budget)
        assert naive is not None
        assert runtime.accuracy[via_index] == acc[naive]


def test_polydom_replans_with_cached_features_for_free(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    for n, budget, cached in _queries(bundle, 300, seed=4):
        cold, _ = runtime.plan(n, budget, frozenset())
        warm, warm_cost = runtime.plan(n, budget, cached)
        assert runtime.accuracy[warm] >= runtime.accuracy[cold], "a cache never hurts"
        uncached = [f for f in runtime.model_features[warm] if f not in cached]
        assert warm_cost == pytest.approx(sum(bundle.costs.at(n)[f] for f in uncached))
        assert warm_cost <= budget + 1e-9
