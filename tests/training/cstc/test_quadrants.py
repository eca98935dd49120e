"""The paper's oracle (§6.1, Fig. 5): on the quadrant set a perfect predictor reads sign(z),
sign(x) and the one expensive feature of the row's quadrant, cost 1 + 1 + 10 = 12."""

from __future__ import annotations

import numpy as np
import pytest

from training.cstc import CSTCRegressor
from training.cstc.synthetic import QUADRANT_COLUMNS, QUADRANT_COSTS, quadrants


@pytest.fixture(scope="module")
def fitted() -> tuple[CSTCRegressor, np.ndarray, np.ndarray]:
    X, y = quadrants(2000, seed=0)
    model = CSTCRegressor(
        costs=QUADRANT_COSTS,
        lam=0.03,
        rho=0.01,
        depth=3,
        sharpness=5.0,
        n_rounds=3,
        standardize=False,
    ).fit(X, y)
    X_test, y_test = quadrants(1000, seed=1)
    return model, X_test, y_test


def test_quadrant_optimum(fitted: tuple[CSTCRegressor, np.ndarray, np.ndarray]) -> None:
    model, X_test, y_test = fitted
    mse = float(np.mean((model.predict(X_test) - y_test) ** 2))
    assert mse < 0.01  # the labels' own variance is 1: only the exact features get here
    assert model.average_cost(X_test) == pytest.approx(12.0)


def test_quadrant_structure(fitted: tuple[CSTCRegressor, np.ndarray, np.ndarray]) -> None:
    model, X_test, _ = fitted
    nodes = model.export_nodes_
    sign_x, sign_z = QUADRANT_COLUMNS.index("sign_x"), QUADRANT_COLUMNS.index("sign_z")
    assert nodes[0].columns == (sign_z,)  # the root splits on the z-sign feature
    leaves = [nd for nd in nodes if not nd.routes]
    internal = [nd for nd in nodes if nd.routes]
    assert len(leaves) == 4 and len(internal) == 3
    assert all(nd.columns == (sign_x,) for nd in internal[1:])
    used = sorted(nd.columns[0] for nd in leaves)
    assert all(len(nd.columns) == 1 for nd in leaves) and used == [0, 1, 2, 3]
    # Each leaf serves the quadrant whose feature it reads.
    for walk, row in zip(model.walk(X_test[:200]), X_test[:200], strict=True):
        leaf = nodes[walk.node]
        quadrant = {(1, 1): 0, (1, -1): 1, (-1, 1): 2, (-1, -1): 3}[
            (int(row[sign_x]), int(row[sign_z]))
        ]
        assert leaf.columns == (quadrant,)
        assert walk.acquired[0] == [sign_z] and walk.acquired[1] == [sign_x]


def test_without_the_cost_term_the_tree_reads_more() -> None:
    X, y = quadrants(1000, seed=2)
    cheap = CSTCRegressor(
        costs=QUADRANT_COSTS, lam=0.0, rho=0.0, depth=1, standardize=False, polish=False
    )
    cheap.fit(X, y)
    assert cheap.average_cost(X) > 12.0  # λ = 0: the root reads every feature
