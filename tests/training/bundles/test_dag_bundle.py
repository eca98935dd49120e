"""A DAG bundle end to end: built from tabular data by the real builder, served by the app."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.bundle import DagStrategy, read_manifest
from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.support.sensor_store import SensorStore
from training.bundles.dag import DagSpec, build_dag_bundle
from training.data.synthetic import make_router_data

COLUMNS = ["r", "a1", "a2", "b1", "b2"]
SPEC = DagSpec(
    name="router",
    label="label",
    sensors={"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
    costs={"r": 1.0, "a": 5.0, "b": 5.0},
    cost_scales=[0.0, 0.03, 0.3],
    bank="learner",  # as the router fixture (tests/conftest.py): the DAG's walks alone
    fixed=False,
)

pytestmark = pytest.mark.redis  # rows are acquired from a real Redis


@pytest.fixture(scope="module")
def router_dir(router_bundle_dir: Path) -> Path:
    return router_bundle_dir


@pytest.fixture(scope="module")
def store(redis_url: str) -> SensorStore:
    """The rows' sensor values live in a real Redis; requests send only the row's id."""
    return SensorStore(redis_url, COLUMNS)


@pytest.fixture(scope="module")
def client(router_dir: Path, store: SensorStore) -> Iterator[TestClient]:
    settings = Settings(
        models_dir=router_dir.parent, sensor_sources={"router": {"*": store.source()}}
    )
    app = create_app(settings, cache=InProcessCache(1 << 20))
    with TestClient(app) as c:
        yield c


def _values(x: np.ndarray) -> dict[str, object]:
    return {"values": dict(zip(COLUMNS, map(float, x), strict=True))}


def test_manifest_declares_sensors_and_policies(router_dir: Path) -> None:
    m = read_manifest(router_dir)
    assert m.cost_basis == "declared" and m.cost_unit == "units"
    assert [(e.name, e.plugin, e.cost(1)) for e in m.extractors] == [
        ("r", "sensor", 1.0),
        ("a", "sensor", 5.0),
        ("b", "sensor", 5.0),
    ]
    [dag] = m.strategies
    # The spec's three scales, then those the adaptive grid added (16 at most by default).
    assert dag.kind == "dag" and 3 <= len(dag.policies) <= 3 + 16
    assert [p.cost_scale for p in dag.policies[:3]] == [0.0, 0.03, 0.3]
    assert all((router_dir / p.file).is_file() for p in dag.policies)
    assert m.provenance.parameters["learner"] == "linear"


def test_dag_routes_each_item_to_the_sensor_that_holds_its_answer(
    client: TestClient, store: SensorStore
) -> None:
    x, y = make_router_data(200, seed=9)
    right, routed, costs = 0, 0, []
    for i, (row, label) in enumerate(zip(x, y, strict=True)):
        r = client.post(
            "/predict", json={"model": "router", "item": store.item(row, f"r{i}"), "budget": 6.0}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["strategy"] == "dag" and body["cost"]["unit"] == "units"
        path = body["path"]
        assert path[0] == [] and path[1] == ["r"], path
        expected = "a" if row[0] > 0 else "b"
        routed += len(path) == 3 and set(path[2]) == {"r", expected}
        assert body["cost"]["charged"] == {
            s: {"r": 1.0, "a": 5.0, "b": 5.0}[s] for s in body["cost"]["extracted"]
        }
        assert body["cost"]["spent"] == pytest.approx(sum(body["cost"]["charged"].values()))
        assert body["cost"]["given"] == [] and body["next_sensor"] is None
        assert body["cost"]["spent"] <= 6.0
        costs.append(body["cost"]["spent"])
        right += body["prediction"] == str(label)
    assert right / len(y) > 0.95
    assert routed / len(y) > 0.9, "the router sensor decides which expensive sensor to buy"
    assert np.mean(costs) == pytest.approx(6.0, abs=0.3)


@pytest.mark.parametrize("budget", [0.5, 1.0, 3.0, 5.5, 11.0])
def test_budget_is_a_hard_cap(client: TestClient, store: SensorStore, budget: float) -> None:
    x, _ = make_router_data(40, seed=3)
    for i, row in enumerate(x):
        item = store.item(row, f"cap-{budget}-{i}")
        body = client.post(
            "/predict", json={"model": "router", "item": item, "budget": budget}
        ).json()
        assert body["cost"]["spent"] <= budget
        assert body["deadline_exceeded"] is False
        # (a sensor bought at an earlier budget for the same row is in the cache)
        assert set(body["features"]) <= {*body["cost"]["extracted"], *body["cost"]["cached"]}


def test_values_sent_are_in_hand_and_free(client: TestClient) -> None:
    x, _ = make_router_data(20, seed=12)
    for row in x:
        body = client.post(
            "/predict", json={"model": "router", "item": _values(row), "budget": 6.0}
        ).json()
        assert body["cost"]["spent"] == 0.0 and body["cost"]["extracted"] == []
        assert sorted(body["cost"]["given"]) == ["a", "b", "r"] and body["next_sensor"] is None
        assert set(body["features"]) <= {"a", "b", "r"} and body["answered_by"] != "prior"


def test_values_in_hand_beyond_the_walk_are_never_ignored(
    client: TestClient, router_dir: Path
) -> None:
    # With every value sent, the policy still stops at a state of r and a or b; the answer
    # must come from the most accurate model the values in hand compute, not the state's.
    from service.registry import load_bundle

    runtime = load_bundle(router_dir, 1).runtimes["dag"]
    best = runtime.best_computable({"r", "a", "b"})
    x, _ = make_router_data(20, seed=13)
    stopped_short = 0
    for row in x:
        body = client.post(
            "/predict", json={"model": "router", "item": _values(row), "budget": 6.0}
        ).json()
        stopped_short += set(body["path"][-1]) != {"r", "a", "b"}
        assert runtime.accuracy[body["answered_by"]] == runtime.accuracy[best], body
        assert body["expected_accuracy"] == pytest.approx(runtime.accuracy[best])
    assert stopped_short, "the walks must stop short of every sensor for this test to mean much"


def test_cached_sensors_are_free(client: TestClient, store: SensorStore) -> None:
    x, _ = make_router_data(1, seed=4)
    body = {"model": "router", "item": store.item(x[0], "cached-row"), "budget": 6.0}
    first = client.post("/predict", json=body).json()
    second = client.post("/predict", json=body).json()
    assert first["cost"]["spent"] > 0
    assert second["cost"]["spent"] == 0.0
    assert set(first["cost"]["extracted"]) == set(second["cost"]["cached"])
    assert second["prediction"] == first["prediction"]


@pytest.mark.parametrize(
    ("item", "mentions"),
    [
        ({"values": {"r": 1.0, "zz": 2.0}}, "'zz'"),
        ({"values": {"r": "high"}}, "values.r"),
        ({"id": 7}, "item.id"),
    ],
)
def test_tabular_bad_input_is_a_422(client: TestClient, item: object, mentions: str) -> None:
    r = client.post("/predict", json={"model": "router", "budget": 6.0, "item": item})
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_item"
    assert mentions in r.json()["error"]["message"]


def test_cli_builds_from_csv_and_spec(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from training.cli import app

    x, y = make_router_data(600, seed=5)
    lines = [",".join([*COLUMNS, "label"])]
    lines += [",".join([*map(str, row), str(label)]) for row, label in zip(x, y, strict=True)]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    spec: dict[str, Any] = {
        "name": "router2",
        "label": "label",
        "sensors": SPEC.sensors,
        "costs": SPEC.costs,
        "cost_scales": [0.03],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = CliRunner().invoke(
        app,
        [
            "dag",
            "--csv",
            str(tmp_path / "data.csv"),
            "--spec",
            str(tmp_path / "spec.json"),
            "--out",
            str(tmp_path / "router2"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path / "router2").name == "router2"
    bad = {**spec, "sensors": {**SPEC.sensors, "r": ["r", "nope"]}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    result = CliRunner().invoke(
        app, ["dag", "--csv", str(tmp_path / "data.csv"), "--spec", str(tmp_path / "bad.json")]
    )
    assert result.exit_code != 0 and "nope" in result.output


@pytest.fixture(
    scope="module",
    params=[
        ("linear", None, 16, "features"),
        ("poly3", "poly2", 2, "features"),
        ("gbrt", None, 2, "features"),
        ("gbrt", "linear", 2, "features+confidence"),
    ],
    ids=["linear", "poly3-bank-poly2-policies", "gbrt", "gbrt-bank-confidence-policies"],
)
def built(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, list]:  # type: ignore[type-arg]
    learner, policy_learner, refine, inputs = request.param
    spec = dataclasses.replace(
        SPEC,
        learner=learner,
        policy_learner=policy_learner,
        refine_scales=refine,
        policy_inputs=inputs,
    )
    x, y = make_router_data(2000, seed=6)
    root = tmp_path_factory.mktemp("dag-equiv")
    result = build_dag_bundle(root / "router", spec, x, y.astype(str), COLUMNS)
    params = read_manifest(result.path).provenance.parameters
    assert params["learner"] == learner
    assert params["policy_inputs"] == inputs
    assert all(m.policy_inputs == inputs for m in result.models)
    return result.path, result.models


def _serve_walk(  # type: ignore[no-untyped-def]
    bundle,
    policy_index: int,
    row: np.ndarray,
    budget: float,
    in_hand: dict | None = None,  # type: ignore[type-arg]
):
    """Walk the served runtime with one operating point pinned, real sensor values."""
    from service.strategies.base import Acquire, Observation
    from service.strategies.dag import DagSession

    runtime = bundle.runtimes["dag"]
    per_feature = bundle.costs.at(1)
    policy = next(p for p in runtime.policies if p.spec.file == f"policy_{policy_index}.onnx")
    session = DagSession(runtime, policy, per_feature)
    item = dict(zip(COLUMNS, map(float, row), strict=True))
    features = dict(in_hand or {})
    spent = 0.0
    while True:
        step = session.step(Observation(size=1, budget=budget, spent=spent, features=features))
        if not isinstance(step, Acquire):
            return step.model, spent, session.path()
        features[step.feature] = bundle.extractors[step.feature].extract(item)
        spent += per_feature[step.feature]


def test_served_walk_equals_the_trained_policy(built: tuple[Path, list]) -> None:  # type: ignore[type-arg]
    from service.registry import load_bundle

    path, models = built
    bundle = load_bundle(path, 1)
    x, _ = make_router_data(150, seed=8)
    for i, model in enumerate(models):
        for budget in (0.5, 3.0, 6.0, 7.5, 11.0):
            pred, spent, states = model.predict_with_cost(x, budget=budget)
            for row, p, cost, state in zip(x, pred, spent, states, strict=True):
                answer, served_cost, served_path = _serve_walk(bundle, i, row, budget)
                assert served_cost == pytest.approx(cost)
                assert set(served_path[-1]) == set(model.state_sensors(int(state)))
                probs = bundle.models[answer].predict_proba(
                    {
                        s: bundle.extractors[s].extract(
                            dict(zip(COLUMNS, map(float, row), strict=True))
                        )
                        for s in bundle.runtimes["dag"].model_features[answer]
                    }
                )
                assert bundle.manifest.classes[int(np.argmax(probs))] == str(p)


def test_hard_cap_cuts_walks_that_would_overspend(built: tuple[Path, list]) -> None:  # type: ignore[type-arg]
    from service.registry import load_bundle

    path, _models = built
    bundle = load_bundle(path, 1)
    dag = bundle.manifest.strategies[0]
    assert isinstance(dag, DagStrategy)
    routing = next(
        i for i, m in enumerate(dag.policies) if 5.0 < m.mean_cost < 7.0
    )  # the operating point that buys r then a or b
    x, _ = make_router_data(60, seed=10)
    cut = 0
    for row in x:
        _, full_cost, _ = _serve_walk(bundle, routing, row, 100.0)
        _, cost, _path_taken = _serve_walk(bundle, routing, row, 3.0)
        assert cost <= 3.0
        cut += full_cost > 3.0 and cost < full_cost
    assert cut >= len(x) // 2, "the cap must actually cut walks in this test"


def test_partially_cached_sensors_make_an_operating_point_affordable(
    client: TestClient, store: SensorStore
) -> None:
    x, _ = make_router_data(40, seed=11)
    row = next(r for r in x if r[0] > 0.5)  # routed to a
    item = store.item(row, "partial-cache")
    warm = client.post("/predict", json={"model": "router", "item": item, "budget": 6.0}).json()
    assert set(warm["cost"]["extracted"]) == {"r", "a"}
    # r and a are now cached: the operating point that costs 6 on average is affordable with a
    # budget of 5.9, and it spends nothing.
    again = client.post("/predict", json={"model": "router", "item": item, "budget": 5.9}).json()
    assert again["answered_by"] != "prior" and again["cost"]["spent"] == 0.0
    assert set(again["features"]) == {"a", "r"}


def test_manifest_rejects_dag_loops(router_dir: Path) -> None:
    from pydantic import ValidationError

    from service.bundle import Manifest

    raw = json.loads((router_dir / "manifest.json").read_text())
    policy = raw["strategies"][0]["policies"][-1]
    root = next(s for s in policy["states"] if s["groups"] == 0)
    assert root["transitions"], "the root of this policy can acquire"
    looped = json.loads(json.dumps(raw))
    next(s for s in looped["strategies"][0]["policies"][-1]["states"] if s["groups"] == 0)[
        "transitions"
    ][0] = 0  # the root acquiring into itself
    with pytest.raises(ValidationError, match="strictly larger"):
        Manifest.model_validate(looped)
    state = next((s for s in policy["states"] if len(s["tree"]) >= 2), None)
    assert state is not None, "this policy has a state with a multi-node filter tree"
    cyclic = json.loads(json.dumps(raw))
    target = next(
        s
        for s in cyclic["strategies"][0]["policies"][-1]["states"]
        if s["groups"] == state["groups"]
    )
    target["tree"][1]["left"] = 0  # a node pointing back to the root
    with pytest.raises(ValidationError, match="out of range"):
        Manifest.model_validate(cyclic)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"learner": "svm"}, "learner must be one of linear, poly2, poly3, gbrt, got 'svm'"),
        ({"policy_learner": "tree"}, "policy_learner must be one of"),
        ({"refine_scales": -1}, "refine_scales must be an int >= 0"),
        ({"refine_scales": 2.5}, "refine_scales must be an int >= 0"),
        ({"policy_inputs": "logits"}, "policy_inputs must be one of features, features"),
        ({"groups": "alg2"}, "groups must be 'chain'"),
        ({"groups": "chain", "n_subsets": 3}, "not both"),
        ({"groups": "chain", "fixed": False, "bank": "learner"}, "it needs `fixed`"),
    ],
)
def test_spec_refuses_unknown_learners_and_bad_refinement(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPEC, **change).check()
