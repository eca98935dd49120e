"""The contract every strategy runtime honours, run against every strategy of every bundle.

Later strategies (DAG, gating, trees) join by registering a runtime and shipping a bundle;
this suite then covers them unchanged.
"""

from __future__ import annotations

import itertools
import json
import typing
from pathlib import Path

import numpy as np
import pytest

from service.bundle import AnyStrategy, StrategySpec
from service.registry import Bundle, load_bundle
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    StrategyRuntime,
    strategy_for,
)
from service.strategies.polydom import PolyDomRuntime
from service.strategies.polydom_index import naive_lookup

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ["polydom", "polydom-anytime", "greedy", "greedy-acc", "greedy-cost"]
# (bundle, strategy) pairs the contract runs on: every strategy of every bundle we build.
CASES = [(b, s) for b in ("digits", "tiny") for s in STRATEGIES] + [
    ("router", "dag"),
    ("gating", "gating"),
    ("gating", "gate-0"),
    ("cstc", "cstc"),
]
ANYTIME = [case for case in CASES if case[1] != "polydom"]


@pytest.fixture(scope="module")
def bundles(
    digits_bundle_dir: Path,
    tiny_bundle_dir: Path,
    router_bundle_dir: Path,
    gating_bundle_dir: Path,
    cstc_bundle_dir: Path,
) -> dict[str, Bundle]:
    return {
        name: load_bundle(path, max_pixels=1 << 24)
        for name, path in (
            ("digits", digits_bundle_dir),
            ("tiny", tiny_bundle_dir),
            ("router", router_bundle_dir),
            ("gating", gating_bundle_dir),
            ("cstc", cstc_bundle_dir),
        )
    }


@pytest.fixture(scope="module", params=["digits", "tiny"])
def bundle(request: pytest.FixtureRequest, bundles: dict[str, Bundle]) -> Bundle:
    """The image bundles (Poly-Dom and Greedy strategies)."""
    return bundles[request.param]


@pytest.fixture(params=CASES, ids=["-".join(c) for c in CASES])
def case(
    request: pytest.FixtureRequest, bundles: dict[str, Bundle]
) -> tuple[Bundle, StrategyRuntime]:
    bundle_name, strategy = request.param
    return bundles[bundle_name], bundles[bundle_name].runtimes[strategy]


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
    reserve: float = 0.0,
) -> tuple[str, list[str], float, float]:
    """Drive a session; extraction 'takes' its predicted cost times a log-normal factor when
    ``noise`` is given. Returns the answer, the acquisitions, the cost spent and the
    misprediction (actual − predicted) of the last extraction."""
    plan_budget = max(budget - reserve, 0.0)  # as service.execution does
    session = runtime.begin(n, plan_budget, cached)
    in_hand = {f: np.zeros(bundle.extractors[f].dims, np.float32) for f in cached}
    per_feature = bundle.costs.at(n)
    spent, worst = 0.0, 0.0
    acquired: list[str] = []
    for _ in range(len(bundle.extractors) + 1):
        obs = Observation(size=n, budget=plan_budget, spent=spent, features=in_hand)
        step = session.fallback(obs) if spent > budget else session.step(obs)
        if isinstance(step, Answer):
            if runtime.name == "polydom-anytime":
                best = runtime.best_computable(set(in_hand))
                assert runtime.accuracy[step.model] >= runtime.accuracy[best], (
                    "anytime Poly-Dom answered worse than a model it had in hand"
                )
            return step.model, acquired, spent, worst
        assert isinstance(step, Acquire)
        assert step.feature in bundle.extractors, "acquire only the bundle's extractors"
        assert step.feature not in in_hand, "never acquire a feature twice or one in hand"
        in_hand[step.feature] = np.zeros(bundle.extractors[step.feature].dims, np.float32)
        acquired.append(step.feature)
        predicted = per_feature[step.feature]
        actual = predicted * (float(noise.lognormal(0.0, 0.5)) if noise is not None else 1.0)
        spent += actual
        worst = actual - predicted
    pytest.fail("session did not answer within one step per extractor")


def test_sessions_answer_with_computed_features_within_budget(
    case: tuple[Bundle, StrategyRuntime],
) -> None:
    bundle, runtime = case
    for n, budget, cached in _queries(bundle, 200, seed=1):
        answer, acquired, spent, _ = _walk(bundle, runtime, n, budget, cached)
        assert answer in bundle.models
        features = set(runtime.model_features[answer])
        assert features <= set(cached) | set(acquired), "answer uses only features in hand"
        assert spent <= budget + 1e-9, "with exact costs the plan fits the budget"


@pytest.mark.parametrize("reserve", [0.0, 0.5])
@pytest.mark.parametrize("which", ANYTIME, ids=["-".join(c) for c in ANYTIME])
def test_anytime_strategies_overrun_by_at_most_one_extraction(
    bundles: dict[str, Bundle], which: tuple[str, str], reserve: float
) -> None:
    # Static Poly-Dom is excluded by design: it follows the plan made at the start.
    bundle = bundles[which[0]]
    runtime = bundle.runtimes[which[1]]
    rng = np.random.default_rng(5)
    for n, budget, cached in _queries(bundle, 300, seed=2):
        answer, acquired, spent, worst = _walk(
            bundle, runtime, n, budget, cached, noise=rng, reserve=reserve
        )
        assert set(runtime.model_features[answer]) <= set(cached) | set(acquired)
        assert spent <= budget + worst + 1e-9, (spent, budget, worst)


def test_fallback_answers_from_features_in_hand(case: tuple[Bundle, StrategyRuntime]) -> None:
    bundle, runtime = case
    rng = np.random.default_rng(2)
    names = list(bundle.extractors)
    for _ in range(100):
        in_hand = {
            f: np.zeros(bundle.extractors[f].dims, np.float32) for f in names if rng.random() < 0.5
        }
        session = runtime.begin(1024, 5.0, frozenset())
        answer = session.fallback(Observation(size=1024, budget=5.0, spent=9.0, features=in_hand))
        assert set(runtime.model_features[answer.model]) <= set(in_hand)


def test_skyline_is_cost_sorted_with_rising_accuracy(
    case: tuple[Bundle, StrategyRuntime],
) -> None:
    _, runtime = case
    for side in (16, 64, 256):
        points = runtime.skyline(side * side)
        assert points, "the empty model is always on the skyline"
        assert [p[0] for p in points] == sorted(p[0] for p in points)
        assert all(b[1] > a[1] for a, b in itertools.pairwise(points))


def test_every_spec_kind_has_one_runtime_typed_by_it() -> None:
    """A spec kind of the manifest union is served by the runtime registered for it, and
    that runtime is declared ``StrategyRuntime[TheSpec]``."""
    specs = typing.get_args(AnyStrategy)
    assert len(specs) >= 4
    for spec in specs:
        assert issubclass(spec, StrategySpec)
        kind = spec.model_fields["kind"].default
        runtime = strategy_for(kind)
        assert runtime.kind == kind
        bases = [
            b
            for b in getattr(runtime, "__orig_bases__", ())
            if typing.get_origin(b) is StrategyRuntime
        ]
        assert [typing.get_args(b) for b in bases] == [(spec,)], (runtime, bases)


def test_a_runtime_refuses_a_spec_of_another_kind(bundles: dict[str, Bundle]) -> None:
    digits, router = bundles["digits"], bundles["router"]
    dag_spec = router.manifest.strategy("dag")
    with pytest.raises(ValueError, match=r"PolyDomRuntime serves strategies of kind 'polydom'"):
        PolyDomRuntime(digits.manifest, dag_spec, digits.models, digits.costs)  # type: ignore[arg-type]


def test_every_strategy_describes_itself_as_json(case: tuple[Bundle, StrategyRuntime]) -> None:
    """``GET /models/{name}`` lists ``spec.summary()``: JSON-ready, named, of its kind, and
    every model the spec references exists in the bundle, among them every model the
    runtime may answer with."""
    bundle, runtime = case
    summary = runtime.spec.summary()
    json.dumps(summary)  # TypeError if a value is not JSON-ready
    assert summary["name"] == runtime.name
    assert summary["kind"] == runtime.kind
    assert isinstance(summary["anytime"], bool)
    assert runtime.spec.referenced_models() <= {m.id for m in bundle.manifest.models}
    assert set(runtime.answerable()) <= runtime.spec.referenced_models()


def test_polydom_fallback_is_the_best_computable(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    rng = np.random.default_rng(3)
    for _ in range(100):
        hand = {f for f in bundle.extractors if rng.random() < 0.5}
        chosen = runtime.best_computable(hand)
        best = max(a for m, a in runtime.accuracy.items() if set(runtime.model_features[m]) <= hand)
        assert runtime.accuracy[chosen] == best


def test_polydom_index_matches_naive_lookup_over_candidates(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    lo, hi = runtime.size_domain
    acc = np.array([runtime.accuracy[c] for c in runtime.candidates])
    costs = np.stack(
        [bundle.costs.set_coefficients(runtime.model_features[c]) for c in runtime.candidates]
    )
    checked = 0
    for n, budget, _ in _queries(bundle, 1000, seed=3):
        per_feature = bundle.costs.at(n)
        chosen, _ = runtime.plan(n, budget, frozenset(), per_feature)
        if lo <= n <= hi:  # the index's domain: two binary searches == Naive-Lookup
            assert runtime.index_scale(n, frozenset()) == 1.0
            naive = naive_lookup(acc, costs, n, budget)
            assert naive is not None
            assert runtime.accuracy[chosen] == acc[naive]
            checked += 1
        else:  # outside it: a scan of every model, the best affordable one
            affordable = [
                m
                for m, fs in runtime.model_features.items()
                if sum(per_feature[f] for f in fs) <= budget
            ]
            assert runtime.accuracy[chosen] == max(runtime.accuracy[m] for m in affordable)
    assert checked > 100


def test_polydom_replans_with_cached_features_for_free(bundle: Bundle) -> None:
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    for n, budget, cached in _queries(bundle, 300, seed=4):
        cold, _ = runtime.plan(n, budget, frozenset(), bundle.costs.at(n))
        warm, warm_cost = runtime.plan(n, budget, cached, bundle.costs.at(n))
        assert runtime.accuracy[warm] >= runtime.accuracy[cold], "a cache never hurts"
        uncached = [f for f in runtime.model_features[warm] if f not in cached]
        assert warm_cost == pytest.approx(sum(bundle.costs.at(n)[f] for f in uncached))
        assert warm_cost <= budget + 1e-9


def test_anytime_never_answers_with_uncomputed_features_on_accuracy_ties(
    digits_bundle_dir: Path,
) -> None:
    bundle = load_bundle(digits_bundle_dir, max_pixels=1 << 24)
    runtime = bundle.runtimes["polydom-anytime"]
    assert isinstance(runtime, PolyDomRuntime)
    top = max(runtime.candidates, key=lambda m: runtime.accuracy[m])
    runtime.accuracy["thumbnail"] = runtime.accuracy[top]  # a tie with the best candidate
    hand = {"thumbnail": np.zeros(bundle.extractors["thumbnail"].dims, np.float32)}
    for budget in (0.5, 5.0, 50.0):
        session = runtime.begin(4096, budget, frozenset(hand))
        step = session.step(Observation(size=4096, budget=budget, spent=0.0, features=hand))
        if isinstance(step, Answer):
            assert set(runtime.model_features[step.model]) <= set(hand)


def _calibrated(bundle_dir: Path, ratios: dict[str, float]) -> Bundle:
    """The bundle with real calibration fed measured/profiled ratios at size 4096."""
    from service.registry import CalibrationSettings

    bundle = load_bundle(bundle_dir, 1 << 24, CalibrationSettings(min_samples=5))
    profiled = bundle.costs.profiled_at(4096)
    for name in bundle.extractors:
        for _ in range(10):
            bundle.calibrator.record(name, 4096, profiled[name] * ratios.get(name, 2.0))
    assert bundle.costs.calibrated
    return bundle


def test_uniform_calibration_keeps_the_index_with_a_rescaled_budget(
    digits_bundle_dir: Path,
) -> None:
    bundle = _calibrated(digits_bundle_dir, {})  # every extractor 2x slower than profiled
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    scale = runtime.index_scale(4096, frozenset())
    assert scale == pytest.approx(2.0)
    per_feature = bundle.costs.at(4096)
    for budget in np.geomspace(0.05, 20, 40):
        via_index, cost = runtime.plan(4096, float(budget), frozenset(), per_feature)
        scanned, _ = runtime.scan(float(budget), frozenset(), per_feature)
        assert cost <= budget * (1 + 1e-9)
        assert runtime.accuracy[via_index] >= runtime.accuracy[scanned] - runtime.spec.epsilon


def test_uneven_calibration_switches_to_a_scan_of_every_model(digits_bundle_dir: Path) -> None:
    bundle = _calibrated(digits_bundle_dir, {"hog": 20.0})  # hog is far slower than profiled
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    assert runtime.index_scale(4096, frozenset()) is None
    per_feature = bundle.costs.at(4096)
    assert per_feature["hog"] == pytest.approx(20 * bundle.costs.profiled_at(4096)["hog"])
    for budget in np.geomspace(0.05, 40, 40):
        chosen, cost = runtime.plan(4096, float(budget), frozenset(), per_feature)
        affordable = [
            m
            for m, fs in runtime.model_features.items()
            if sum(per_feature[f] for f in fs) <= budget
        ]
        assert cost <= budget * (1 + 1e-9)
        assert runtime.accuracy[chosen] == max(runtime.accuracy[m] for m in affordable)


def test_greedy_picks_the_sequence_that_buys_the_most_at_this_size(bundle: Bundle) -> None:
    runtime = bundle.runtimes["greedy"]
    for n, budget, cached in _queries(bundle, 200, seed=6):
        answer, _, _, _ = _walk(bundle, runtime, n, budget, cached)
        best_prefix = (
            max((p for p in runtime.skyline(n) if p[0] <= budget), key=lambda p: p[1])
            if not cached
            else None
        )
        if best_prefix is not None:
            assert runtime.accuracy[answer] == best_prefix[1], (n, budget)
