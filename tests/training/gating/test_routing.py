"""Gating that routes (issue 12): the tuned f0, thresholds set on validation to route a chosen
fraction, routed fractions and f1-alone accuracies in the sweep, cross-fitted f1 losses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pytest
from sklearn.datasets import make_classification

from training.bundles.gating import GatingSpec, build_gating_bundle
from training.gating import AdaptGbrt, FittedF0, tune_gbrt_f0
from training.gating.sweep import ROUTED_FRACTIONS, Config, sweep, threshold_for_fraction


def _data(n: int = 900, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    X, y = make_classification(
        n, 8, n_informative=5, n_redundant=1, n_clusters_per_class=2, random_state=seed
    )
    return X, np.asarray(["no", "yes"])[y]


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, FittedF0]:
    X, y = _data()
    f0 = lgb.LGBMClassifier(n_estimators=60, num_leaves=15, n_jobs=1, verbose=-1)
    return X, y, FittedF0.fit(f0, X[:500], y[:500])


# --------------------------------------------------------------------------- tuned f0


def test_tune_gbrt_f0_keeps_the_candidate_that_is_best_on_validation() -> None:
    X, y = _data(600, seed=3)
    choice = tune_gbrt_f0(
        X[:400], y[:400], X[400:], y[400:], num_leaves=(4, 15), learning_rates=(0.1,), trees=(5, 40)
    )
    assert len(choice.candidates) == 4
    # oracle: refit every candidate on its own and score it on the validation rows
    for params, acc in choice.candidates:
        model = lgb.LGBMClassifier(**params).fit(X[:400], y[:400])
        assert acc == pytest.approx(float(np.mean(model.predict(X[400:]) == y[400:])))
    assert choice.val_accuracy == max(acc for _, acc in choice.candidates)
    assert (choice.params, choice.val_accuracy) in choice.candidates
    fitted = choice.estimator().fit(X[:400], y[:400])
    assert float(np.mean(fitted.predict(X[400:]) == y[400:])) == pytest.approx(choice.val_accuracy)
    assert f"{choice.params['n_estimators']} trees" in choice.describe()


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"num_leaves": (1,)}, "num_leaves must be >= 2"),
        ({"trees": (0,)}, "trees must be >= 1"),
        ({"learning_rates": ()}, "at least one"),
    ],
)
def test_tune_gbrt_f0_rejects_bad_grids(kwargs: dict[str, Any], msg: str) -> None:
    X, y = _data(200)
    with pytest.raises(ValueError, match=msg):
        tune_gbrt_f0(X[:100], y[:100], X[100:], y[100:], **kwargs)


def test_tune_gbrt_f0_checks_the_validation_rows() -> None:
    X, y = _data(200)
    with pytest.raises(ValueError, match="8 features"):
        tune_gbrt_f0(X[:100], y[:100], X[100:, :5], y[100:])
    with pytest.raises(ValueError, match="one label per row of X_val"):
        tune_gbrt_f0(X[:100], y[:100], X[100:], y[100:150])


# --------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 0.5, 1.0])
def test_threshold_routes_the_fraction_asked_for_and_sits_between_scores(
    fraction: float,
) -> None:
    scores = np.random.default_rng(0).normal(size=400)
    t = threshold_for_fraction(scores, fraction)
    assert np.mean(scores > t) == pytest.approx(fraction, abs=0.5 / scores.size)
    assert t not in set(scores.tolist())


def test_threshold_with_ties_takes_the_closest_achievable_fraction() -> None:
    scores = np.repeat([0.0, 1.0, 2.0, 3.0], [50, 30, 15, 5])  # fractions above: .5 .2 .05 0
    for asked in (0.04, 0.1, 0.3, 0.45, 0.9):
        t = threshold_for_fraction(scores, asked)
        achievable = [0.0, 0.05, 0.2, 0.5, 1.0]
        best = min(achievable, key=lambda a: (abs(a - asked), a))  # tie: fewer routed
        assert np.mean(scores > t) == pytest.approx(best)
    assert threshold_for_fraction(np.full(5, -np.inf), 0.3) == math.inf


# --------------------------------------------------------------------------- the sweep


def test_sweep_points_report_routed_fractions_and_f1_alone(
    data: tuple[np.ndarray, np.ndarray, FittedF0],
) -> None:
    X, y, f0 = data
    points = sweep(
        X[:500],
        y[:500],
        X[500:700],
        y[500:700],
        X_test=X[700:],
        y_test=y[700:],
        costs=np.ones(8),
        f0=f0,
        grid=[Config("adapt-gbrt", 0.3, 0.003), Config("greedymiser", 0.0, 0.003)],
        gbrt_params={"n_rounds": 4},
    )
    gbrt = [p for p in points if p.method == "adapt-gbrt"]
    assert {p.params.get("routed") for p in gbrt} == {None, *ROUTED_FRACTIONS}
    f1_alone = AdaptGbrt(p_full=0.3, lam=0.003, feature_costs=np.ones(8), f0=f0, n_rounds=4)
    f1_alone.fit(X[:500], y[:500])
    f1_pred = f1_alone.classes_[np.argmax(f1_alone.f1_proba(X), axis=1)]
    for p in gbrt:
        assert p.val_f1_accuracy == pytest.approx(np.mean(f1_pred[500:700] == y[500:700]))
        assert p.test_f1_accuracy == pytest.approx(np.mean(f1_pred[700:] == y[700:]))
        routed = p.estimator.route(X[700:])
        assert p.test_fraction_full == pytest.approx(np.mean(routed))
        expected_cost = np.where(routed, 8.0, p.estimator.low_cost_).mean()
        assert p.test_cost == pytest.approx(expected_cost)
        if "routed" in p.params:
            assert p.val_fraction_full == pytest.approx(float(p.params["routed"]), abs=0.01)
            # routed items are answered by f0, the others by f1
            pred = p.estimator.predict(X[700:])
            f0_pred = np.unique(y)[f0.model.predict(X[700:])]
            assert np.array_equal(pred[routed], f0_pred[routed])
            assert np.array_equal(pred[~routed], f1_pred[700:][~routed])
    (gm,) = [p for p in points if p.method == "greedymiser"]
    assert gm.val_fraction_full == 0.0 and gm.test_fraction_full == 0.0
    assert gm.val_accuracy == gm.val_f1_accuracy


# --------------------------------------------------------------------------- f1_cv


def test_cross_fitted_f1_losses_keep_p_full_and_the_served_f1_on_all_rows(
    data: tuple[np.ndarray, np.ndarray, FittedF0],
) -> None:
    X, y, f0 = data
    kw: dict[str, Any] = {"p_full": 0.3, "lam": 0.003, "f0": f0, "n_rounds": 5}
    plain = AdaptGbrt(**kw).fit(X[:500], y[:500])
    cf = AdaptGbrt(f1_cv=2, **kw).fit(X[:500], y[:500])
    assert np.mean(cf.q_) <= 0.3 + 1e-9
    assert cf.f1_booster_ is not None and plain.f1_booster_ is not None
    assert cf.f1_booster_.num_trees() == plain.f1_booster_.num_trees()
    # in-sample f1 losses are optimistic: f1 fits its training rows better than the rows its
    # cross-fitted copies never saw, so the q-step sends more items towards f0
    assert np.mean(cf.q_) > np.mean(plain.q_)
    again = AdaptGbrt(f1_cv=2, **kw).fit(X[:500], y[:500])
    assert np.array_equal(again.q_, cf.q_)
    with pytest.raises(ValueError, match="f1_cv must be >= 2"):
        AdaptGbrt(f1_cv=1, **kw).fit(X[:500], y[:500])


# --------------------------------------------------------------------------- the bundle


def test_a_bundle_with_a_tuned_f0_records_its_choice_and_every_routed_fraction(
    tmp_path: Path,
) -> None:
    X, y = _data(500, seed=6)
    cols = [f"f{i}" for i in range(8)]
    spec = GatingSpec(
        name="tuned",
        label="label",
        sensors=list(cols),  # type: ignore[arg-type]
        f0="lightgbm-tuned",
        grid=[
            {"method": "l1", "p_full": 0.0, "regularisation": 0.1},
            {"method": "greedymiser", "p_full": 0.0, "regularisation": 0.003},
        ],
    )
    result = build_gating_bundle(tmp_path / "b", spec, X, y, cols)
    x_train, x_val, _, y_train, y_val, _ = spec.split(X, y)
    oracle = tune_gbrt_f0(x_train, y_train, x_val, y_val, random_state=spec.seed)
    config = result.manifest.provenance.parameters
    assert config["f0_params"] == {
        k: oracle.params[k] for k in ("n_estimators", "num_leaves", "learning_rate")
    }
    assert result.f0_accuracy["validation"] == pytest.approx(oracle.val_accuracy)
    for point in result.points:
        for key in ("validation_fraction_full", "test_fraction_full", "test_f1_accuracy"):
            assert 0.0 <= point[key] <= 1.0
        if point["method"] == "greedymiser":
            assert point["validation_fraction_full"] == point["test_fraction_full"] == 0.0
            assert point["test_accuracy"] == point["test_f1_accuracy"]
