"""One contract for the X, y estimators of ``training`` (ADAPT-LIN, L1, ADAPT-GBRT, the DAG,
CSTC and CSCC).

Two layers: :func:`test_contract` checks, on the same small data for all four, what the
bundle builders and the sweeps rely on (scikit-learn's ``BaseEstimator``/``ClassifierMixin``
parameters and ``clone``, ``check_is_fitted`` before and after ``fit``, labels and
probabilities, determinism, a wrong column count refused); :func:`test_sklearn_checks` runs
scikit-learn's own estimator checks on the three gated systems, with each expected failure named
and explained in :data:`EXPECTED_FAILURES`. The DAG is not in the second layer: its ``sensors``
parameter names columns of X, and scikit-learn's checks draw X with their own column counts,
so nearly every check would be a failure of the data rather than of the estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.ensemble import RandomForestClassifier
from sklearn.exceptions import NotFittedError
from sklearn.utils.estimator_checks import parametrize_with_checks
from sklearn.utils.validation import check_is_fitted

from training.cstc import CSTCClassifier, CSTCRegressor
from training.dag import DagClassifier
from training.gating import AdaptGbrt, AdaptLin, L1Baseline


def _small_f0() -> RandomForestClassifier:
    return RandomForestClassifier(n_estimators=10, random_state=0)


def _adapt_lin() -> AdaptLin:
    return AdaptLin(p_full=0.3, gamma=0.01, f0=_small_f0(), n_alternations=3, max_inner_iter=50)


def _l1() -> L1Baseline:
    return L1Baseline(C=0.5, f0=_small_f0())


def _gbrt() -> AdaptGbrt:
    return AdaptGbrt(
        p_full=0.3,
        lam=0.001,
        f0=_small_f0(),
        n_rounds=3,
        trees_per_round=2,
        num_leaves=4,
        min_child_samples=2,
    )


def _dag() -> DagClassifier:
    return DagClassifier(
        sensors={"a": [0, 1], "b": [2], "c": [3]},
        costs={"a": 1.0, "b": 2.0, "c": 4.0},
        cost_scale=0.001,
        folds=3,
    )


def _dag_nonlinear() -> DagClassifier:
    dag = _dag()
    dag.set_params(learner="gbrt", policy_learner="poly3")
    return dag


def _cstc() -> CSTCClassifier:
    return CSTCClassifier(costs=[1.0, 2.0, 4.0, 4.0], lam=0.001, depth=2, sharpness=10.0)


def _cscc() -> CSTCClassifier:
    return CSTCClassifier(lam=0.001, depth=3, structure="cascade", sharpness=10.0)


ESTIMATORS: dict[str, Callable[[], Any]] = {
    "adapt-lin": _adapt_lin,
    "l1": _l1,
    "adapt-gbrt": _gbrt,
    "dag": _dag,
    "dag-gbrt-poly3": _dag_nonlinear,
    "cstc": _cstc,
    "cscc": _cscc,
}


def _data(n: int = 120) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 4))
    score = X[:, 0] + 0.5 * X[:, 2] - 0.3 * X[:, 3]
    y = np.where(score > 0.3, "high", np.where(score < -0.3, "low", "mid"))
    return X, y


@pytest.mark.parametrize("make", ESTIMATORS.values(), ids=ESTIMATORS.keys())
def test_contract(make: Callable[[], Any]) -> None:
    X, y = _data()
    est = make()
    assert isinstance(est, BaseEstimator) and isinstance(est, ClassifierMixin)

    # Parameters: get_params names every __init__ argument; set_params and clone keep them.
    params = est.get_params(deep=False)
    assert set(params) == set(clone(est).get_params(deep=False))
    first = next(iter(params))
    assert est.set_params(**{first: params[first]}) is est
    with pytest.raises(ValueError, match="Invalid parameter"):
        est.set_params(no_such_parameter=1)

    # Not fitted: scikit-learn's NotFittedError from check_is_fitted and from predict.
    with pytest.raises(NotFittedError):
        check_is_fitted(est)
    with pytest.raises(NotFittedError, match="not fitted"):
        est.predict(X)

    assert est.fit(X, y) is est
    check_is_fitted(est)
    assert est.n_features_in_ == X.shape[1]
    assert list(est.classes_) == ["high", "low", "mid"]
    pred = est.predict(X)
    assert pred.shape == (X.shape[0],) and set(pred) <= set(est.classes_)
    majority = max(np.mean(y == c) for c in est.classes_)
    assert est.score(X, y) > majority  # ClassifierMixin.score; better than the majority class
    if hasattr(est, "predict_proba"):
        proba = est.predict_proba(X)
        assert proba.shape == (X.shape[0], 3)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-9)
        np.testing.assert_array_equal(est.classes_[proba.argmax(axis=1)], pred)

    # Deterministic under its random_state; a clone is a fresh, unfitted copy.
    np.testing.assert_array_equal(make().fit(X, y).predict(X), pred)
    fresh = clone(est)
    with pytest.raises(NotFittedError):
        check_is_fitted(fresh)

    # The wrong number of columns is refused with a message that says so.
    with pytest.raises(ValueError, match="X"):
        est.predict(X[:, :3])


#: scikit-learn checks that fail by design, and why (the only one; pandas and array-API checks
#: skip themselves when those libraries are missing).
EXPECTED_FAILURES: dict[str, str] = {
    "check_supervised_y_2d": (
        "a column-vector y of shape (n, 1) is refused ('y must be 1-D with one label per row "
        "of X') instead of being raveled with a DataConversionWarning: the sweeps pass y "
        "through unchanged, and a 2-D y there is a bug to report, not to fix silently"
    ),
}


def _expected_failures(est: Any) -> dict[str, str]:
    # CSTC / CSCC pass every check (they ravel nothing: y of shape (n, 1) is refused by
    # validate_data as scikit-learn's own estimators refuse it, with a warning it expects).
    return {} if isinstance(est, CSTCClassifier | CSTCRegressor) else EXPECTED_FAILURES


@parametrize_with_checks(  # type: ignore[untyped-decorator]
    [
        _adapt_lin(),
        _l1(),
        _gbrt(),
        CSTCClassifier(lam=0.001, depth=2, n_rounds=1, sharpness=10.0),
        CSTCRegressor(lam=0.001, depth=2, n_rounds=1),
    ],
    expected_failed_checks=_expected_failures,
)
def test_sklearn_checks(estimator: Any, check: Callable[[Any], None]) -> None:
    check(estimator)
