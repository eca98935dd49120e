"""The DAG benchmark's core functions (benchmarks/dag.py) on small synthetic data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import dag as b
from training.data import uci
from training.data.synthetic import make_informative_data, make_many_sensor_data

SCALES = (0.0, 0.01, 0.1, 1.0)


def _split(X: np.ndarray, y: np.ndarray) -> uci.Split:
    n = X.shape[0] // 3
    return uci.Split(X[:n], y[:n], X[n : 2 * n], y[n : 2 * n], X[2 * n :], y[2 * n :])


@pytest.fixture(scope="module")
def small() -> b.DatasetResult:
    X, y = make_informative_data(600, n_sensors=4, n_informative=2, seed=1)
    ds = b.Dataset(
        key="synthetic",
        title="synthetic",
        sensors={f"s{i}": [i] for i in range(4)},
        splits=[_split(X, y)],
        targets=(1.0, 2.0, 3.0),
        variants=[b.Variant()],
        cost_scales=SCALES,
    )
    return b.run_dataset(ds)


def test_structure(small: b.DatasetResult) -> None:
    assert small.methods == [b.DAG, b.FIXED, b.CASCADE, b.GB, b.LR]
    r = small.splits[0][""]
    assert r.n_states == 16
    cands = r.candidates
    # The given scales first, then those the adaptive grid added (at most REFINE).
    labels = [c.label for c in cands[b.DAG]]
    assert labels[: len(SCALES)] == [f"λ={cs:.3g}" for cs in SCALES]
    assert len(SCALES) <= len(labels) <= len(SCALES) + b.REFINE
    for ref in (b.GB, b.LR):
        [c] = cands[ref]
        assert c.val_cost == 4.0 and np.all(c.test_cost == 4.0) and 0.0 <= c.val_error <= 0.5
    assert len(cands[b.FIXED]) == 16  # every subset of 4 sensors, the empty one included
    # Cascade: stage 0 alone, then every threshold for each later last stage.
    assert len(cands[b.CASCADE]) == 1 + 4 * len(b.THRESHOLDS)
    assert [len(s) for s in r.cascade] == [0, 1, 2, 3, 4]
    n_test = small.dataset.splits[0].y_test.size
    for cs in cands.values():
        for c in cs:
            assert c.test_cost.shape == (n_test,) and c.test_error.shape == (n_test,)
            assert 0.0 <= c.val_error <= 1.0 and c.val_cost >= 0.0
    for m in small.methods:
        if m in (b.GB, b.LR):  # one point at full cost: nothing fits a smaller budget
            assert small.at(m, 3.9) is None and small.at(m, 4.0) is not None
            continue
        for t in small.dataset.targets:
            choice = small.at(m, t)
            assert choice is not None and choice.val_cost <= t + 1e-9
        assert 0.0 <= small.mean_error(m) <= 1.0
    # Informative sensors are s0 and s1: the cascade buys one of them first.
    assert set(r.cascade[1]) <= {"s0", "s1"}


def test_fixed_subset_never_exceeds_budget(small: b.DatasetResult) -> None:
    fixed = small.per_split(b.FIXED)
    for budget in np.linspace(0.0, 4.0, 17):
        choice = small.at(b.FIXED, float(budget))
        assert choice is not None
        assert np.all(choice.row_cost <= budget + 1e-9)
        # ... and it is the best validation error among the subsets that fit.
        fits = [c.val_error for c in fixed[0] if c.val_cost <= budget + 1e-9]
        assert choice.labels[0] in {c.label for c in fixed[0] if c.val_error == min(fits)}


def test_choose_and_pooling() -> None:
    z = np.zeros(2)
    cands = [
        b.Candidate("a", 1.0, 0.3, z + 1, np.array([True, False])),
        b.Candidate("b", 2.0, 0.1, z + 2, np.array([False, False])),
    ]
    assert b.choose(cands, 0.5) is None
    assert b.choose(cands, 1.5) is cands[0]
    assert b.choose(cands, 2.0) is cands[1]
    pooled = b.choose_pooled([cands, cands[:1]], 2.0)
    assert pooled is not None
    assert pooled.labels == ["b", "a"] and pooled.test_error == 0.25 and pooled.test_cost == 1.5
    assert b.choose_pooled([cands, cands[1:]], 1.0) is None


def test_alg2_groups_and_report(tmp_path: Path) -> None:
    from training.dag import select_subsets

    X, y = make_many_sensor_data(450, n_sensors=8, n_classes=2, seed=3)
    sensors = {f"f{i}": [i] for i in range(8)}
    variants = [b.Variant(prefix="", n_subsets=2, methods=(b.FIXED, b.ALL))]
    ds = b.Dataset(
        key="many",
        title="many",
        sensors=sensors,
        splits=[_split(X, y)],
        targets=(1.0, 2.0, 4.0),
        variants=variants,
        cost_scales=(0.0, 0.05),
    )
    res = b.run_dataset(ds)
    assert res.methods == [b.DAG, b.FIXED, b.ALL, b.GB, b.LR]
    for r in res.splits[0].values():
        assert r.groups[-1] == list(sensors)  # the full set is the last group
    assert res.at(b.ALL, 7.0) is None and res.at(b.ALL, 8.0) is not None
    # Empty subsets earn no credit: the reward starts at 0 and grows with real subsets.
    sel = select_subsets(X, y, sensors=sensors, n_subsets=2)
    assert len(sel.subsets) == 2 and all(sel.subsets) and 0.0 < sel.reward <= 1.0
    assert sel.steps[0][2] < 1.0, "one single-feature subset cannot be right on every row"
    png = b.plot(res, tmp_path / "dag_many.png")
    assert png.stat().st_size > 0
    md = b.render([res], ["x: missing"], 1.0, {"many": png})
    assert "## many" in md and "x: missing" in md and "| DAG |" in md
    assert "Goal of issue 12 on many" in md and "full budget vs gradient boosting" in md


def test_missing_data_is_skipped(tmp_path: Path) -> None:
    assert uci.load_letter(tmp_path) is None
    assert uci.load_pima(tmp_path) is None
    assert uci.load_miniboone(tmp_path) is None
    found, skipped = b.datasets(tmp_path)
    assert found == [] and len(skipped) == 3


def test_saved_runs_combine_into_one_report(small: b.DatasetResult, tmp_path: Path) -> None:
    import pickle

    saved = tmp_path / "synthetic.pkl"
    saved.write_bytes(pickle.dumps(([small], [], 12.5)))
    paths = b.combine([saved], tmp_path / "out")
    md = (tmp_path / "out" / "dag.md").read_text()
    assert [p.name for p in paths] == ["dag.md", "dag_synthetic.png"]
    assert "## synthetic" in md and "total run 12.5 s" in md
    assert "letter: not run" in md and "Goal of issue 12 on synthetic" in md
