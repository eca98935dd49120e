"""The contract every strategy runtime honours, run against every bundle we have.

Later strategies (greedy sequences, DAG, gating, trees) join by registering a runtime and
shipping a bundle; this suite then covers them unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.registry import Bundle, load_bundle
from service.strategies.base import Acquire, Answer, Observation
from service.strategies.polydom import PolyDomRuntime
from service.strategies.polydom_index import naive_lookup


@pytest.fixture(scope="module", params=["digits", "tiny"])
def bundle(
    request: pytest.FixtureRequest, digits_bundle_dir: Path, tiny_bundle_dir: Path
) -> Bundle:
    path = digits_bundle_dir if request.param == "digits" else tiny_bundle_dir
    return load_bundle(path, max_pixels=1 << 24)


def _queries(bundle: Bundle, count: int, seed: int) -> list[tuple[int, float, frozenset[str]]]:
    rng = np.random.default_rng(seed)
    names = list(bundle.extractors)
    out = []
    for _ in range(count):
        side = int(rng.integers(8, 400))
        n = side * side
        full = sum(bundle.runtime.costs.at(n).values())
        budget = float(rng.uniform(0.0, 1.2 * full))
        cached = frozenset(f for f in names if rng.random() < 0.25)
        out.append((n, budget, cached))
    return out


def _walk(bundle: Bundle, n: int, budget: float, cached: frozenset[str]) -> tuple[str, list[str]]:
    """Drive a session with predicted (not measured) costs; return answer and acquisitions."""
    runtime = bundle.runtime
    session = runtime.begin(n, budget, cached)
    in_hand = {f: np.zeros(bundle.extractors[f].dims, np.float32) for f in cached}
    per_feature = runtime.costs.at(n)
    spent = 0.0
    acquired: list[str] = []
    for _ in range(len(bundle.extractors) + 1):
        step = session.step(Observation(size=n, budget=budget, spent=spent, features=in_hand))
        if isinstance(step, Answer):
            return step.model, acquired
        assert isinstance(step, Acquire)
        assert step.feature in bundle.extractors, "acquire only the bundle's extractors"
        assert step.feature not in in_hand, "never acquire a feature twice or one in hand"
        in_hand[step.feature] = np.zeros(bundle.extractors[step.feature].dims, np.float32)
        acquired.append(step.feature)
        spent += per_feature[step.feature]
    pytest.fail("session did not answer within one step per extractor")


def test_sessions_terminate_with_computable_affordable_answers(bundle: Bundle) -> None:
    runtime = bundle.runtime
    for n, budget, cached in _queries(bundle, 300, seed=1):
        answer, acquired = _walk(bundle, n, budget, cached)
        assert answer in bundle.models
        features = set(runtime.model_features[answer])
        assert features <= set(cached) | set(acquired), "answer uses only features in hand"
        assert set(acquired) <= features, "acquire only what the answer needs"
        predicted = sum(runtime.costs.at(n)[f] for f in acquired)
        assert predicted <= budget + 1e-9, "the plan fits the budget under the cost model"


def test_fallback_answers_from_features_in_hand(bundle: Bundle) -> None:
    rng = np.random.default_rng(2)
    names = list(bundle.extractors)
    for _ in range(100):
        in_hand = {f: np.zeros(bundle.extractors[f].dims, np.float32)
                   for f in names if rng.random() < 0.5}
        session = bundle.runtime.begin(1024, 5.0, frozenset())
        answer = session.fallback(Observation(size=1024, budget=5.0, spent=9.0, features=in_hand))
        assert set(bundle.runtime.model_features[answer.model]) <= set(in_hand)
        best = max(bundle.runtime.accuracy[m] for m, fs in bundle.runtime.model_features.items()
                   if set(fs) <= set(in_hand))
        assert bundle.runtime.accuracy[answer.model] == best


def test_polydom_index_matches_naive_lookup_over_candidates(bundle: Bundle) -> None:
    runtime = bundle.runtime
    assert isinstance(runtime, PolyDomRuntime)
    acc = np.array([runtime.accuracy[c] for c in runtime.candidates])
    costs = np.stack([runtime.costs.set_coefficients(runtime.model_features[c])
                      for c in runtime.candidates])
    for n, budget, _ in _queries(bundle, 1000, seed=3):
        via_index, _ = runtime.plan(n, budget, frozenset())
        naive = naive_lookup(acc, costs, n, budget)
        assert naive is not None
        assert runtime.accuracy[via_index] == acc[naive]


def test_polydom_replans_with_cached_features_for_free(bundle: Bundle) -> None:
    runtime = bundle.runtime
    assert isinstance(runtime, PolyDomRuntime)
    for n, budget, cached in _queries(bundle, 300, seed=4):
        cold, _ = runtime.plan(n, budget, frozenset())
        warm, warm_cost = runtime.plan(n, budget, cached)
        assert runtime.accuracy[warm] >= runtime.accuracy[cold], "a cache never hurts"
        uncached = [f for f in runtime.model_features[warm] if f not in cached]
        assert warm_cost == pytest.approx(sum(runtime.costs.at(n)[f] for f in uncached))
        assert warm_cost <= budget + 1e-9
