"""The cstc strategy (paper 003) served end to end: a bundle built by the real builder,
loaded by the real app, sensors acquired from a real Redis; the served walk must be the
trained model's (path, features acquired per node, cost, prediction) on held-out rows."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from service.bundle import CstcStrategy
from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.support.cstc_bundle import COLUMNS, COSTS, SENSORS, build
from tests.support.sensor_store import SensorStore, StoreClient
from training.bundles.cstc import CstcBuildResult, exit_answers

pytestmark = pytest.mark.redis

NAME = "trees"
SENSOR_NAMES = list(SENSORS)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> CstcBuildResult:
    return build(tmp_path_factory.mktemp("cstc") / NAME)


@pytest.fixture
def client(built: CstcBuildResult, redis_url: str) -> Iterator[StoreClient]:
    store = SensorStore(redis_url, COLUMNS)
    settings = Settings(models_dir=built.path.parent, sensor_sources={NAME: {"*": store.source()}})
    app = create_app(settings, cache=InProcessCache(1 << 20))
    with StoreClient(app) as c:
        c.store = store
        yield c


def predict(
    client: StoreClient, row: np.ndarray, budget: float, item_id: str | None = None
) -> dict[str, Any]:
    body = {"model": NAME, "item": client.store.item(row, item_id), "budget": budget}
    r = client.post("/predict", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def strategy(built: CstcBuildResult) -> CstcStrategy:
    spec = built.manifest.strategy("cstc")
    assert isinstance(spec, CstcStrategy)
    return spec


def check_walk(built: CstcBuildResult, body: dict[str, Any], row: np.ndarray) -> None:
    """The served walk is the trained estimator's on this row."""
    decision = body["decision"]
    est = built.estimators[decision["point"]]
    walk = est.walk(row.reshape(1, -1))[0]
    assert decision["nodes"] == walk.path
    assert decision["acquired"] == [[SENSOR_NAMES[g] for g in a] for a in walk.acquired]
    assert body["cost"]["spent"] == pytest.approx(walk.cost)
    assert sorted(body["cost"]["extracted"]) == sorted(
        SENSOR_NAMES[g] for a in walk.acquired for g in a
    )
    assert body["prediction"] == est.predict(row.reshape(1, -1))[0]
    proba = est.predict_proba(row.reshape(1, -1))[0]
    served = np.asarray([body["probabilities"][str(c)] for c in est.classes_])
    np.testing.assert_allclose(served, proba, atol=1e-4)
    assert body["answered_by"] == f"{decision['point']}.n{walk.node}"
    assert not decision["stopped_by_budget"]


def test_served_walk_equals_the_trained_one(client: StoreClient, built: CstcBuildResult) -> None:
    assert built.test_rows is not None
    X_test, y_test = built.test_rows
    best = max(strategy(built).points, key=lambda p: p.accuracy)
    budget = 1000.0  # covers every path: the most accurate point, never cut short
    correct = 0
    for row, label in zip(X_test[:60], y_test[:60], strict=True):
        body = predict(client, row, budget)
        assert body["strategy"] == "cstc" and body["decision"]["point"] == best.id
        check_walk(built, body, row)
        assert len(body["path"]) == len(body["decision"]["nodes"])
        correct += body["prediction"] == label
    assert correct / 60 > 0.75  # held-out rows; the prior is ~0.4


def test_budget_is_a_hard_cap_and_cached_features_are_free(
    client: StoreClient, built: CstcBuildResult
) -> None:
    assert built.test_rows is not None
    X_test, _ = built.test_rows
    # The most accurate point's average cost: it is chosen, and rows whose path costs more
    # than the average are cut short.
    budget = max(strategy(built).points, key=lambda p: p.accuracy).mean_cost
    cut = whole = 0
    for i, row in enumerate(X_test[60:120]):
        body = predict(client, row, budget, item_id=f"cap-{i}")
        assert body["cost"]["spent"] <= budget + 1e-9
        est = built.estimators[body["decision"]["point"]]
        walk = est.walk(row.reshape(1, -1))[0]
        if walk.cost <= budget:
            check_walk(built, body, row)
            whole += 1
        else:  # the walk stopped at a node it could pay for, a prefix of the trained path
            nodes = body["decision"]["nodes"]
            assert body["decision"]["stopped_by_budget"]
            assert nodes == walk.path[: len(nodes)]
            cut += 1
        # the same item again: its features come from the cache, at no cost
        again = predict(client, row, 1000.0, item_id=f"cap-{i}")
        assert set(again["cost"]["cached"]) >= set(body["cost"]["extracted"])
        spent_again = sum(again["cost"]["charged"].values())
        assert again["cost"]["spent"] == pytest.approx(spent_again)
        assert not set(again["cost"]["extracted"]) & set(body["cost"]["extracted"])
    assert whole > 0 and cut > 0, (whole, cut)


def test_a_budget_below_the_root_answers_from_the_prior(
    client: StoreClient, built: CstcBuildResult
) -> None:
    assert built.test_rows is not None
    row = built.test_rows[0][0]
    cheapest_root = min(
        sum({"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0}[f] for f in p.nodes[0].features)
        for p in strategy(built).points
    )
    assert cheapest_root > 0
    body = predict(client, row, cheapest_root / 2, item_id="poor")
    assert body["answered_by"] == "prior"
    assert body["cost"]["spent"] == 0
    assert body["decision"]["stopped_by_budget"] and body["decision"]["nodes"] == []
    assert body["next_sensor"] is None


def test_models_endpoint_describes_the_points(client: StoreClient, built: CstcBuildResult) -> None:
    r = client.get(f"/models/{NAME}")
    assert r.status_code == 200
    text = r.text
    for p in strategy(built).points:
        assert p.id in text


@pytest.fixture(scope="module")
def cascades(tmp_path_factory: pytest.TempPathFactory) -> CstcBuildResult:
    return build(tmp_path_factory.mktemp("cscc") / NAME, methods=["cscc", "cronus"])


def test_served_cascade_walks_equal_the_trained_ones(
    cascades: CstcBuildResult, redis_url: str
) -> None:
    """Cascade points (CSCC, Cronus) served at budgets that choose them: each walk that fits
    its budget is the trained cascade's, early exits included."""
    assert cascades.test_rows is not None
    X_test = cascades.test_rows[0][:40]
    points = strategy(cascades).points
    assert {p.method for p in points} <= {"cscc", "cronus"} and points
    longest = {
        p.id: max(len(w.path) for w in cascades.estimators[p.id].walk(X_test)) for p in points
    }
    store = SensorStore(redis_url, COLUMNS)
    settings = Settings(
        models_dir=cascades.path.parent, sensor_sources={NAME: {"*": store.source()}}
    )
    walked: set[str] = set()
    exits = 0
    with StoreClient(create_app(settings, cache=InProcessCache(1 << 20))) as client:
        client.store = store
        for budget in sorted({p.mean_cost for p in points} | {1000.0}):
            for i, row in enumerate(X_test):
                body = predict(client, row, budget, item_id=f"cascade-{budget}-{i}")
                point = body["decision"]["point"]
                walk = cascades.estimators[point].walk(row.reshape(1, -1))[0]
                if walk.cost <= budget:
                    check_walk(cascades, body, row)
                    walked.add(point)
                    exits += len(walk.path) < longest[point]
    methods = {p.method for p in points if p.id in walked}
    assert "cscc" in methods or "cscc" not in {p.method for p in points}, (walked, points)
    assert exits > 0, "no row left a cascade early"


def test_points_are_priced_on_validation_rows_never_test(built: CstcBuildResult) -> None:
    """The service chooses a point by the accuracy and cost in the manifest: those are the
    validation rows' (test rows only check the export and are reported in the sweep)."""
    sweep = {row["id"]: row for row in built.manifest.provenance.parameters["sweep"]}
    for point in strategy(built).points:
        assert point.accuracy == sweep[point.id]["validation_accuracy"]
        assert point.mean_cost == pytest.approx(sweep[point.id]["validation_cost"])
    assert any(row["validation_accuracy"] != row["test_accuracy"] for row in sweep.values()), (
        "validation and test agree everywhere: this check could not tell them apart"
    )


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> CstcBuildResult:
    return build(tmp_path_factory.mktemp("cstc-tuned") / "tuned", tuned=True)


def test_refit_nodes_answer_with_what_the_path_bought_as_trained(
    tuned: CstcBuildResult, redis_url: str
) -> None:
    """With node_models: tuned each node answers with the fixed-subset model of every sensor
    its path bought: served (each point pinned alone) the walk is the trained tree's and the
    answer the refit node model's; and the default strategy serves, at a budget covering
    everything, the most accurate point on validation among the points and fixed subsets."""
    from service.bundle import write_manifest

    manifest = tuned.manifest
    spec = manifest.strategy("cstc")
    assert isinstance(spec, CstcStrategy) and spec.fixed
    for point in spec.points:
        held = point.ancestors_features()
        for k, node in enumerate(point.nodes):
            model = manifest.model(node.model)
            assert set(model.features) == set(node.features) | held[k], (point.id, k)
    pinned = [
        spec.model_copy(update={"name": f"only-{p.id}", "points": [p], "fixed": []})
        for p in spec.points
    ]
    write_manifest(tuned.path, manifest.model_copy(update={"strategies": [spec, *pinned]}))
    store = SensorStore(redis_url, COLUMNS)
    settings = Settings(
        models_dir=tuned.path.parent, sensor_sources={"tuned": {"*": store.source()}}
    )
    assert tuned.test_rows is not None
    X_test, _ = tuned.test_rows
    classes = np.asarray(manifest.classes)
    exits: Counter[str] = Counter()  # exit points' methods, per row walked
    early = 0  # rows a tree's exit answered before a leaf
    with StoreClient(create_app(settings, cache=InProcessCache(1 << 20))) as client:
        for point in spec.points:
            est, fits = tuned.estimators[point.id], tuned.node_fits[point.id]
            for i, row in enumerate(X_test[:15]):
                body = {
                    "model": "tuned",
                    "strategy": f"only-{point.id}",
                    "item": store.item(row, f"{point.id}/{i}"),
                    "budget": 1000.0,
                }
                answer = client.post("/predict", json=body).json()
                at = [n.exit_confidence is not None for n in point.nodes]
                if not any(at):
                    walk = est.walk(row.reshape(1, -1))[0]
                    path, end = walk.path, walk.node
                else:  # confidence exits: the walk leaves where the node's model is sure
                    exits[point.method] += 1
                    level = next(n.exit_confidence for n in point.nodes if n.exit_confidence)
                    costs = [COSTS[s] for s in SENSORS]
                    _, cost, ends, paths = exit_answers(
                        est, fits, level, row.reshape(1, -1), costs, at
                    )
                    end, path = int(ends[0]), paths[0]
                    assert answer["cost"]["spent"] == pytest.approx(cost[0]), (point.id, i)
                    node = point.nodes[end]
                    early += point.method == "cstc-exit" and node.upper is not None
                assert answer["decision"]["nodes"] == path, (point.id, i)
                want = classes[np.argmax(fits[end].predict_proba(row.reshape(1, -1))[0])]
                assert answer["prediction"] == want, (point.id, i)
        body = {"model": "tuned", "item": store.item(X_test[0], "best"), "budget": 1000.0}
        served = client.post("/predict", json=body).json()["decision"]["point"]
    # adaptive points are ranked `margin` standard errors of the best fixed subset down
    best_fixed = max(f.accuracy for f in spec.fixed)
    down = spec.margin * math.sqrt(best_fixed * (1 - best_fixed) / spec.validation_rows)
    ranks = {p.id: p.accuracy - down for p in spec.points} | {
        f.model: f.accuracy for f in spec.fixed
    }
    assert ranks[served] == pytest.approx(max(ranks.values()))
    assert exits["cscc-exit"] and exits["cstc-exit"], f"exit points served: {exits}"
    assert early, "no row left a tree at a routing node by its confidence exit"


def test_a_tree_exit_point_is_checked_when_the_manifest_is_read(tuned: CstcBuildResult) -> None:
    """A tree's exit point keeps its routing weights on the nodes that route both ways; a
    leaf given an exit (nowhere to go on to) or a two-way exit node without weights is
    refused, with which node and why."""
    from pydantic import ValidationError

    from service.bundle import CstcPoint

    point = next(p for p in strategy(tuned).points if p.method == "cstc-exit")
    two_way = [
        k
        for k, n in enumerate(point.nodes)
        if n.upper is not None and n.lower is not None and n.features
    ]
    assert two_way and all(point.nodes[k].exit_confidence for k in two_way)
    assert all(point.nodes[k].scores_routes and point.nodes[k].route_weights for k in two_way)
    leaf = next(k for k, n in enumerate(point.nodes) if n.upper is None and n.lower is None)
    assert point.nodes[leaf].exit_confidence is None
    raw = point.model_dump()
    raw["nodes"][leaf]["exit_confidence"] = 0.9
    with pytest.raises(ValidationError, match=f"node {leaf} has a confidence exit but no child"):
        CstcPoint.model_validate(raw)
    raw = point.model_dump()
    raw["nodes"][two_way[0]]["route_weights"] = []
    with pytest.raises(ValidationError, match=f"node {two_way[0]} routes without weights"):
        CstcPoint.model_validate(raw)


def test_exit_walks_cut_by_a_cap_are_the_trained_walks_cut_there(tuned: CstcBuildResult) -> None:
    """Under a per-item cap an exit point's served walk (the runtime's session, step by
    step) is the trained exit walk cut before the first node it cannot pay for, and the node
    reached last answers: what ``capped_point`` priced the point's capped numbers with."""
    from service.registry import load_bundle
    from service.strategies.base import Acquire, Observation
    from service.strategies.cstc import CstcRuntime, CstcSession
    from training.bundles.cstc import held_costs

    bundle = load_bundle(tuned.path, 1 << 20)
    runtime = bundle.runtimes["cstc"]
    assert isinstance(runtime, CstcRuntime)
    assert tuned.test_rows is not None
    X_test = tuned.test_rows[0][:40]
    costs = [COSTS[s] for s in SENSORS]
    where = {s: [COLUMNS.index(c) for c in cols] for s, cols in SENSORS.items()}
    points = [p for p in strategy(tuned).points if p.method.endswith("-exit")]
    assert {p.method for p in points} == {"cscc-exit", "cstc-exit"}
    cut = 0
    for point in points:
        est, fits = tuned.estimators[point.id], tuned.node_fits[point.id]
        at = [n.exit_confidence is not None for n in point.nodes]
        level = next(n.exit_confidence for n in point.nodes if n.exit_confidence)
        paths = exit_answers(est, fits, level, X_test, costs, at)[3]
        held = held_costs(est, costs)
        for cap in (0.5, 1.0, 3.0, 7.0, 15.0):
            for i, row in enumerate(X_test):
                session = CstcSession(runtime, point, dict(COSTS))
                features: dict[str, np.ndarray] = {}
                spent = 0.0
                step = session.step(Observation(1, cap, spent, features))
                while isinstance(step, Acquire):
                    features[step.feature] = row[where[step.feature]].astype(np.float32)
                    spent += COSTS[step.feature]
                    step = session.step(Observation(1, cap, spent, features))
                entered = [k for k in paths[i] if held[k] <= cap + 1e-9]
                assert session.visited == entered, (point.id, cap, i)
                if entered:
                    assert step.model == point.nodes[entered[-1]].model, (point.id, cap, i)
                cut += len(entered) < len(paths[i])
    assert cut > 0, "no cap cut a walk short: the check saw no capped walk"
