"""The best fixed sensor subsets every tabular bundle carries (issue 25), against brute force:
on a problem small enough that every subset can be fitted alone, the point a served budget
chooses is the most accurate one on the validation rows among every subset that fits and
every adaptive point; and the DAG's tuned bank is never weaker on validation than a state's
subset fitted alone with the DAG's learners.

The module stays whole (over 450 lines): the brute-force oracle, the bundle it checks and the
mean-budget choices share one small problem and its fits."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from service.bundle import DagStrategy, FixedPoint
from service.registry import load_bundle
from service.strategies.dag import DagRuntime
from service.strategies.fixed import Option, capped_at, handicap, mean_choice, pick
from training.bundles.dag import DagSpec, build_dag_bundle
from training.dag import DagClassifier
from training.dag.learners import make_classifier
from training.executor import LocalExecutor
from training.fixed_subsets import FixedSearch, FixedSubsets, fit_subset

COLUMNS = ["a", "b1", "b2", "c"]
SENSORS = {"a": ["a"], "b": ["b1", "b2"], "c": ["c"]}
COSTS = {"a": 1.0, "b": 2.0, "c": 4.0}
# small trees and few of them: the test is about the choice, not the learners' strength
SEARCH = {"num_leaves": [7], "max_trees": 40, "patience": 10}


def _data(n: int = 700, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(COLUMNS)))
    score = 1.2 * x[:, 0] + np.where(x[:, 0] > 0, x[:, 1] - x[:, 2], 2.0 * x[:, 3])
    y = np.where(score + 0.3 * rng.normal(size=n) > 0, "yes", "no")
    return x, y


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DagSpec, np.ndarray, np.ndarray]:
    x, y = _data()
    spec = DagSpec(
        name="trio",
        label="label",
        sensors=dict(SENSORS),
        costs=dict(COSTS),
        cost_scales=[0.0, 0.05, 0.3],
        refine_scales=0,
        learner="linear",
        fixed=dict(SEARCH),
        fixed_margin=0.0,  # any validation gain: the DAG's points are chosen at some budgets
    )
    out = tmp_path_factory.mktemp("fixed") / "trio"
    build_dag_bundle(out, spec, x, y, COLUMNS)
    return out, spec, x, y


def test_every_budget_gets_the_best_point_on_validation_by_brute_force(
    built: tuple[Path, DagSpec, np.ndarray, np.ndarray],
) -> None:
    out, spec, x, y = built
    x_train, x_val, _, y_train, y_val, _ = spec.split(x, y)
    classes, y_idx = np.unique(y_train, return_inverse=True)
    y_val_idx = np.searchsorted(classes, y_val)
    search = FixedSearch.from_mapping(SEARCH)
    # Brute force: every subset of the 3 sensors fitted alone, its validation accuracy.
    position = {c: i for i, c in enumerate(COLUMNS)}
    subsets: dict[tuple[str, ...], tuple[float, float]] = {}
    for k in range(len(SENSORS) + 1):
        for subset in itertools.combinations(SENSORS, k):
            cols = [position[c] for s in subset for c in SENSORS[s]]
            _, _, accuracy = fit_subset(x_train, y_idx, x_val, y_val_idx, cols, search)
            subsets[subset] = (sum(COSTS[s] for s in subset), accuracy)
    assert len(subsets) == 8
    bundle = load_bundle(out, 1 << 20)
    runtime = bundle.strategy("dag")
    assert isinstance(runtime, DagRuntime)
    spec_dag = bundle.manifest.strategy("dag")
    assert isinstance(spec_dag, DagStrategy) and spec_dag.fixed
    assert spec_dag.margin == 0.0 and spec_dag.validation_rows == len(y_val)
    kinds = set()
    for p in spec_dag.policies:  # uncapped, a point's walks give its own numbers
        assert p.capped[-1].accuracy == pytest.approx(1.0 - p.error)
        assert p.capped[-1].mean_cost == pytest.approx(p.mean_cost)
    for budget in (0.5, 1.0, 1.5, 2.0, 3.0, 3.5, 5.0, 6.0, 7.0, 8.0):
        chosen = runtime.choose(budget)
        # a DAG point is worth its validation accuracy with every walk stopped at the budget
        capped = {
            id(p): at.accuracy
            for p in spec_dag.policies
            if (at := capped_at(p.capped, budget)) is not None
        }
        fixed_best = max(acc for cost, acc in subsets.values() if cost <= budget)
        adaptive_best = max(capped.values(), default=0.0)
        # an adaptive point is ranked one standard error of the best fixed subset down
        down = spec_dag.margin * math.sqrt(fixed_best * (1 - fixed_best) / len(y_val))
        if isinstance(chosen, FixedPoint):
            rank = chosen.accuracy
            features = bundle.manifest.model(chosen.model).features
            assert sum(COSTS[f] for f in features) <= budget
        else:
            rank = capped[id(chosen.spec)] - down
            assert rank >= fixed_best, "an adaptive point only where it beats the fixed subset"
        assert rank == pytest.approx(max(fixed_best, adaptive_best - down)), budget
        kinds.add(type(chosen).__name__)
    assert kinds == {"FixedPoint", "_Policy"}, "both kinds of point are chosen somewhere"


def test_an_adaptive_point_must_beat_the_fixed_subset_by_more_than_the_noise() -> None:
    fixed = Option(2.0, 0.80, "fixed", fixed=True)
    close, clear = Option(1.5, 0.81, "close"), Option(1.5, 0.83, "clear")
    # one standard error of 0.80 on 1000 rows: 1.26 points
    assert pick([fixed, close], 0.0, margin=1.0, rows=1000) is fixed
    assert pick([fixed, clear], 0.0, margin=1.0, rows=1000) is clear
    assert pick([fixed, close], 0.0) is close, "no margin: any gain"
    assert pick([close], 0.0, margin=1.0, rows=1000) is close, "no fixed subset to beat"


def test_a_request_tolerance_trades_validation_accuracy_for_cost(
    built: tuple[Path, DagSpec, np.ndarray, np.ndarray],
) -> None:
    out, *_ = built
    bundle = load_bundle(out, 1 << 20)
    runtime = bundle.strategy("dag")
    assert isinstance(runtime, DagRuntime) and runtime.tolerance == 0.0

    def cost_and_accuracy(chosen: object) -> tuple[float, float]:
        if isinstance(chosen, FixedPoint):
            features = bundle.manifest.model(chosen.model).features
            return sum(COSTS[f] for f in features), chosen.accuracy
        at = capped_at(chosen.spec.capped, 8.0)  # type: ignore[attr-defined]
        assert at is not None
        return at.mean_cost, at.accuracy

    strict = cost_and_accuracy(runtime.choose(8.0))
    loose = runtime.with_options(tolerance=0.5)
    assert isinstance(loose, DagRuntime) and runtime.tolerance == 0.0, "a copy, not the runtime"
    cheap = cost_and_accuracy(loose.choose(8.0))
    assert cheap[0] < strict[0] and cheap[1] >= strict[1] - 0.5
    assert cheap[0] == 0.0, "within 0.5 of the best, the free prior is the cheapest"
    with pytest.raises(ValueError, match="takes no per-request 'budget_split'"):
        runtime.with_options(budget_split=1.0)


def test_the_tuned_bank_is_never_weaker_on_validation_than_the_subset_alone() -> None:
    x, y = _data(500, seed=5)
    sensors = {"a": [0], "b": [1, 2], "c": [3]}
    x_train, x_val, y_train, y_val = x[:300], x[300:], y[:300], y[300:]
    # the DAG's own learners among the candidates (the DAG builder adds its `learner`)
    search = FixedSearch.from_mapping(SEARCH | {"learners": ["lightgbm", "gbrt", "linear"]})
    bank = FixedSubsets(x_train, y_train, x_val, y_val, sensors, COSTS, search)
    model = DagClassifier(sensors=sensors, costs=COSTS, learner="gbrt", folds=3, bank=bank)
    model.fit(x_train, y_train)
    classes = model.classes_
    for state in model.states_:
        cols = model.state_columns(state)
        if not cols:
            continue
        own = model.classifiers_[state]
        mine = np.mean(classes[np.argmax(own.predict_proba(x_val[:, cols]), axis=1)] == y_val)
        y_idx = np.searchsorted(classes, y_train)
        for learner in ("gbrt", "linear"):
            alone = make_classifier(learner, 1.0, 0).fit(x_train[:, cols], y_idx)
            theirs = np.mean(classes[alone.predict(x_val[:, cols])] == y_val)
            assert mine >= theirs, (model.state_sensors(state), learner, mine, theirs)
    with pytest.raises(ValueError, match="other rows than the X given to fit"):
        DagClassifier(sensors=sensors, costs=COSTS, bank=bank).fit(x_val, y_val)


class _LockedHook:
    """A progress hook like the CLI's: it holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.calls = 0

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            self.calls += 1


def test_a_dag_with_a_tuned_bank_ships_to_other_processes_without_its_executor() -> None:
    # Ray and process pools pickle the estimator (its bank with it); the executor's progress
    # hook holds the display's lock, which cannot be pickled (a CI run with `--executor ray`
    # failed so): the bank travels without its executor and fits inline wherever it lands.
    x, y = _data(300, seed=7)
    sensors = {"a": [0], "b": [1, 2], "c": [3]}
    executor = LocalExecutor(n_jobs=1)
    executor.progress = _LockedHook()
    search = FixedSearch.from_mapping(SEARCH)
    with executor:
        bank = FixedSubsets(x[:200], y[:200], x[200:], y[200:], sensors, COSTS, search, 0, executor)
        model = DagClassifier(sensors=sensors, costs=COSTS, learner="linear", folds=2, bank=bank)
        model.fit(x[:200], y[:200])
        with pytest.raises(TypeError):
            pickle.dumps(executor)  # what the bank holds while it builds
        copy = pickle.loads(pickle.dumps(model))
    assert copy.bank.executor.kind == "inline" and bank.executor is executor
    assert executor.progress.calls > 0  # the bank's fits went through this executor
    np.testing.assert_array_equal(copy.predict(x[200:]), model.predict(x[200:]))


@pytest.mark.redis
def test_a_mean_budget_serves_the_best_average_and_keeps_it(
    built: tuple[Path, DagSpec, np.ndarray, np.ndarray], redis_url: str, tmp_path: Path
) -> None:
    """Served over HTTP on the validation rows with every sensor acquired from a real Redis,
    a mean budget (``budget_mode`` "mean") serves what brute force over the manifest finds
    best on average at that mean: one point, or two shared out so that their average cost is
    the budget (every pair tried). The served rows get exactly the validation numbers the
    choice was made by: one point's average cost and accuracy; a pair's points in shares
    within binomial noise of the brute force's, spending exactly those shares' average."""
    from fastapi.testclient import TestClient

    from service.cache import InProcessCache
    from service.http import create_app
    from service.settings import Settings
    from tests.support.sensor_store import SensorStore

    out, spec, x, y = built
    _, x_val, _, _, y_val, _ = spec.split(x, y)
    manifest = load_bundle(out, 1 << 20).manifest
    spec_dag = manifest.strategy("dag")
    assert isinstance(spec_dag, DagStrategy) and spec_dag.margin == 0.0
    full = sum(COSTS.values())

    def brute_force(mean: float, cap: float) -> tuple[float, list[tuple[str, float, float, float]]]:
        """The best validation accuracy on average at ``mean``, and its points: (label,
        share, accuracy, average cost) each."""
        options = [
            (f.model, f.accuracy, sum(COSTS[s] for s in manifest.model(f.model).features))
            for f in spec_dag.fixed
            if sum(COSTS[s] for s in manifest.model(f.model).features) <= cap
        ]
        for p in spec_dag.policies:
            at = capped_at(p.capped, cap)
            if at is not None:
                options.append(("dag", at.accuracy, at.mean_cost))
        best: tuple[float, list[tuple[str, float, float, float]]] = (-1.0, [])
        for label, acc, cost in options:
            if cost <= mean + 1e-9 and acc > best[0] + 1e-12:
                best = (acc, [(label, 1.0, acc, cost)])
        for (la, aa, ca), (lb, ab, cb) in itertools.product(options, options):
            if ca <= mean < cb:
                share = (cb - mean) / (cb - ca)
                value = share * aa + (1 - share) * ab
                if value > best[0] + 1e-12:
                    best = (value, [(la, share, aa, ca), (lb, 1 - share, ab, cb)])
        return best

    store = SensorStore(redis_url, COLUMNS)
    settings = Settings(models_dir=out.parent, sensor_sources={"trio": {"*": store.source()}})
    ids = [store.put(row, f"val-{i}") for i, row in enumerate(x_val)]
    n = len(ids)
    kinds: set[str] = set()
    pairs = 0
    with TestClient(create_app(settings, cache=InProcessCache(1))) as client:
        for mean, cap in ((1.5, None), (3.5, None), (3.5, 5.0), (5.75, 6.0), (6.75, None)):
            _, chosen = brute_force(mean, full if cap is None else cap)
            body: dict[str, object] = {"model": "trio", "budget": mean, "budget_mode": "mean"}
            if cap is not None:
                body["max_cost"] = cap
            rows = []
            for i in ids:
                r = client.post("/predict", json={**body, "item": {"id": i}})
                assert r.status_code == 200, r.text
                rows.append(r.json())
            assert {r["cost"]["budget_mode"] for r in rows} == {"mean"}
            assert {r["cost"]["cap"] for r in rows} == {full if cap is None else cap}
            assert {r["cost"]["budget"] for r in rows} == {mean}
            spent = np.asarray([r["cost"]["spent"] for r in rows])
            assert spent.max() <= (full if cap is None else cap)
            assert not any(r["deadline_exceeded"] for r in rows)
            labels = [
                r["decision"]["point"] if (r["decision"] or {}).get("kind") == "fixed" else "dag"
                for r in rows
            ]
            kinds |= set(labels)
            right = np.mean([r["prediction"] == t for r, t in zip(rows, y_val, strict=True)])
            shared = [r["cost"]["shared"] for r in rows]
            if len(chosen) == 1:  # one point: the served rows are its validation rows
                (label, _, accuracy, cost) = chosen[0]
                assert set(labels) == {label}, (mean, cap)
                assert shared == [None] * n
                assert spent.mean() == pytest.approx(cost, abs=0.02), (mean, cap)
                assert right == pytest.approx(accuracy, abs=0.01), (mean, cap)
                continue
            pairs += 1
            (la, share, _, ca), (lb, _, _, cb) = chosen
            assert set(labels) <= {la, lb}, (mean, cap, set(labels), chosen)
            # the answer says what was shared out, and which of the two this item got
            assert all(
                sh == pytest.approx({"share": share, "cheaper": ca, "dearer": cb}) for sh in shared
            )
            for r, label in zip(rows, labels, strict=True):
                assert r["cost"]["planned"] == pytest.approx(ca if label == la else cb)
            got = labels.count(la) / n
            assert abs(got - share) <= 4 * math.sqrt(share * (1 - share) / n) + 1 / n
            if la != "dag" and lb != "dag":  # fixed subsets: costs exact per row
                assert spent.mean() == pytest.approx(got * ca + (1 - got) * cb)
        # a batch with a mean budget: each item gets what it gets alone (the same draw)
        mean, body = 3.5, {"model": "trio", "budget": 3.5, "budget_mode": "mean"}
        alone = [
            client.post("/predict", json={**body, "item": {"id": i}}).json()["cost"]["planned"]
            for i in ids[:40]
        ]
        r = client.post("/predict", json={**body, "items": [{"id": i} for i in ids[:40]]})
        assert r.status_code == 200, r.text
        batch = r.json()["results"]
        assert [x["cost"]["planned"] for x in batch] == pytest.approx(alone)
        assert {x["cost"]["budget_mode"] for x in batch} == {"mean"}
        r = client.post(
            "/predict",
            json={
                "model": "trio",
                "items": [{"id": ids[0]}],
                "total_budget": 3.0,
                "budget_mode": "mean",
            },
        )
        assert r.status_code == 422 and "go with 'budget'" in r.text, r.text
        # a bad mean request is a 422 that says what to send
        for extra, says in (
            ({"budget_mode": "mean", "max_cost": 1.0}, "below the budget"),
            ({"max_cost": 5.0}, "caps an item under budget_mode 'mean'"),
            ({"budget_mode": "average"}, "budget_mode"),
        ):
            body = {"model": "trio", "item": {"id": ids[0]}, "budget": 2.0, **extra}
            r = client.post("/predict", json=body)
            assert r.status_code == 422 and says in r.text, r.text
    assert "dag" in kinds and pairs >= 2, "an adaptive point, and pairs, are served"
    # the same bundle with costs measured in ms: a budget is a deadline, no average keeps it
    timed = tmp_path / "trio"
    shutil.copytree(out, timed)
    manifest_file = timed / "manifest.json"
    raw = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps(raw | {"cost_basis": "measured", "cost_unit": "ms"}))
    with TestClient(create_app(Settings(models_dir=tmp_path), cache=InProcessCache(1))) as client:
        item = {"id": "x", "values": {"a": 1.0}}
        body = {"model": "trio", "item": item, "budget": 2.0, "budget_mode": "mean"}
        r = client.post("/predict", json=body)
        assert r.status_code == 422 and "needs declared costs" in r.text, r.text
        r = client.post("/predict", json=body | {"budget_mode": "cap"})
        assert r.status_code == 200, r.text


def test_the_mean_choice_is_the_best_average_by_brute_force() -> None:
    """:func:`mean_choice` against every single option and every pair shared out to the mean,
    on random option sets (fixed and adaptive, a margin, a tolerance)."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        k = int(rng.integers(1, 9))
        options = [
            Option(float(c), float(a), i, fixed=bool(f))
            for i, (c, a, f) in enumerate(
                zip(
                    rng.integers(0, 8, k),
                    rng.uniform(0.3, 0.95, k),
                    rng.integers(0, 2, k),
                    strict=True,
                )
            )
        ]
        margin, rows = (1.0, 500) if trial % 2 else (0.0, 0)
        down = handicap(options, margin, rows)
        rank = {o.entry: o.accuracy - (0 if o.fixed else down) for o in options}
        for mean in (0.0, 0.5, 1.0, 2.5, 4.0, 7.5, 9.0):
            best, pair = -1.0, None
            for o in options:
                if o.cost <= mean and rank[o.entry] > best + 1e-12:
                    best, pair = rank[o.entry], (o, o, 1.0)
            alone = best
            for a, b in itertools.product(options, options):
                if a.cost <= mean < b.cost:
                    share = (b.cost - mean) / (b.cost - a.cost)
                    value = share * rank[a.entry] + (1 - share) * rank[b.entry]
                    # a pair must beat the best single option by the margin's noise
                    if value > best + 1e-12 and value - alone > down + 1e-12:
                        best, pair = value, (a, b, share)
            shared = mean_choice(options, mean, margin=margin, rows=rows)
            if pair is None:
                assert shared is None
                continue
            assert shared is not None
            low, high = shared.of(0.0), shared.of(0.999999)
            a, b, share = pair
            # the item drawn low gets the cheaper vertex, the one drawn high the dearer
            # (one point alone: both); their shared value is the brute force's best
            if low is high:
                assert rank[low.entry] == pytest.approx(best), (trial, mean)
            else:
                assert low.cost <= mean < high.cost
                s = (high.cost - mean) / (high.cost - low.cost)
                value = s * rank[low.entry] + (1 - s) * rank[high.entry]
                assert value == pytest.approx(best), (trial, mean)
            # with a tolerance: the cheapest single option within it of the best average,
            # else the shared pair
            loosely = mean_choice(options, mean, tolerance=0.05, margin=margin, rows=rows)
            loose = None if loosely is None else loosely.of(0.5)
            near = [o for o in options if o.cost <= mean and rank[o.entry] >= best - 0.05]
            if near:
                assert loose is not None and loose.cost == min(o.cost for o in near)
            else:
                assert loose in (low, high)


def test_under_a_mean_budget_a_point_is_an_option_only_if_its_average_fits_the_cap(
    built: tuple[Path, DagSpec, np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    """A DAG policy without capped numbers (the bundle format allows none) whose average
    cost is above the request's max_cost would have its walks cut: it is no option for
    either of a pair, as it is none under a cap (a review found it listed)."""
    out, *_ = built
    bare = tmp_path / "trio"
    shutil.copytree(out, bare)
    manifest_file = bare / "manifest.json"
    raw = json.loads(manifest_file.read_text())
    for strategy in raw["strategies"]:
        for policy in strategy["policies"]:
            policy["capped"] = []
    manifest_file.write_text(json.dumps(raw))
    runtime = load_bundle(bare, 1 << 20).strategy("dag")
    assert isinstance(runtime, DagRuntime)
    dearest = max(p.spec.mean_cost for p in runtime.policies)
    assert 3.0 < dearest < sum(COSTS.values())
    for mean, cap in ((2.0, 2.5), (5.0, 5.0), (3.0, dearest - 0.1)):
        view = runtime.with_options(mean_budget=mean)
        assert isinstance(view, DagRuntime)
        options = view.options(runtime.costs.at(1), cap, frozenset())
        assert options and all(o.cost <= cap for o in options), (mean, cap)
        for draw in (0.0, 0.5, 0.999):
            drawn = view.with_options(mean_draw=draw)
            assert isinstance(drawn, DagRuntime)
            chosen = drawn.choose(cap)
            cost = (
                sum(COSTS[f] for f in runtime.model_features[chosen.model])
                if isinstance(chosen, FixedPoint)
                else chosen.spec.mean_cost
            )
            assert cost <= cap, (mean, cap, draw)
    # with every sensor as the cap, the dearest policy is a pair's dearer point again
    view = runtime.with_options(mean_budget=dearest - 0.5)
    assert isinstance(view, DagRuntime)
    full = sum(COSTS.values())
    assert any(o.cost == dearest for o in view.options(runtime.costs.at(1), full, frozenset()))
