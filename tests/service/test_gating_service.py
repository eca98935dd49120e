"""The gating strategy (paper 001) served end to end: a gating bundle built from real models
(tests/gating_bundle.py), loaded and answered by the real app.

Why one module over 450 lines: every test serves the same built gating bundle and checks it
against the same offline helpers (its points, expected costs, the gate's routing).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator, Set
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.bundle import GatePoint, GatingStrategy, Manifest, read_manifest
from service.cache import InProcessCache
from service.errors import BundleError
from service.http import create_app
from service.registry import load_bundle
from service.settings import Settings
from service.strategies.base import Acquire, Answer, Observation
from tests.support.gating_bundle import (
    COLUMNS,
    COSTS,
    GATE_FILE,
    HIGH,
    HIGH_FEATURES,
    LOW,
    LOW_FEATURES,
    GatingFixture,
    columns_of,
    gate_scores,
    linear_gate,
    make_gating_data,
)
from tests.support.sensor_store import SensorStore, StoreClient

pytestmark = pytest.mark.redis  # rows are acquired from a real Redis


@pytest.fixture(scope="module")
def store(redis_url: str) -> SensorStore:
    """The rows' values live in a real Redis (an online feature store); requests send only
    an id, derived from the row's values unless a test names one."""
    return SensorStore(redis_url, COLUMNS)


@pytest.fixture
def client(gating_bundle_dir: Path, store: SensorStore) -> Iterator[StoreClient]:
    """A fresh app and cache per test: rows without a named id are cached by content."""
    settings = Settings(
        models_dir=gating_bundle_dir.parent, sensor_sources={"gating": {"*": store.source()}}
    )
    app = create_app(settings, cache=InProcessCache(1 << 20))
    with StoreClient(app) as c:
        c.store = store
        yield c


@pytest.fixture(scope="module")
def manifest(gating_bundle_dir: Path) -> Manifest:
    return read_manifest(gating_bundle_dir)


def predict(
    client: StoreClient,
    row: np.ndarray,
    budget: float,
    strategy: str | None = None,
    item_id: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gating",
        "item": client.store.item(row, item_id),
        "budget": budget,
    }
    if strategy is not None:
        body["strategy"] = strategy
    r = client.post("/predict", json=body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def offline_proba(fx: GatingFixture, model: str, row: np.ndarray) -> np.ndarray:
    features = LOW_FEATURES if model == LOW else HIGH_FEATURES
    x = row[columns_of(features)].astype(np.float32).reshape(1, -1)
    return np.asarray(fx.estimators[model].predict_proba(x)[0])


def points_of(manifest: Manifest, strategy: str = "gating") -> list[GatePoint]:
    spec = manifest.strategy(strategy)
    assert isinstance(spec, GatingStrategy)
    return spec.points


def expected_cost(manifest: Manifest, point_id: str, cached: Set[str] = frozenset()) -> float:
    """The point's expected cost, computed from the manifest alone."""
    point = next(p for p in points_of(manifest) if p.id == point_id)
    first = set(point.gate_features) | set(manifest.model(point.low_model).features)
    extra = set(manifest.model(point.high_model).features) - first
    return sum(COSTS[f] for f in first - cached) + point.fraction_full * sum(
        COSTS[f] for f in extra - cached
    )


def best_point(
    manifest: Manifest, budget: float, cached: Set[str] = frozenset(), strategy: str = "gating"
) -> str:
    """The runtime's rule, from the manifest alone: a point delivers its gated accuracy when
    the budget covers f0's missing features too, its f1's accuracy when it covers g's and
    f1's only; within the strategy's tolerance of the best, the cheapest expected cost."""
    spec = manifest.strategy(strategy)
    assert isinstance(spec, GatingStrategy)
    options = []
    for p in spec.points:
        first = set(p.gate_features) | set(manifest.model(p.low_model).features)
        extra = set(manifest.model(p.high_model).features) - first
        c_first = sum(COSTS[f] for f in first - cached)
        c_extra = sum(COSTS[f] for f in extra - cached)
        if c_first + c_extra <= budget:
            options.append((p.id, c_first + p.fraction_full * c_extra, p.accuracy))
        elif c_first <= budget:
            options.append((p.id, c_first, manifest.model(p.low_model).accuracy))
    if not options:
        return min(spec.points, key=lambda p: expected_cost(manifest, p.id, cached)).id
    best = max(acc for _, _, acc in options)
    near = [o for o in options if o[2] >= best - spec.tolerance - 1e-12]
    return min(near, key=lambda o: (o[1], -o[2]))[0]


def test_a_budget_that_covers_only_f1_is_answered_by_f1(
    client: StoreClient, gating_bundle: GatingFixture
) -> None:
    x, _ = make_gating_data(40, seed=11)
    for row in x:
        body = predict(client, row, budget=1.5)
        assert body["answered_by"] == LOW and body["features"] == LOW_FEATURES
        assert body["decision"] == {
            "kind": "gating",
            "point": "low",
            "method": "greedymiser",
            "score": None,
            "sent_to_high": False,
            "answered_by": "low",
        }
        assert body["cost"]["extracted"] == ["a"]
        assert body["cost"]["spent"] == 1.0 <= body["cost"]["budget"]
        assert list(body["probabilities"].values()) == pytest.approx(
            offline_proba(gating_bundle, LOW, row), abs=1e-5
        )


def test_with_budget_to_spare_the_gate_routes_items_as_offline(
    client: StoreClient, gating_bundle: GatingFixture, manifest: Manifest
) -> None:
    x, _ = make_gating_data(80, seed=12)
    scores = gate_scores(x)
    [point] = points_of(manifest, "gate-0")
    classes = manifest.classes
    routed_count = 0
    for row, score in zip(x, scores, strict=True):
        body = predict(client, row, budget=100.0, strategy="gate-0")
        routed = bool(score > point.threshold)
        routed_count += routed
        decision = body["decision"]
        assert decision["score"] == pytest.approx(float(score), abs=1e-6)
        assert decision["sent_to_high"] is routed
        model = HIGH if routed else LOW
        assert body["answered_by"] == model
        assert decision["answered_by"] == ("high" if routed else "low")
        # g's and f1's features for every item, f0's missing ones only for routed items.
        assert body["cost"]["extracted"] == (["g", "a", "b", "c"] if routed else ["g", "a"])
        assert body["cost"]["spent"] == (6.0 if routed else 2.0)
        assert body["path"] == (
            [[], ["g", "a"], ["g", "a", "b", "c"]] if routed else [[], ["g", "a"]]
        )
        proba = offline_proba(gating_bundle, model, row)
        assert list(body["probabilities"].values()) == pytest.approx(proba, abs=1e-5)
        assert body["prediction"] == classes[int(np.argmax(proba))]
        assert body["expected_accuracy"] == point.accuracy
        assert body["cost"]["planned"] == pytest.approx(expected_cost(manifest, "gate-0"))
    assert 20 <= routed_count <= 60, "the sample exercises both branches of the gate"


def test_f0_answers_only_when_its_missing_features_fit(
    client: StoreClient, manifest: Manifest
) -> None:
    # 3 covers g's and f1's features (2) but not f0's missing ones (4): f1 answers everything,
    # routed items included, and nothing of f0's is computed.
    x, _ = make_gating_data(40, seed=13)
    scores = gate_scores(x)
    f1_accuracy = manifest.model(LOW).accuracy
    [point] = points_of(manifest, "gate-0")
    sent = 0
    for row, score in zip(x, scores, strict=True):
        body = predict(client, row, budget=3.0, strategy="gate-0")
        assert body["decision"]["sent_to_high"] is bool(score > 0)
        sent += bool(score > 0)
        assert body["answered_by"] == LOW and body["decision"]["answered_by"] == "low"
        assert body["cost"]["extracted"] == ["g", "a"] and body["cost"]["spent"] == 2.0
        # The gated system's accuracy holds only when f0 can answer routed items: at this
        # budget the point is worth its f1 alone, for every item.
        assert body["expected_accuracy"] == f1_accuracy
    assert 0 < sent < len(x)
    assert point.accuracy != f1_accuracy


def test_the_most_accurate_deliverable_point_is_chosen_by_budget(
    client: StoreClient, manifest: Manifest
) -> None:
    budgets = [0.5, 1.0, 2.0, 2.7, 3.9, 5.9, 6.0, 50.0]
    x, _ = make_gating_data(len(budgets), seed=14)
    chosen = []
    for row, budget in zip(x, budgets, strict=True):
        body = predict(client, row, budget=budget)
        expected = best_point(manifest, budget)
        assert body["decision"]["point"] == expected, budget
        assert body["cost"]["spent"] <= budget
        chosen.append(expected)
    # Below 6 no gated point can pay f0's features for the items it routes, so it would be
    # worth only its f1 (the low point's model) at a higher cost: the low point is served.
    # From 6 every point is deliverable and the most accurate (f0 alone) wins.
    assert chosen == ["low"] * 6 + ["full", "full"]
    # Below the cheapest point, g's and f1's features cannot be bought: the prior answers.
    first = predict(client, x[0] + 1.0, budget=0.5)
    assert first["answered_by"] == "prior" and first["decision"]["answered_by"] == "fallback"
    assert first["cost"]["spent"] == 0.0 and first["cost"]["extracted"] == []


@pytest.mark.parametrize(
    ("tolerance", "point"), [(0.0, "full"), (0.02, "gate-0"), (0.2, "gate-1"), (0.5, "low")]
)
def test_tolerance_trades_a_little_accuracy_for_a_lower_average_cost(
    gating_bundle_dir: Path, store: SensorStore, tmp_path: Path, tolerance: float, point: str
) -> None:
    def set_tolerance(m: dict[str, Any], _: Path) -> None:
        m["strategies"][0]["tolerance"] = tolerance

    folder = _copy(gating_bundle_dir, tmp_path, set_tolerance)
    manifest = read_manifest(folder)
    assert best_point(manifest, 50.0) == point
    settings = Settings(models_dir=tmp_path, sensor_sources={"gating": {"*": store.source()}})
    app = create_app(settings, cache=InProcessCache(1 << 20))
    x, _ = make_gating_data(30, seed=16)
    with StoreClient(app) as c:
        c.store = store
        bodies = [predict(c, row, budget=50.0) for row in x]
    assert {b["decision"]["point"] for b in bodies} == {point}
    spent = float(np.mean([b["cost"]["spent"] for b in bodies]))
    assert spent <= 6.0
    if point != "full":
        assert spent < 6.0  # the gate keeps some items away from f0's features


def test_cached_features_make_a_point_affordable(client: StoreClient, manifest: Manifest) -> None:
    x, _ = make_gating_data(2, seed=15)
    row = x[0]
    budget = 4.5
    cold = predict(client, row, budget=budget, item_id="cold")
    assert cold["decision"]["point"] == best_point(manifest, budget) == "low"
    # A first request buys g and a (gate-0 pinned, at a budget that pays only them), so a
    # second request at the same budget can pay f0's remaining features: every point is
    # deliverable and the most accurate one (f0 alone) is served.
    first = predict(client, row, budget=2.5, strategy="gate-0", item_id="warm")
    assert first["cost"]["extracted"] == ["g", "a"]
    warm = predict(client, row, budget=budget, item_id="warm")
    assert sorted(warm["cost"]["cached"]) == ["a", "g"]
    assert warm["decision"]["point"] == best_point(manifest, budget, {"a", "g"}) == "full"
    assert warm["cost"]["planned"] == pytest.approx(expected_cost(manifest, "full", {"a", "g"}))
    assert warm["answered_by"] == HIGH and warm["decision"]["answered_by"] == "high"


def test_skyline_lists_points_by_expected_cost(client: StoreClient, manifest: Manifest) -> None:
    body = client.get("/models/gating/skyline", params={"size": 1}).json()
    assert body["strategy"] == "gating"
    points = {p.id: p for p in points_of(manifest)}
    ids = [entry["model"] for entry in body["skyline"]]
    assert ids == ["low", "gate-1", "gate-0", "full"]
    for entry in body["skyline"]:
        assert entry["cost"] == pytest.approx(expected_cost(manifest, entry["model"]))
        assert entry["accuracy"] == points[entry["model"]].accuracy
    assert [e["features"] for e in body["skyline"]] == [
        ["a"],
        ["g", "a"],
        ["g", "a"],
        HIGH_FEATURES,
    ]
    summary = client.get("/models/gating").json()
    gating = next(s for s in summary["strategies"] if s["name"] == "gating")
    assert gating["kind"] == "gating" and [p["id"] for p in gating["points"]] == list(points)


def test_f0_features_that_stop_fitting_midway_leave_the_answer_to_f1(
    gating_bundle_dir: Path,
) -> None:
    runtime = load_bundle(gating_bundle_dir, 1).runtimes["gate-0"]
    row = np.array([0.5, -2.0, 1.0, 0.3])  # g < 0: the gate sends it to f0
    values = {"a": row[:1], "g": row[1:2], "b": row[2:3], "c": row[3:4]}
    session = runtime.begin(1, 6.0, frozenset())
    in_hand: dict[str, np.ndarray] = {}
    spent, steps = 0.0, []
    while True:
        step = session.step(Observation(size=1, budget=6.0, spent=spent, features=in_hand))
        if isinstance(step, Answer):
            break
        assert isinstance(step, Acquire)
        steps.append(step.feature)
        in_hand[step.feature] = values[step.feature].astype(np.float32)
        # b takes 3 instead of its predicted 2: c (2) no longer fits the 1 left.
        spent += 3.0 if step.feature == "b" else COSTS[step.feature]
    assert steps == ["g", "a", "b"]
    assert step.model == LOW
    assert session.report() == {
        "kind": "gating",
        "point": "gate-0",
        "method": "adapt-lin",
        "score": pytest.approx(float(gate_scores(row[None])[0])),
        "sent_to_high": True,
        "answered_by": "low",
    }
    assert session.expected_accuracy is None, "f1's own accuracy, not the gated system's"


def _copy(src: Path, root: Path, mutate: Callable[[dict[str, Any], Path], None]) -> Path:
    folder = root / "gating"
    shutil.copytree(src, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    mutate(manifest, folder)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _gate0(manifest: dict[str, Any]) -> dict[str, Any]:
    point: dict[str, Any] = manifest["strategies"][1]["points"][0]
    return point


def _same_models(m: dict[str, Any], _: Path) -> None:
    _gate0(m).update(low_model=HIGH, high_model=HIGH)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m, d: (d / GATE_FILE).write_bytes(linear_gate([1.0, 2.0, 3.0], 0.0)),
            "gate 'gate_g.onnx' takes 3 inputs, its gate_features ['g'] give 1",
        ),
        (lambda m, d: (d / GATE_FILE).unlink(), "ONNX file 'gate_g.onnx' is missing"),
        (
            lambda m, d: (d / GATE_FILE).write_bytes(linear_gate([1.0], 0.0, outputs=2)),
            "outputs shape (1, 2), expected (1, 1)",
        ),
        (_same_models, "chooses between 'a+b+c+g' and itself"),
    ],
    ids=["gate-width", "gate-missing", "gate-outputs", "same-models"],
)
def test_broken_gates_fail_loading_with_a_clear_reason(
    gating_bundle_dir: Path,
    tmp_path: Path,
    mutate: Callable[[dict[str, Any], Path], None],
    message: str,
) -> None:
    folder = _copy(gating_bundle_dir, tmp_path, mutate)
    with pytest.raises(BundleError, match=r"gating strategy '.*', point 'gate-[01]'") as info:
        load_bundle(folder, 1)
    assert message in str(info.value)
    app = create_app(Settings(models_dir=tmp_path), cache=InProcessCache(1 << 20))
    with TestClient(app) as c:
        listed = c.get("/models").json()
        assert listed["models"] == []
        assert message in next(f["error"] for f in listed["failed"] if f["name"] == "gating")
        r = c.post(
            "/predict",
            json={
                "model": "gating",
                "item": {"values": dict.fromkeys(COLUMNS, 0.0)},
                "budget": 10.0,
            },
        )
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_not_ready"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("low_model", "nope", "references unknown models ['nope']"),
        ("high_model", "nope", "references unknown models ['nope']"),
        ("gate_features", ["zz"], "reads undeclared extractors ['zz']"),
        ("gate_input_dims", 2, "gate_input_dims disagrees with its extractors"),
        ("gate_file", None, "gate features without a gate file"),
        ("id", "low", "duplicate point ids"),
    ],
)
def test_invalid_gating_manifests_are_rejected(
    manifest: Manifest, field: str, value: Any, message: str
) -> None:
    raw = manifest.model_dump(mode="json")
    Manifest.model_validate(raw)  # the untouched manifest is valid
    point = next(p for p in raw["strategies"][0]["points"] if p["id"] == "gate-0")
    point[field] = value
    with pytest.raises(ValidationError, match=re.escape(message)):
        Manifest.model_validate(raw)


def test_partial_items_without_a_source_name_the_feature_the_gate_wants(
    gating_bundle_dir: Path, manifest: Manifest
) -> None:
    """g's and f1's values sent, no sensor source: the gate runs on what was sent; an item it
    routes to f0 is answered by f1 and names f0's first missing feature as next_sensor."""
    x, _ = make_gating_data(60, seed=17)
    scores = gate_scores(x)
    [point] = points_of(manifest, "gate-0")
    app = create_app(Settings(models_dir=gating_bundle_dir.parent), cache=InProcessCache(1 << 20))
    routed_count = 0
    with TestClient(app) as c:
        for row, score in zip(x, scores, strict=True):
            values = {"a1": float(row[0]), "g1": float(row[1])}
            r = c.post(
                "/predict",
                json={
                    "model": "gating",
                    "strategy": "gate-0",
                    "budget": 100.0,
                    "item": {"values": values},
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            routed = bool(score > point.threshold)
            routed_count += routed
            assert body["answered_by"] == LOW and body["decision"]["sent_to_high"] is routed
            assert sorted(body["cost"]["given"]) == ["a", "g"] and body["cost"]["spent"] == 0.0
            assert body["next_sensor"] == ("b" if routed else None)
            if routed:
                assert "BUDGETSERVE_SENSOR_SOURCES" in body["unavailable"]["b"]
    assert 0 < routed_count < len(x)


def test_a_request_sends_its_own_tolerance_and_bad_ones_are_422(
    client: StoreClient, manifest: Manifest
) -> None:
    """The same choice as a manifest's tolerance (the test above), asked per request of the
    unchanged bundle; a strategy that takes no tolerance, or a tolerance outside [0, 1],
    is a 422 that says so."""
    spec = manifest.strategy("gating")
    assert isinstance(spec, GatingStrategy)
    x, _ = make_gating_data(6, seed=17)
    for tolerance, point in ((0.0, "full"), (0.02, "gate-0"), (0.2, "gate-1"), (0.5, "low")):
        for i, row in enumerate(x):
            body = {
                "model": "gating",
                "item": client.store.item(row, f"tol-{tolerance}-{i}"),
                "budget": 50.0,
                "tolerance": tolerance,
            }
            r = client.post("/predict", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["decision"]["point"] == point, (tolerance, r.json()["decision"])
    # the bundle's own tolerance is untouched by the requests
    default = predict(client, x[0], budget=50.0)["decision"]["point"]
    assert default == best_point(manifest, 50.0)
    bad: list[tuple[object, str]] = [(1.5, "less than or equal to 1"), ("0.1", "valid number")]
    for wrong, says in bad:
        r = client.post(
            "/predict",
            json={"model": "gating", "item": {"id": "t"}, "budget": 5.0, "tolerance": wrong},
        )
        assert r.status_code == 422 and says in r.text, r.text


def test_a_tolerance_goes_with_batch_items_and_the_open_inference_protocol(
    client: StoreClient,
) -> None:
    """The per-request tolerance of the test above, sent with a batch (each item's, under
    ``budget`` or ``total_budget``) and over HTTP v2 (``parameters.tolerance``, one item or
    several: items by id, their sensors in Redis): each item gets the point a single request
    with that tolerance gets; a tolerance outside [0, 1] is refused there too."""
    x, _ = make_gating_data(3, seed=23)
    for tolerance, point in ((0.0, "full"), (0.2, "gate-1"), (0.5, "low")):
        items = [client.store.item(row, f"each-{tolerance}-{i}") for i, row in enumerate(x)]
        body = {"model": "gating", "items": items, "tolerance": tolerance, "budget": 50.0}
        r = client.post("/predict", json=body)
        assert r.status_code == 200, r.text
        assert [a["decision"]["point"] for a in r.json()["results"]] == [point] * 3
        # Under a total the plan gives each item its own budget; with the tolerance, each
        # gets the point a single request with that budget and tolerance gets.
        items = [client.store.item(row, f"total-{tolerance}-{i}") for i, row in enumerate(x)]
        body = {"model": "gating", "items": items, "tolerance": tolerance, "total_budget": 60.0}
        r = client.post("/predict", json=body)
        assert r.status_code == 200, r.text
        for i, answer in enumerate(r.json()["results"]):
            alone = {
                "model": "gating",
                "item": client.store.item(x[i], f"alone-{tolerance}-{i}"),
                "budget": answer["cost"]["budget"],
                "tolerance": tolerance,
            }
            single = client.post("/predict", json=alone).json()
            assert answer["decision"]["point"] == single["decision"]["point"], (tolerance, i)
        for n in (3, 1):
            ids = [f"v2-{tolerance}-{n}-{i}" for i in range(n)]
            for i, row in enumerate(x[:n]):
                client.store.put(row, ids[i])
            body = {
                "inputs": [{"name": "ID", "shape": [n], "datatype": "BYTES", "data": ids}],
                "parameters": {"budget": 50.0, "tolerance": tolerance},
                "outputs": [{"name": "RESPONSE"}],
            }
            r = client.post("/v2/models/gating/infer", json=body)
            assert r.status_code == 200, r.text
            answers = [json.loads(a) for a in r.json()["outputs"][0]["data"]]
            assert [a["decision"]["point"] for a in answers] == [point] * n, (tolerance, n)
    body["parameters"] = {"budget": 50.0, "tolerance": 1.5}
    r = client.post("/v2/models/gating/infer", json=body)
    assert r.status_code == 400 and "tolerance must be a number in [0, 1]" in r.text, r.text
    r = client.post(
        "/predict",
        json={"model": "gating", "items": [{"id": "t"}], "budget": 5.0, "tolerance": 2},
    )
    assert r.status_code == 422 and "less than or equal to 1" in r.text, r.text


def test_a_strategy_without_a_tolerance_refuses_one_and_a_mean_budget(
    tiny_bundle_dir: Path,
) -> None:
    from tests.conftest import digit_image, png_b64

    settings = Settings(models_dir=tiny_bundle_dir.parent)
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as c:
        item = {"png_base64": png_b64(digit_image(3, 32))}
        r = c.post(
            "/predict", json={"model": "tiny", "item": item, "budget": 5.0, "tolerance": 0.1}
        )
        assert r.status_code == 422, r.text
        assert "takes no per-request 'tolerance'" in r.json()["error"]["message"]
        r = c.post(
            "/predict",
            json={"model": "tiny", "item": item, "budget": 5.0, "budget_mode": "mean"},
        )
        assert r.status_code == 422, r.text
        assert "budget_mode 'mean' needs a tabular adaptive strategy" in r.text
        r = c.post("/predict", json={"model": "tiny", "item": item, "budget": 5.0})
        assert r.status_code == 200, r.text
