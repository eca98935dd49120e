"""Gating that routes where routing pays (issue 25): sensors of several columns whose cost is
paid once, f1's own confidence as the gate, and a fixed subset's model as the high-cost model,
so that a budget below the full cost still buys a routing point; served over HTTP with the
sensors acquired from a real Redis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.bundle import GatingStrategy
from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.support.sensor_store import SensorStore
from training.bundles.gating import GatingSpec, build_gating_bundle
from training.gating import AdaptGbrt

COLUMNS = ["a", "b1", "b2", "c"]
SENSORS = {"a": ["a"], "b": ["b1", "b2"], "c": ["c"]}
COSTS = {"a": 1.0, "b": 2.0, "c": 8.0}


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """a alone tells the label when |a| > 0.6; otherwise b1 - b2 does; c is expensive noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(COLUMNS)))
    y = np.where(np.abs(x[:, 0]) > 0.6, x[:, 0] > 0, x[:, 1] - x[:, 2] > 0)
    return x, np.where(y, "yes", "no")


def test_a_grouped_sensor_is_paid_once_whatever_columns_are_read() -> None:
    x, y = _data(600, seed=1)
    groups = [[0], [1, 2], [3]]
    costs = np.asarray([1.0, 2.0, 2.0, 8.0])
    est = AdaptGbrt(
        p_full=0.0, lam=1e-4, feature_costs=costs, feature_groups=groups, n_rounds=4
    ).fit(x, y)
    read = set(est.f1_features_.tolist())
    assert {1, 2} <= read, "f1 needs b: both of its columns are read (and exported)"
    expected = sum(c for g, c in zip(groups, (1.0, 2.0, 8.0), strict=True) if read & set(g))
    assert est.low_cost_ == expected and est.full_cost_ == 11.0
    with pytest.raises(ValueError, match="a group is one sensor with one cost"):
        AdaptGbrt(feature_costs=[1.0, 2.0, 3.0, 8.0], feature_groups=groups).fit(x, y)


@pytest.mark.redis
def test_below_the_full_cost_a_confidence_gate_routes_to_a_fixed_subset(
    tmp_path: Path, redis_url: str
) -> None:
    x, y = _data(1500, seed=2)
    spec = GatingSpec(
        name="routes",
        label="label",
        sensors=dict(SENSORS),
        costs=dict(COSTS),
        grid=[{"method": "greedymiser", "p_full": 0.0, "regularisation": 0.05}],  # f1 reads a
        fixed={"num_leaves": [7], "max_trees": 80, "patience": 20},
    )
    result = build_gating_bundle(tmp_path / "routes", spec, x, y, COLUMNS)
    strategy = result.manifest.strategy()
    assert isinstance(strategy, GatingStrategy)
    for point in strategy.points:  # grouped: f1 and the gate read whole sensors
        for model_id in (point.low_model, point.high_model):
            model = result.manifest.model(model_id)
            assert model.input_dims == sum(len(SENSORS[f]) for f in model.features)
    budget = 3.0  # a and b: below the full cost 11, f0 cannot be paid for
    store = SensorStore(redis_url, COLUMNS)
    settings = Settings(models_dir=tmp_path, sensor_sources={"routes": {"*": store.source()}})
    test_x, test_y = _data(120, seed=3)
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as client:
        bodies = []
        for i, row in enumerate(test_x):
            item = store.item(row, f"r{i}")
            # The confidence gate is as accurate on validation as the fixed subset a+b, at
            # 2 of its 3: ranked a margin down against it, it is served when the request
            # takes the cheapest within 2 points.
            body = {"model": "routes", "item": item, "budget": budget, "tolerance": 0.02}
            r = client.post("/predict", json=body)
            assert r.status_code == 200, r.text
            bodies.append(r.json())
    point = next(p for p in strategy.points if p.id == bodies[0]["decision"]["point"])
    assert point.method == "confidence" and point.high_model.startswith("fixed:")
    sent = [b["decision"]["sent_to_high"] for b in bodies]
    assert 0.05 <= np.mean(sent) <= 0.9, "it routes some items, not all"
    assert all(b["cost"]["spent"] <= budget for b in bodies)
    right = np.mean([b["prediction"] == label for b, label in zip(bodies, test_y, strict=True)])
    spent = np.mean([b["cost"]["spent"] for b in bodies])
    assert spent < 3.0 and right >= 0.85, (spent, right)
    # f1 alone (a) is right about where |a| > 0.6 and guesses elsewhere; routing pays
    low = result.manifest.model(point.low_model)
    assert point.accuracy > low.accuracy + 0.05
