"""What every gated system (ADAPT-LIN, L1, ADAPT-GBRT, GreedyMiser) shares: parameter and data
checks, the high-cost model f0 (:class:`FittedF0`), and :class:`_GatedClassifier` (routing to
f0, cost accounting, predict_proba).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.ensemble import RandomForestClassifier
from sklearn.model_selection import StratifiedKFold, cross_val_predict

from service.types import FloatArray
from training._validation import (
    check_fraction,
    check_pos_int,
    check_X,
    check_Xy,
)

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


_EPS_PROB = 1e-12

#: How a fitted gate's score becomes a decision (see ``_GatedClassifier.routing_threshold``).
ROUTE_RULES = ("zero", "expected", "value")

# --------------------------------------------------------------------------------------------
# the high-cost model f0
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FittedF0:
    """A high-cost model fitted once and shared by the fits of a sweep: ``model`` (fitted on
    the training rows, class indices 0..m-1 in ``np.unique(y)`` order) and ``oof_proba``,
    its out-of-fold class probabilities on those rows (for B_i; in-sample probabilities
    of a forest are optimistic). Pass it as ``f0=`` to skip refitting."""

    model: Any
    oof_proba: FloatArray

    @classmethod
    def fit(
        cls,
        f0: Any,
        X: ArrayLike,
        y: ArrayLike,
        *,
        cv: int | None = 3,
        random_state: int | None = 0,
    ) -> FittedF0:
        Xa, _, y_idx = check_Xy(X, y)
        model = clone(f0).fit(Xa, y_idx)
        proba: Any = None
        if cv is not None:
            folds = min(int(cv), int(np.bincount(y_idx).min()))
            if folds >= 2:
                splitter = StratifiedKFold(folds, shuffle=True, random_state=random_state)
                proba = cross_val_predict(clone(f0), Xa, y_idx, cv=splitter, method="predict_proba")
        if proba is None:
            if cv is not None:
                warnings.warn(
                    f"a class has fewer than 2 training rows: f0's out-of-fold probabilities "
                    f"({cv} folds) are replaced by its in-sample ones, which are optimistic",
                    UserWarning,
                    stacklevel=2,
                )
            proba = model.predict_proba(Xa)
        return cls(model, np.asarray(proba, dtype=np.float64))


def default_f0(random_state: int | None = 0) -> Any:
    """The paper's f0 for ADAPT-LIN experiments: a random forest on all features."""
    return RandomForestClassifier(n_estimators=200, random_state=random_state)


def _fit_f0(
    f0: Any, Xa: FloatArray, y_idx: IntArray, cv: int | None, random_state: int | None
) -> FittedF0:
    if isinstance(f0, FittedF0):
        if f0.oof_proba.shape[0] != Xa.shape[0]:
            raise ValueError(
                f"the FittedF0 was fitted on {f0.oof_proba.shape[0]} rows, X has {Xa.shape[0]}"
            )
        return f0
    model = default_f0(random_state) if f0 is None else f0
    return FittedF0.fit(model, Xa, y_idx, cv=cv, random_state=random_state)


def _check_f0_param(f0: Any) -> None:
    if f0 is not None and not isinstance(f0, FittedF0) and not hasattr(f0, "predict_proba"):
        raise TypeError("f0 must be a classifier with predict_proba (or a FittedF0)")


# --------------------------------------------------------------------------------------------
# grouped features: a sensor's columns, its cost paid once
# --------------------------------------------------------------------------------------------


def check_feature_groups(groups: Any, costs: FloatArray) -> list[IntArray]:
    """The column groups of a gated system (a sensor's columns: its cost is paid once,
    whatever columns of it are read): ``None`` is one group per column; otherwise every
    column in exactly one group, and a group's columns carry the same cost (the sensor's)."""
    k = costs.shape[0]
    if groups is None:
        return [np.asarray([c], dtype=np.int64) for c in range(k)]
    out = [np.asarray(list(g), dtype=np.int64) for g in groups]
    seen = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if any(g.size == 0 for g in out) or np.sort(seen).tolist() != list(range(k)):
        raise ValueError(
            f"feature_groups must put each of the {k} columns in exactly one non-empty group "
            f"(a sensor's columns), got {[g.tolist() for g in out]}"
        )
    for g in out:
        if not np.all(costs[g] == costs[g[0]]):
            raise ValueError(
                f"the columns {g.tolist()} of one group have costs {costs[g].tolist()}; a "
                "group is one sensor with one cost: give each of its columns that cost"
            )
    return out


def groups_cost(groups: list[IntArray], costs: FloatArray, columns: Any) -> float:
    """The cost of reading ``columns``: each group touched paid once."""
    used = set(np.asarray(columns, dtype=np.int64).tolist())
    return float(sum(costs[g[0]] for g in groups if used & set(g.tolist())))


def expand_to_groups(groups: list[IntArray], columns: Any) -> IntArray:
    """``columns`` completed to whole groups, in column order."""
    used = set(np.asarray(columns, dtype=np.int64).tolist())
    out = sorted(c for g in groups if used & set(g.tolist()) for c in g.tolist())
    return np.asarray(out, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# ADAPT-LIN
# --------------------------------------------------------------------------------------------


class _GatedClassifier(ClassifierMixin, BaseEstimator):  # type: ignore[misc]
    """What the adaptive systems share: the gate sends some examples to the high-cost model
    f0 (``route``), the low-cost model answers the others."""

    def gate_score(self, X: ArrayLike) -> FloatArray:
        """g(x): above :meth:`routing_threshold` the example goes to f0."""
        raise NotImplementedError

    def f1_proba(self, X: ArrayLike) -> FloatArray:
        raise NotImplementedError

    def route(self, X: ArrayLike) -> BoolArray:
        """True where the gate sends the example to the high-cost model f0."""
        return np.asarray(self.gate_score(X) > self.routing_threshold(), dtype=np.bool_)

    def answered_by(self, X: ArrayLike) -> IntArray:
        """The paper's z per example: 0 = f0 answered, 1 = f1 answered."""
        return np.where(self.route(X), 0, 1).astype(np.int64)

    def feature_cost(self, X: ArrayLike) -> FloatArray:
        """Cost of the features acquired per example (g ∪ f1, plus f0's when routed to f0)."""
        full, low = float(self.full_cost_), float(self.low_cost_)
        return np.where(self.route(X), full, low).astype(np.float64)

    def predict_proba(self, X: ArrayLike) -> FloatArray:
        """f1's class probabilities, f0's for the examples the gate routes."""
        Xa = check_X(X, getattr(self, "n_features_in_", None), type(self).__name__)
        return self._answer_with_f0(Xa, self.f1_proba(Xa))

    def _check_shared_params_(self) -> None:
        """What ADAPT-LIN and ADAPT-GBRT validate alike: P_full, f0 and its folds, the rule."""
        check_fraction(self.p_full, "p_full")
        if self.f0_cv is not None:
            check_pos_int(self.f0_cv, "f0_cv", minimum=2)
        _check_f0_param(self.f0)
        if self.route_rule not in ROUTE_RULES:
            raise ValueError(
                f"route_rule must be one of {list(ROUTE_RULES)}, got {self.route_rule!r}"
            )

    def routing_threshold(self) -> float:
        """The gate score above which an example goes to f0. ``route_rule="zero"`` is the
        paper's g(x) > 0. g is fitted to *soft* targets q (their mean is at most P_full), so
        when no q_i passes 1/2 the paper's rule routes nothing; ``"expected"`` routes the
        training fraction mean(q) instead: the threshold is the (1 − mean q) quantile of the
        gate's training scores (+inf when mean q = 0). ``"value"`` uses ``route_threshold``
        as given (the sweep sets it on validation rows to route a chosen fraction)."""
        rule = getattr(self, "route_rule", "zero")
        if rule == "zero":
            return 0.0
        if rule == "expected":
            return float(self.expected_threshold_)
        if rule == "value":
            return float(getattr(self, "route_threshold", 0.0))
        raise ValueError(f"route_rule must be one of {list(ROUTE_RULES)}, got {rule!r}")

    def _set_expected_threshold(self, train_scores: FloatArray, q: FloatArray) -> None:
        """The threshold whose training routed fraction is closest to mean(q), placed midway
        between two distinct scores (tree ensembles give many equal scores; a threshold on
        one of them would flip them all under float32 inference)."""
        target = float(np.mean(q))
        scores = np.sort(np.asarray(train_scores, dtype=np.float64))
        if target <= 0.0 or not np.all(np.isfinite(scores)):
            self.expected_threshold_ = math.inf
            return
        distinct = np.unique(scores)
        candidates = np.concatenate(
            [[distinct[0] - 1.0], (distinct[:-1] + distinct[1:]) / 2.0, [distinct[-1] + 1.0]]
        )
        routed = 1.0 - np.searchsorted(scores, candidates, side="right") / scores.size
        # closest to the target; on a tie the higher threshold (fewer items sent to f0)
        best = int(np.flatnonzero(np.abs(routed - target) == np.min(np.abs(routed - target)))[-1])
        self.expected_threshold_ = float(candidates[best])

    def _answer_with_f0(self, Xa: FloatArray, proba: FloatArray) -> FloatArray:
        """``proba`` (the low-cost model's) with f0's answers for the examples routed to it."""
        to_f0 = self.route(Xa)
        if np.any(to_f0):
            proba[to_f0] = np.asarray(self.f0_.predict_proba(Xa[to_f0]), dtype=np.float64)
        return proba

    def predict(self, X: ArrayLike) -> NDArray[Any]:
        proba = self.predict_proba(X)
        return np.asarray(self.classes_[np.argmax(proba, axis=1)])
