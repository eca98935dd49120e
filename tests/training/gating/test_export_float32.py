"""Tree thresholds in float32 graphs (training/export/trees.py) and the strict export checks."""

from __future__ import annotations

from pathlib import Path

import lightgbm as lgb
import numpy as np
import onnxmltools
import pytest
from onnxmltools.convert.common.data_types import FloatTensorType
from sklearn.ensemble import RandomForestClassifier
from sklearn.tree import DecisionTreeClassifier

from training.export.gating import (
    GatingExportMismatch,
    check_rows,
    export_system,
    lightgbm_onnx,
    verify_system,
)
from training.export.sklearn import export_classifier, onnx_probabilities
from training.export.trees import Float32Splits, partition_thresholds
from training.gating import AdaptGbrt

ULP1 = 2.0**-23  # float32 spacing just above 1.0


def _oracle(t: float, values: np.ndarray) -> np.float32:
    """Brute force: of the float32 values within 8 steps of float32(t), those that keep every
    training value's float32 on its double side of t; the one nearest t (on a tie, the
    nearest float32 by numpy's rounding, ties to even)."""
    center = np.float32(t)
    down, up = [center], [center]
    for _ in range(8):
        down.append(np.nextafter(down[-1], np.float32(-np.inf)))
        up.append(np.nextafter(up[-1], np.float32(np.inf)))
    candidates = sorted(set(down) | set(up))
    v32 = values.astype(np.float32)
    left = values <= t
    ok = [c for c in candidates if np.all((v32 <= c) == left)]
    assert ok, "the test data must leave a valid threshold"
    return min(ok, key=lambda c: (abs(float(c) - t), c != center))


def test_partition_thresholds_match_a_brute_force_oracle() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        base = rng.choice([1.0, 0.177, 1e-3, 123.456, -7.5])
        gaps = rng.choice([0.7, 1.4, 2.6, 5.0, 40.0], size=6) * ULP1 * max(1.0, abs(base))
        values = np.unique(base + np.cumsum(gaps))
        values32 = values.astype(np.float32)
        if np.unique(values32).size < values.size:
            continue  # two values collide in float32: no valid threshold to compare
        i = int(rng.integers(0, values.size - 1))
        lo, hi = values[i], values[i + 1]
        for t in (
            (lo + hi) / 2,
            float(np.nextafter(lo, np.inf)),
            float(np.nextafter(hi, -np.inf)),
        ):
            got = partition_thresholds(np.asarray([t]), values)[0]
            assert got == _oracle(t, values), (values.tolist(), t)


def _straddling(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Feature 0 holds 1.0 and 1.0 + 1.4 float32 steps (the label); LightGBM splits them at
    their midpoint, whose nearest float32 is the float32 of the upper value. Feature 1 is
    noise, so the model has other splits too."""
    rng = np.random.default_rng(seed)
    upper = rng.random(400) < 0.5
    x0 = np.where(upper, 1.0 + 1.4 * ULP1, 1.0)
    X = np.column_stack([x0, rng.normal(size=400)])
    return X, upper.astype(np.int64)


def test_lightgbm_export_keeps_values_that_straddle_a_rounded_threshold() -> None:
    X, y = _straddling()
    booster = lgb.train(
        {"objective": "binary", "verbose": -1, "min_data_in_bin": 1, "num_leaves": 4},
        lgb.Dataset(X, y),
        5,
    )
    t = booster.dump_model()["tree_info"][0]["tree_structure"]["threshold"]
    assert 1.0 < t < 1.0 + 1.4 * ULP1 and np.float32(t) == np.float32(X[y == 1, 0][0])
    expected = booster.predict(X)  # the fitted model on the rows themselves
    x32 = X.astype(np.float32)

    # before: the converter rounds the threshold to nearest; the upper rows go left
    old = onnxmltools.convert_lightgbm(
        booster, initial_types=[("features", FloatTensorType([None, 2]))], zipmap=False
    )
    old_p = onnx_probabilities(old.SerializeToString(), x32)[:, 1]
    assert np.all(np.abs(old_p - expected)[y == 1] > 0.1)

    # now: the threshold is lowered below float32(upper); every row matches exactly
    new, splits = lightgbm_onnx(booster, 2, X)
    new_p = onnx_probabilities(new, x32)[:, 1]
    assert np.abs(new_p - expected).max() <= 1e-6
    assert not splits.crossing_rows(X).any()
    assert np.all(splits.exported[splits.features == 0] == np.float32(1.0))

    # a value no training row holds, within a float32 rounding of t, can cross: t itself goes
    # left in the fitted model, its float32 (1 + 1 step) right of the exported 1.0
    assert splits.crossing_rows(np.asarray([[t, 0.0]])).all()


def test_gated_system_with_straddling_values_exports_and_verifies() -> None:
    X, y = _straddling(1)
    est = AdaptGbrt(p_full=0.0, lam=0.0, n_rounds=2, min_child_samples=5).fit(X, y)
    system = export_system(est, X)
    assert system.f1.splits is not None and 0 in system.f1.columns
    assert verify_system(est, system, X, label="straddle") <= 1e-4


def test_sklearn_tree_exports_split_every_float32_input_as_fitted() -> None:
    """scikit-learn splits 1.0 | 1.0 + 3 steps at 1 + 1.5 steps, whose nearest float32 is
    1 + 2 steps: an input there goes right in scikit-learn, and would go left in a graph with
    the nearest threshold. skl2onnx stores the float32 below instead; this pins it."""
    a, b, between = 1.0, 1.0 + 3 * ULP1, 1.0 + 2 * ULP1
    X = np.asarray([[a]] * 20 + [[b]] * 20)
    y = np.asarray([0] * 20 + [1] * 20)
    for model in (
        DecisionTreeClassifier(random_state=0).fit(X, y),
        RandomForestClassifier(n_estimators=3, bootstrap=False, random_state=0).fit(X, y),
    ):
        probe = np.asarray([[a], [between], [b]], dtype=np.float32)
        expected = model.predict_proba(probe)
        assert expected[1, 1] == 1.0  # scikit-learn: float32(between) > t
        assert np.float32((a + b) / 2) == np.float32(between)  # nearest rounding would fail
        got = onnx_probabilities(export_classifier(model, 1), probe)
        assert np.array_equal(got, expected.astype(np.float32))


def test_check_rows_allows_only_the_rows_float32_explains() -> None:
    rng = np.random.default_rng(0)
    expected = rng.dirichlet(np.ones(3), size=1000)
    got = expected + 1e-6
    got[7] = expected[7][::-1]  # one row took the other branch of a split
    explained = np.zeros(1000, dtype=bool)
    with pytest.raises(GatingExportMismatch, match=r"on 1 of 1000 check rows \(rows 7\)"):
        check_rows(got, expected, "f1")  # no count forgives a row
    explained[7] = True
    assert check_rows(got, expected, "f1", explained) == pytest.approx(1e-6)
    got[:3] = expected[:3][:, ::-1]
    with pytest.raises(GatingExportMismatch, match=r"on 3 of 1000 check rows \(rows 0, 1, 2\)"):
        check_rows(got, expected, "f1", explained)
    with pytest.raises(GatingExportMismatch, match="shape"):
        check_rows(got[:, :2], expected, "f1")


def test_crossing_rows_are_those_a_float32_comparison_cannot_follow() -> None:
    splits = Float32Splits(
        np.asarray([0, 1]), np.asarray([0.5, 2.0]), np.asarray([0.5, 2.0], dtype=np.float32)
    )
    X = np.asarray([[0.5, 0.0], [0.5 + 1e-12, 0.0], [0.0, 2.0 + 1e-12], [0.4, 3.0]])
    assert splits.crossing_rows(X).tolist() == [False, True, True, False]


def test_the_readme_gating_command_builds_pima(tmp_path: Path) -> None:
    """Issue 12: the README's gating spec and command on pima build a bundle whose every
    export passed the strict check (before: "f1 ONNX differs ... on 2 of 154 check rows").
    One configuration per method, every point exported (``pareto: false``), to stay fast."""
    import re
    import shlex

    import yaml
    from typer.testing import CliRunner

    from service.bundle import GatingStrategy, read_manifest
    from training.cli import app

    root = Path(__file__).parents[3]
    readme = (root / "README.md").read_text()
    block = re.search(r"cat > gating\.yaml <<'YAML'\n(.*?)\nYAML\n(.*?)\n", readme, re.S)
    assert block is not None, "README's gating example moved"
    spec = yaml.safe_load(block.group(1))
    spec["grid"] = [
        {"method": "adapt-gbrt", "p_full": 0.5, "regularisation": 0.003},  # failed before
        {"method": "greedymiser", "p_full": 0.0, "regularisation": 0.003},
        {"method": "adapt-lin", "p_full": 0.4, "regularisation": 0.01},
        {"method": "l1", "p_full": 0.0, "regularisation": 0.03},
    ]
    spec["pareto"] = False
    (tmp_path / "gating.yaml").write_text(yaml.safe_dump(spec))
    command = shlex.split(block.group(2))
    assert command[:2] == [".venv/bin/budgetserve-train", "gating"], command
    args = command[2:]
    csv = (root / args[args.index("--csv") + 1]).resolve()  # the README runs in the repo root
    if not csv.is_file():
        pytest.skip(
            f"the shared datasets are not beside this checkout ({csv}); CI runs with ../shared "
            "beside the clone"
        )
    args[args.index("--csv") + 1] = str(csv)
    args[args.index("--spec") + 1] = str(tmp_path / "gating.yaml")
    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["gating", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    strategy = read_manifest(out).strategy("gating")
    assert isinstance(strategy, GatingStrategy)
    assert "adapt-gbrt-p0.5-r0.003-zero" in [p.id for p in strategy.points]
