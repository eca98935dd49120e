"""The calibrated Poly-Dom index (issue 17) against its oracles: the full scan of every
model (the plan it must reproduce exactly) and a brute-force skyline."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest

from service.registry import Bundle, CalibrationSettings, load_bundle
from service.strategies.polydom import PolyDomRuntime
from service.strategies.polydom_calibrated import CalibratedIndex, IndexKeeper, ranges_for
from service.types import horner

TOLERANCE = 0.10
REL = 1e-9  # the scan's tolerance on the budget (PolyDomRuntime.scan)


def _scan(
    features: dict[str, tuple[str, ...]],
    accuracy: dict[str, float],
    per_feature: dict[str, float],
    limit: float,
) -> tuple[str, float]:
    """Brute force, as PolyDomRuntime.scan: the first most accurate model that fits."""
    best, best_cost, best_acc = "", 0.0, -1.0
    for model, fs in features.items():
        cost = sum(per_feature[f] for f in fs)
        if cost <= limit and accuracy[model] > best_acc:
            best, best_cost, best_acc = model, cost, accuracy[model]
    return best, best_cost


def _skyline(
    features: dict[str, tuple[str, ...]],
    accuracy: dict[str, float],
    per_feature: dict[str, float],
) -> set[str]:
    """Brute-force skyline at one size: models no higher ranked model costs no more than
    (rank: accuracy, then bundle order, the scan's tie-break)."""
    ids = list(features)
    rank = {m: (accuracy[m], -i) for i, m in enumerate(ids)}
    cost = {m: sum(per_feature[f] for f in features[m]) for m in ids}
    return {m for m in ids if not any(rank[o] > rank[m] and cost[o] <= cost[m] for o in ids)}


def _synthetic(
    seed: int, n_models: int = 40, names: int = 7, permuted: bool = True
) -> tuple[dict[str, tuple[str, ...]], dict[str, float], list[str], np.ndarray]:
    """Random models over random non-negative cost curves; accuracies from a few values
    (ties), some models sharing the very same feature tuple (exact cost ties) and, with
    ``permuted``, some the same features in another order (ties up to rounding)."""
    rng = np.random.default_rng(seed)
    extractor = [f"e{k}" for k in range(names)]
    coefficients = np.zeros((names, 3))
    coefficients[:, 0] = rng.uniform(0.01, 0.3, names)
    coefficients[:, 1] = rng.uniform(0, 3e-5, names) * (rng.random(names) < 0.8)
    coefficients[:, 2] = rng.uniform(0, 1e-9, names) * (rng.random(names) < 0.4)
    features: dict[str, tuple[str, ...]] = {"prior": ()}
    seen: set[frozenset[str]] = set()
    while len(features) < n_models:
        chosen = tuple(str(e) for e in rng.choice(extractor, rng.integers(1, names + 1), False))
        if frozenset(chosen) in seen:
            continue
        seen.add(frozenset(chosen))
        features[f"m{len(features)}"] = chosen
        if rng.random() < 0.15:  # the same tuple again
            features[f"m{len(features)}"] = chosen
        if permuted and len(chosen) > 2 and rng.random() < 0.15:
            features[f"m{len(features)}"] = chosen[::-1]
    levels = np.round(rng.uniform(0.5, 1.0, 8), 3)
    accuracy = {m: float(rng.choice(levels)) for m in features}
    accuracy["prior"] = 0.1
    return features, accuracy, extractor, coefficients


def _factors(rng: np.random.Generator, names: list[str], spread: float) -> dict[str, float]:
    return {n: float(math.exp(rng.uniform(-spread, spread))) for n in names}


def _costs(
    names: list[str], coefficients: np.ndarray, factors: dict[str, float], n: float
) -> dict[str, float]:
    profiled = np.asarray(horner(coefficients, n)).tolist()
    return {name: p * factors[name] for name, p in zip(names, profiled, strict=True)}


@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_the_full_scan_under_random_factors_and_drift(seed: int) -> None:
    features, accuracy, names, coefficients = _synthetic(seed)
    rng = np.random.default_rng(100 + seed)
    ranges = ranges_for((256, 65536))
    snapshot = [_factors(rng, names, 2.0) for _ in ranges]
    index = CalibratedIndex(
        list(features), features, accuracy, names, coefficients,
        [(a, b) for a, b, _ in ranges], snapshot, TOLERANCE,
    )  # fmt: skip
    assert index.size < len(features) * len(ranges), "the index prunes"
    checked = 0
    for r, (start, end, _) in enumerate(ranges):
        for n in {math.ceil(start), int(end) - (end > start), int(rng.uniform(start, end))}:
            # factors drifted within the tolerance (and all scaled alike by contention)
            busy = float(rng.uniform(1.0, 3.0))
            drift = {
                k: v * busy * float(rng.uniform(1 - TOLERANCE, 1 + TOLERANCE) ** 0.5)
                for k, v in snapshot[r].items()
            }
            per_feature = _costs(names, coefficients, drift, n)
            model_costs = [sum(per_feature[f] for f in fs) for fs in features.values()]
            # budgets: random, and exactly every model's cost (ties at the limit)
            budgets = [*np.geomspace(1e-3, 2 * max(model_costs), 25).tolist(), *model_costs, 0.0]
            for budget in budgets:
                limit = max(budget, 0.0) + REL * max(abs(budget), 1.0)
                found = index.lookup(n, drift, per_feature, limit)
                assert found is not None, "factors within the tolerance keep the index valid"
                assert found == _scan(features, accuracy, per_feature, limit), (n, budget)
                checked += 1
    assert checked > 1000


def test_lookup_refuses_factors_outside_the_tolerance() -> None:
    features, accuracy, names, coefficients = _synthetic(7)
    ranges = [(256.0, 512.0)]
    snapshot = [dict.fromkeys(names, 1.0)]
    index = CalibratedIndex(
        list(features), features, accuracy, names, coefficients, ranges, snapshot, TOLERANCE
    )
    moved = dict.fromkeys(names, 5.0)  # all alike: contention, still valid
    assert index.valid_for(300, moved)
    moved[names[0]] = 5.0 * 1.25  # one extractor 25 % dearer than the rest
    assert not index.valid_for(300, moved)
    assert index.lookup(300, moved, _costs(names, coefficients, moved, 300), 1.0) is None
    assert not index.valid_for(100, dict.fromkeys(names, 1.0)), "below the first range"


@pytest.mark.parametrize("seed", range(4))
def test_kept_models_equal_the_brute_force_skyline_at_a_point(seed: int) -> None:
    """With no tolerance and a range of one size, what is kept is exactly the skyline."""
    features, accuracy, names, coefficients = _synthetic(seed, permuted=False)
    rng = np.random.default_rng(200 + seed)
    for n in (256, 3000, 65536):
        factors = _factors(rng, names, 2.0)
        index = CalibratedIndex(
            list(features), features, accuracy, names, coefficients,
            [(n, n)], [factors], 0.0,
        )  # fmt: skip
        per_feature = _costs(names, coefficients, factors, n)
        assert set(index.kept(n)) == _skyline(features, accuracy, per_feature)
    assert len(set(features.values())) < len(features), "the oracle covers exact cost ties"


@pytest.mark.parametrize("seed", range(4))
def test_kept_models_contain_every_skyline_in_the_range_and_box(seed: int) -> None:
    features, accuracy, names, coefficients = _synthetic(seed)
    rng = np.random.default_rng(300 + seed)
    ranges = ranges_for((256, 65536))
    snapshot = [_factors(rng, names, 2.0) for _ in ranges]
    index = CalibratedIndex(
        list(features), features, accuracy, names, coefficients,
        [(a, b) for a, b, _ in ranges], snapshot, TOLERANCE,
    )  # fmt: skip
    for r, (start, end, _) in enumerate(ranges):
        kept = index.kept(start)
        ranked = sorted(kept, key=lambda m: (-accuracy[m], list(features).index(m)))
        assert kept == ranked, "kept models are walked highest ranked first"
        for _ in range(20):
            n = float(rng.uniform(start, end))
            g = {
                k: v * float(rng.uniform(1 - TOLERANCE, 1 + TOLERANCE))
                for k, v in snapshot[r].items()
            }
            sky = _skyline(features, accuracy, _costs(names, coefficients, g, n))
            assert sky <= set(index.kept(n))


def test_ranges_cover_the_domain_split_at_powers_of_two() -> None:
    ranges = ranges_for((300, 70000), pieces=2)
    assert ranges[0][0] == 300 and ranges[-1][1] == 70000
    for (_, end, _), (start, _, _) in itertools.pairwise(ranges):
        assert end == pytest.approx(start)
    for start, end, bucket in ranges:
        assert bucket <= start <= end <= 2 * bucket
    with pytest.raises(ValueError, match="size domain"):
        ranges_for((0, 10))


def test_negative_coefficients_are_refused() -> None:
    with pytest.raises(ValueError, match="coefficients >= 0"):
        CalibratedIndex(["a"], {"a": ("x",)}, {"a": 1.0}, ["x"], np.array([[1.0, -1.0]]),
                        [(1.0, 2.0)], [{"x": 1.0}], 0.1)  # fmt: skip


# -- the runtime, on the real digits bundle with real calibration ----------------------------


def _calibrate(bundle: Bundle, rng: np.random.Generator, spread: float) -> None:
    """Feed the real calibrator random measured/profiled ratios per extractor and bucket,
    its clock held still (factors decay with time since the last sample: a slow run must
    not move them)."""
    frozen = time.monotonic()
    bundle.calibrator._clock = lambda: frozen
    for k in range(8, 17):
        n = 2**k
        profiled = bundle.costs.profiled_at(n)
        for name in bundle.extractors:
            ratio = math.exp(rng.uniform(-spread, spread))
            for _ in range(5):
                bundle.calibrator.record(name, n, profiled[name] * ratio)


def test_runtime_plans_with_the_calibrated_index_exactly_as_the_scan(
    digits_bundle_dir: Path,
) -> None:
    for strategy, seed in itertools.product(("polydom", "polydom-anytime"), range(3)):
        bundle = load_bundle(digits_bundle_dir, 1 << 24, CalibrationSettings(min_samples=5))
        runtime = bundle.runtimes[strategy]
        assert isinstance(runtime, PolyDomRuntime)
        rng = np.random.default_rng(seed)
        _calibrate(bundle, rng, 1.5)
        assert runtime.index_scale(4096, frozenset()) is None, "uneven: the bundle's index is off"
        keeper = runtime.calibrated_index
        assert keeper.index is None
        per_feature = bundle.costs.at(4096)
        # No index yet: the request scans and asks for a rebuild that runs off its path.
        assert runtime.plan(4096, 1.0, frozenset(), per_feature) == runtime.scan(
            1.0, frozenset(), per_feature
        )
        assert keeper.wait_idle() and keeper.index is not None and keeper.builds == 1
        index = keeper.index
        for n in rng.integers(256, 65537, 40).tolist():
            per_feature = bundle.costs.at(n)
            factors = bundle.costs.factors_at(n)
            costs = [sum(per_feature[f] for f in fs) for fs in runtime.model_features.values()]
            for budget in [*np.geomspace(0.01, 2 * max(costs), 20).tolist(), *costs]:
                limit = budget + REL * max(budget, 1.0)
                assert index.lookup(n, factors, per_feature, limit) is not None
                planned = runtime.plan(n, budget, frozenset(), per_feature)
                assert planned == runtime.scan(budget, frozenset(), per_feature), (n, budget)
        assert keeper.builds == 1, "factors did not move: no rebuild"


def test_runtime_rebuilds_off_the_request_path_when_factors_move(digits_bundle_dir: Path) -> None:
    bundle = load_bundle(digits_bundle_dir, 1 << 24, CalibrationSettings(min_samples=5))
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    _calibrate(bundle, np.random.default_rng(5), 1.0)
    keeper = runtime.calibrated_index
    keeper.rebuild_now()
    old = keeper.index
    assert old is not None and old.valid_for(4096, bundle.costs.factors_at(4096))
    profiled = bundle.costs.profiled_at(4096)
    for _ in range(40):  # hog becomes 30x dearer at this size: the window's p95 moves
        bundle.calibrator.record("hog", 4096, profiled["hog"] * 30.0)
    factors = bundle.costs.factors_at(4096)
    assert not old.valid_for(4096, factors)
    keeper._last_start = -math.inf  # the interval since the first build has passed
    per_feature = bundle.costs.at(4096)
    planned = runtime.plan(4096, 2.0, frozenset(), per_feature)  # scans, requests a rebuild
    assert planned == runtime.scan(2.0, frozenset(), per_feature)
    assert keeper.wait_idle()
    new = keeper.index
    assert new is not None and new is not old and new.valid_for(4096, factors)
    assert runtime.plan(4096, 2.0, frozenset(), per_feature) == planned


def test_keeper_starts_at_most_one_rebuild_per_interval() -> None:
    calls: list[int] = []

    def build() -> None:
        calls.append(1)

    keeper = IndexKeeper(build, min_interval_s=60.0)
    assert keeper.request_rebuild()
    assert keeper.wait_idle()
    assert not keeper.request_rebuild(), "within the interval"
    assert calls == [1] and keeper.builds == 1


def test_ties_the_same_tuple_keeps_the_first_and_another_order_keeps_both() -> None:
    features = {
        "a": ("x",),
        "b": ("x",),  # a's very tuple, as accurate: the scan always takes a first
        "c": ("x", "y"),
        "d": ("y", "x"),  # c's features in another order: equal up to rounding, both kept
        "e": ("x", "y", "z"),
    }
    accuracy = {"a": 0.8, "b": 0.8, "c": 0.9, "d": 0.9, "e": 0.95}
    coefficients = np.array([[0.1, 1e-5], [0.3, 0.0], [0.2, 2e-6]])
    names = ["x", "y", "z"]
    index = CalibratedIndex(
        list(features), features, accuracy, names, coefficients,
        [(256.0, 512.0)], [dict.fromkeys(names, 1.0)], TOLERANCE,
    )  # fmt: skip
    assert index.kept(300) == ["e", "c", "d", "a"]
    per_feature = _costs(names, coefficients, dict.fromkeys(names, 1.0), 300)
    for budget in (0.05, per_feature["x"], 0.5, per_feature["x"] + per_feature["y"], 1.0):
        limit = budget + REL
        assert index.lookup(300, dict.fromkeys(names, 1.0), per_feature, limit) == _scan(
            features, accuracy, per_feature, limit
        )
