"""Adaptive gating under a feature budget: Nan & Saligrama, NIPS 2017 (ADAPT-LIN, L1 baseline).

Paper: ``shared/papers/001_195a377a9e7d790d.txt``.  A high-cost model f0 (all features) is
approximated by a low-cost model f1 plus a gate g: per example, g decides whether f1 answers
(z = 1) or the example is sent on to f0 (z = 0).  Training solves (OPT)::

    min_{f1, g, q}  1/N Σ_i Σ_z q(z|x_i) ℓ(f_z(x_i), y_i)          (losses)
                  + 1/N Σ_i KL(q(·|x_i) ‖ g(x_i))                   (gating approximation)
                  + γ Σ_α c_α ‖(g_α, f1_α)‖_2                         (costs, group-sparse)
    s.t.            1/N Σ_i q(z=0|x_i) ≤ P_full                       (fraction sent to f0)

by alternating minimisation (Alg. 1, ADAPT-LIN):

* q-step (OPT1), closed form: with q_i = q(z=0|x_i) (probability of sending x_i to f0),
  ``A_i = ℓ(f1(x_i), y_i) + log(1 + exp(g(x_i)))``  -- per-example loss of the *low-cost* branch
  (f1's log-loss plus the gate's cost of choosing z = 1, −log σ(−g)), and
  ``B_i = −log p(y_i | x_i; f0) + log(1 + exp(−g(x_i)))`` -- per-example loss of the *high-cost*
  branch (f0's log-loss plus −log σ(g)).  Minimising
  ``Σ_i (1 − q_i) A_i + q_i B_i − H(q_i)`` subject to ``mean(q) ≤ P_full`` gives
  ``q_i = 1 / (1 + exp(B_i − A_i + β))`` with the multiplier β ≥ 0 found by bisection
  (β = 0 when the unconstrained solution already satisfies the constraint).  See :func:`q_step`.
* (g, f1)-step (OPT2): a convex problem -- f1's log-loss weighted by (1 − q_i), the gate's
  cross-entropy against the soft target q_i, plus the cost-weighted group lasso tying g's and
  f1's use of each feature.  Solved by accelerated proximal gradient (FISTA with backtracking)
  in numpy, on standardised features; intercepts are not penalised.

Losses are per-example multinomial log-losses, so f1 is a softmax model and multi-class works.
The gate convention is the paper's: g(x) > 0 sends x to f0.

The L1 baseline of Sec. 5 (:class:`L1Baseline`): an L1-regularised logistic regression picks a
sparse feature subset S; f1 is a logistic regression on S; g is a logistic regression on S fitted
to f1's correctness (pseudo label 1 when f1 is right); low P(correct) sends the example to f0.

:func:`make_synthetic2` builds the paper's Synthetic-2 (four clusters, two unit-cost features).

Not implemented here: ADAPT-GBRT (Alg. 2), GreedyMiser, export/serving, benchmarks.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit, log_softmax, logsumexp
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.ensemble import RandomForestClassifier
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

__all__ = [
    "AdaptLin",
    "FittedF0",
    "L1Baseline",
    "Synthetic2",
    "make_synthetic2",
    "q_step",
]

_EPS_PROB = 1e-12


# --------------------------------------------------------------------------------------------
# q-step (OPT1)
# --------------------------------------------------------------------------------------------


def q_step(
    A: ArrayLike,
    B: ArrayLike,
    p_full: float,
    *,
    tol: float = 1e-12,
    max_iter: int = 200,
) -> tuple[FloatArray, float]:
    """Closed-form q-step of (OPT1): return ``(q, beta)``.

    ``A[i]`` is the per-example loss of the low-cost branch (f1's log-loss + log(1 + e^{g})),
    ``B[i]`` the per-example loss of the high-cost branch (f0's log-loss + log(1 + e^{−g})).
    ``q[i] = 1 / (1 + exp(B[i] − A[i] + beta))`` is the probability of sending example i to f0,
    the minimiser of ``Σ (1 − q_i) A_i + q_i B_i − H(q_i)`` subject to ``mean(q) ≤ p_full``.
    ``beta ≥ 0`` is the constraint's multiplier: 0 when the constraint is slack, otherwise found
    by bisection so that ``mean(q) == p_full`` (to ``tol``). ``p_full == 0`` gives q = 0 and
    ``beta = inf``.
    """
    a = np.asarray(A, dtype=np.float64).ravel()
    b = np.asarray(B, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"A and B must have the same length, got {a.shape[0]} and {b.shape[0]}")
    if a.size == 0:
        raise ValueError("A and B must be non-empty")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("A and B must be finite")
    p_full = _check_fraction(p_full, "p_full")
    d = a - b  # log-odds of sending to f0 before the multiplier

    def mean_q(beta: float) -> float:
        return float(np.mean(expit(d - beta)))

    if p_full <= 0.0:
        return np.zeros_like(d), math.inf
    if mean_q(0.0) <= p_full:
        return np.asarray(expit(d), dtype=np.float64), 0.0
    lo, hi = 0.0, 1.0
    while mean_q(hi) > p_full:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:  # pragma: no cover - p_full > 0 and finite d make this unreachable
            raise RuntimeError("bisection for beta failed to bracket the constraint")
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        if mean_q(mid) > p_full:
            lo = mid
        else:
            hi = mid
        if hi - lo <= tol * max(1.0, hi):
            break
    q = np.asarray(expit(d - hi), dtype=np.float64)  # hi is always feasible
    return q, hi


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_fraction(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1], got {value!r}")
    v = float(value)
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {v}")
    return v


def _check_nonneg(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a non-negative real number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be finite and >= 0, got {v}")
    return v


def _check_pos_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _check_X(X: ArrayLike, n_features: int | None = None) -> FloatArray:
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features), got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("X has no rows")
    if not np.all(np.isfinite(arr)):
        raise ValueError("X contains NaN or infinity")
    if n_features is not None and arr.shape[1] != n_features:
        raise ValueError(f"X has {arr.shape[1]} features, the model was fitted with {n_features}")
    return arr


def _check_Xy(X: ArrayLike, y: ArrayLike) -> tuple[FloatArray, NDArray[Any], IntArray]:
    Xa = _check_X(X)
    ya = np.asarray(y)
    if ya.ndim != 1 or ya.shape[0] != Xa.shape[0]:
        raise ValueError(
            f"y must be 1-D with one label per row of X ({Xa.shape[0]}), got shape {ya.shape}"
        )
    classes, y_idx = np.unique(ya, return_inverse=True)
    if classes.size < 2:
        raise ValueError("y must contain at least two classes")
    return Xa, classes, y_idx.astype(np.int64)


def _check_costs(costs: ArrayLike | None, n_features: int) -> FloatArray:
    if costs is None:
        return np.ones(n_features, dtype=np.float64)
    c = np.asarray(costs, dtype=np.float64).ravel()
    if c.shape[0] != n_features:
        raise ValueError(f"feature_costs has {c.shape[0]} entries, X has {n_features} features")
    if not (np.all(np.isfinite(c)) and np.all(c >= 0.0)):
        raise ValueError("feature_costs must be finite and >= 0")
    return c


@dataclass(frozen=True)
class _Scaler:
    mean: FloatArray
    scale: FloatArray

    @classmethod
    def fit(cls, X: FloatArray, standardize: bool = True) -> _Scaler:
        sd = X.std(axis=0)
        scale = np.where(sd > 0.0, sd, 1.0) if standardize else np.ones(X.shape[1])
        return cls(X.mean(axis=0), scale)

    def transform(self, X: FloatArray) -> FloatArray:
        Z = (X - self.mean) / self.scale
        return np.hstack([Z, np.ones((Z.shape[0], 1))])  # last column: intercept


# --------------------------------------------------------------------------------------------
# proximal gradient (FISTA with backtracking)
# --------------------------------------------------------------------------------------------


def _fista(
    smooth: Callable[[FloatArray], tuple[float, FloatArray]],
    prox: Callable[[FloatArray, float], FloatArray],
    penalty: Callable[[FloatArray], float],
    theta0: FloatArray,
    *,
    max_iter: int,
    tol: float,
) -> FloatArray:
    """Minimise ``smooth(θ) + penalty(θ)``; ``prox(v, t)`` is the proximal map of ``t·penalty``."""
    theta = theta0.copy()
    z = theta.copy()
    t_acc = 1.0
    step = 1.0
    f_prev = smooth(theta)[0] + penalty(theta)
    for _ in range(max_iter):
        fz, gz = smooth(z)
        while True:
            cand = prox(z - step * gz, step)
            diff = cand - z
            fc = smooth(cand)[0]
            if fc <= fz + float(np.sum(gz * diff)) + float(np.sum(diff * diff)) / (2.0 * step):
                break
            step *= 0.5
            if step < 1e-12:
                break
        t_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t_acc * t_acc))
        f_cand = fc + penalty(cand)
        if f_cand > f_prev:  # monotone restart
            z = theta.copy()
            t_acc = 1.0
            step *= 0.5
            if step < 1e-12:
                break
            continue
        z = cand + ((t_acc - 1.0) / t_next) * (cand - theta)
        converged = abs(f_prev - f_cand) <= tol * max(1.0, abs(f_prev))
        theta, f_prev, t_acc = cand, f_cand, t_next
        step *= 1.5  # let the step grow back
        if converged:
            break
    return theta


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
        Xa, _, y_idx = _check_Xy(X, y)
        model = clone(f0).fit(Xa, y_idx)
        proba: Any = None
        if cv is not None:
            folds = min(int(cv), int(np.bincount(y_idx).min()))
            if folds >= 2:
                splitter = StratifiedKFold(folds, shuffle=True, random_state=random_state)
                proba = cross_val_predict(
                    clone(f0), Xa, y_idx, cv=splitter, method="predict_proba"
                )
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
        Xa = _check_X(X, getattr(self, "n_features_in_", None))
        return self._answer_with_f0(Xa, self.f1_proba(Xa))

    def _check_shared_params_(self) -> None:
        """What ADAPT-LIN and ADAPT-GBRT validate alike: P_full, f0 and its folds, the rule."""
        _check_fraction(self.p_full, "p_full")
        if self.f0_cv is not None:
            _check_pos_int(self.f0_cv, "f0_cv", minimum=2)
        _check_f0_param(self.f0)
        if self.route_rule not in ("zero", "expected"):
            raise ValueError(f"route_rule must be 'zero' or 'expected', got {self.route_rule!r}")

    def routing_threshold(self) -> float:
        """The gate score above which an example goes to f0. ``route_rule="zero"`` is the
        paper's g(x) > 0. g is fitted to *soft* targets q (their mean is at most P_full), so
        when no q_i passes 1/2 the paper's rule routes nothing; ``"expected"`` routes the
        training fraction mean(q) instead: the threshold is the (1 − mean q) quantile of the
        gate's training scores (+inf when mean q = 0)."""
        rule = getattr(self, "route_rule", "zero")
        if rule == "zero":
            return 0.0
        if rule == "expected":
            return float(self.expected_threshold_)
        raise ValueError(f"route_rule must be 'zero' or 'expected', got {rule!r}")

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


class AdaptLin(_GatedClassifier):
    """ADAPT-LIN (Alg. 1): linear gate g and linear (softmax) low-cost model f1.

    Parameters
    ----------
    p_full : float in [0, 1]
        Largest fraction of training examples that q may send to f0 (the OPT constraint).
    gamma : float >= 0
        Weight of the group-sparse cost penalty γ Σ_α c_α sqrt(g_α² + ‖f1_α‖²).
    feature_costs : array of shape (n_features,) or None
        Acquisition cost c_α of each feature (default: all 1).
    f0 : classifier or None
        High-cost model on all features (cloned); default a random forest.  Must expose
        ``predict_proba``.
    f0_cv : int >= 2 or None
        Folds for the out-of-fold f0 probabilities used in B_i (f0's training-set
        probabilities are optimistic); None uses f0's in-sample probabilities.
    n_alternations : int >= 1
        Outer alternations (q-step, then (g, f1)-step).
    max_inner_iter : int >= 1
        FISTA iterations per (g, f1)-step.
    l2 : float >= 0
        Small ridge on the non-intercept weights (keeps separable problems bounded).
    tol : float > 0
        Relative tolerance of the outer objective and of FISTA.
    n_init : int >= 1
        Number of initialisations (the first: f1 fitted on all data, g = 0; the others add a
        random gate direction of scale ``init_scale`` in standardised units).  (OPT) is biconvex,
        not convex, so alternating minimisation can stall in a local minimum; the run with the
        lowest final OPT objective is kept.
    reweight : int >= 0
        Rounds of reweighted group lasso after the first solve (each sets the weight of group α
        to c_α·ε/(‖θ_α‖ + ε), ε = ``reweight_eps``), a tighter surrogate of the paper's L0 cost.
    reweight_eps : float > 0
    standardize : bool
        Apply the group penalty to standardised weights (features in different units) or to
        raw weights (features in the same units, as the paper's Synthetic-2 coordinates).
    route_rule : "zero" (the paper's g(x) > 0) or "expected" (see :meth:`routing_threshold`)
    random_state : int or None

    Attributes (after ``fit``)
    --------------------------
    classes_, n_features_in_, f0_ (fitted f0), gate_coef_ (n_features,), gate_intercept_,
    f1_coef_ (n_features, n_classes), f1_intercept_ (n_classes,), gate_features_,
    f1_features_, low_cost_features_ (indices used by g ∪ f1), f0_features_ (all features),
    low_cost_ (Σ c over g ∪ f1), full_cost_ (Σ c over all features), q_ (final training q),
    beta_, objective_ (OPT value per alternation), n_alternations_run_.

    Per example: ``route(X)`` (True = sent to f0), ``answered_by(X)`` (0 = f0, 1 = f1, the
    paper's z), ``feature_cost(X)`` (cost of the features acquired for that example).
    """

    def __init__(
        self,
        p_full: float = 0.3,
        gamma: float = 0.01,
        *,
        feature_costs: ArrayLike | None = None,
        f0: Any = None,
        f0_cv: int | None = 3,
        n_alternations: int = 20,
        max_inner_iter: int = 300,
        l2: float = 1e-4,
        tol: float = 1e-6,
        n_init: int = 1,
        init_scale: float = 2.0,
        reweight: int = 0,
        reweight_eps: float = 0.1,
        standardize: bool = True,
        route_rule: str = "zero",
        random_state: int | None = 0,
    ) -> None:
        self.route_rule = route_rule
        self.standardize = standardize
        self.n_init = n_init
        self.reweight = reweight
        self.reweight_eps = reweight_eps
        self.init_scale = init_scale
        self.p_full = p_full
        self.gamma = gamma
        self.feature_costs = feature_costs
        self.f0 = f0
        self.f0_cv = f0_cv
        self.n_alternations = n_alternations
        self.max_inner_iter = max_inner_iter
        self.l2 = l2
        self.tol = tol
        self.random_state = random_state

    # -- parameter validation ------------------------------------------------------------
    def _validate_params_(self) -> None:
        self._check_shared_params_()
        _check_nonneg(self.gamma, "gamma")
        _check_pos_int(self.n_alternations, "n_alternations")
        _check_pos_int(self.max_inner_iter, "max_inner_iter")
        _check_pos_int(self.n_init, "n_init")
        _check_nonneg(self.init_scale, "init_scale")
        _check_pos_int(self.reweight, "reweight", minimum=0)
        if _check_nonneg(self.reweight_eps, "reweight_eps") == 0.0:
            raise ValueError("reweight_eps must be > 0")
        _check_nonneg(self.l2, "l2")
        tol = _check_nonneg(self.tol, "tol")
        if tol == 0.0:
            raise ValueError("tol must be > 0")

    # -- fitting -------------------------------------------------------------------------
    def fit(self, X: ArrayLike, y: ArrayLike) -> AdaptLin:
        self._validate_params_()
        Xa, classes, y_idx = _check_Xy(X, y)
        n, k = Xa.shape
        m = classes.size
        costs = _check_costs(self.feature_costs, k)
        self.classes_ = classes
        self.n_features_in_ = k
        self.costs_ = costs

        fitted = _fit_f0(self.f0, Xa, y_idx, self.f0_cv, self.random_state)
        self.f0_ = fitted.model
        p0 = fitted.oof_proba
        loss0 = -np.log(np.clip(p0[np.arange(n), y_idx], _EPS_PROB, 1.0))

        self.scaler_ = _Scaler.fit(Xa, bool(self.standardize))
        Z = self.scaler_.transform(Xa)
        Y = np.zeros((n, m))
        Y[np.arange(n), y_idx] = 1.0
        gamma = float(self.gamma)
        l2 = float(self.l2)
        tol = float(self.tol)

        # θ = [W (k+1, m) for f1 | v (k+1,) for g], rows 0..k-1 features, row k intercept.
        def unpack(theta: FloatArray) -> tuple[FloatArray, FloatArray]:
            P = theta.reshape(k + 1, m + 1)
            return P[:, :m], P[:, m]

        def smooth_for(q: FloatArray) -> Callable[[FloatArray], tuple[float, FloatArray]]:
            w1 = 1.0 - q

            def smooth(theta: FloatArray) -> tuple[float, FloatArray]:
                W, v = unpack(theta)
                S = Z @ W
                lsm = log_softmax(S, axis=1)
                loss1 = -np.sum(lsm * Y, axis=1)
                s = Z @ v
                gate = w1 * np.logaddexp(0.0, s) + q * np.logaddexp(0.0, -s)
                val = float(np.sum(w1 * loss1 + gate) / n)
                gW = Z.T @ (w1[:, None] * (np.exp(lsm) - Y)) / n
                gv = Z.T @ (expit(s) - q) / n
                val += 0.5 * l2 * (float(np.sum(W[:k] ** 2)) + float(np.sum(v[:k] ** 2)))
                gW[:k] += l2 * W[:k]
                gv[:k] += l2 * v[:k]
                return val, np.hstack([gW, gv[:, None]]).ravel()

            return smooth

        weights = costs.copy()  # per-feature group weights; reweighted when reweight > 0

        def penalty(theta: FloatArray) -> float:
            P = theta.reshape(k + 1, m + 1)[:k]
            return gamma * float(np.sum(weights * np.sqrt(np.sum(P * P, axis=1))))

        def prox(theta: FloatArray, step: float) -> FloatArray:
            P = theta.reshape(k + 1, m + 1).copy()
            norms = np.sqrt(np.sum(P[:k] ** 2, axis=1))
            thr = step * gamma * weights
            shrink = np.where(norms > thr, 1.0 - thr / np.maximum(norms, 1e-300), 0.0)
            P[:k] *= shrink[:, None]
            return P.ravel()

        def branch_losses(theta: FloatArray) -> tuple[FloatArray, FloatArray]:
            W, v = unpack(theta)
            loss1 = -log_softmax(Z @ W, axis=1)[np.arange(n), y_idx]
            s = Z @ v
            return loss1 + np.logaddexp(0.0, s), loss0 + np.logaddexp(0.0, -s)

        def objective(theta: FloatArray, q: FloatArray) -> float:
            A, B = branch_losses(theta)
            with np.errstate(divide="ignore", invalid="ignore"):
                ent = -(
                    np.where(q > 0, q * np.log(q), 0.0)
                    + np.where(q < 1, (1 - q) * np.log1p(-q), 0.0)
                )
            return float(np.mean((1 - q) * A + q * B - ent)) + penalty(theta)

        def alternate(theta: FloatArray) -> tuple[FloatArray, FloatArray, float, list[float]]:
            history: list[float] = []
            q = np.zeros(n)
            beta = 0.0
            for _ in range(int(self.n_alternations)):
                A, B = branch_losses(theta)
                q, beta = q_step(A, B, float(self.p_full))
                theta = _fista(
                    smooth_for(q), prox, penalty, theta, max_iter=int(self.max_inner_iter), tol=tol
                )
                history.append(objective(theta, q))
                if len(history) >= 2 and abs(history[-2] - history[-1]) <= tol * max(
                    1.0, abs(history[-2])
                ):
                    break
            return theta, q, beta, history

        # Initialisation 0: f1 fitted on every example (q = 0), gate at 0 (indifferent).
        # Further initialisations (n_init > 1) keep that f1 and start the gate from a random
        # direction; (OPT) is only biconvex, so the run with the lowest final objective wins.
        theta0 = _fista(
            smooth_for(np.zeros(n)),
            prox,
            penalty,
            np.zeros((k + 1) * (m + 1)),
            max_iter=int(self.max_inner_iter),
            tol=tol,
        )
        rng = np.random.default_rng(self.random_state)
        best: tuple[FloatArray, FloatArray, float, list[float]] | None = None
        self.init_objectives_: list[float] = []
        for run in range(int(self.n_init)):
            start = theta0.copy()
            if run > 0:
                P = start.reshape(k + 1, m + 1)
                P[:k, m] = rng.normal(scale=self.init_scale, size=k)
                P[k, m] = 0.0
            result = alternate(start)
            self.init_objectives_.append(result[3][-1])
            if best is None or result[3][-1] < best[3][-1]:
                best = result
        assert best is not None
        # Optional reweighted group lasso (Candès-Wakin-Boyd style): the paper's cost term is
        # γ Σ_α c_α ‖V_α + W_α‖_0, relaxed to an L2,1 norm; each reweighting round sets the
        # group weight to c_α · s / (‖θ_α‖ + s) (s = reweight_eps), a closer surrogate of the
        # L0 cost, and re-runs the alternation warm-started.
        eps_rw = float(self.reweight_eps)
        for _ in range(int(self.reweight)):
            P = best[0].reshape(k + 1, m + 1)[:k]
            norms = np.sqrt(np.sum(P * P, axis=1))
            weights[:] = costs * eps_rw / (norms + eps_rw)
            best = alternate(best[0])
        theta, q, beta, history = best
        it = len(history)

        W, v = unpack(theta)
        scale = self.scaler_.scale
        # back to raw feature units: z = (x − μ)/σ  ⇒  w_raw = w/σ, b_raw = b − Σ μ w/σ
        self.f1_coef_ = W[:k] / scale[:, None]
        self.f1_intercept_ = W[k] - self.scaler_.mean @ self.f1_coef_
        self.gate_coef_ = v[:k] / scale
        self.gate_intercept_ = float(v[k] - self.scaler_.mean @ self.gate_coef_)
        self.gate_features_ = np.flatnonzero(v[:k] != 0.0).astype(np.int64)
        self.f1_features_ = np.flatnonzero(np.any(W[:k] != 0.0, axis=1)).astype(np.int64)
        self.low_cost_features_ = np.union1d(self.gate_features_, self.f1_features_).astype(
            np.int64
        )
        self.f0_features_ = np.arange(k, dtype=np.int64)
        self.low_cost_ = float(costs[self.low_cost_features_].sum())
        self.full_cost_ = float(costs.sum())
        self.q_ = q
        self.beta_ = beta
        self.objective_ = history
        self.n_alternations_run_ = it
        self._set_expected_threshold(self.gate_score(Xa), q)
        return self

    # -- prediction ----------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not hasattr(self, "f0_"):
            raise RuntimeError("this AdaptLin is not fitted yet; call fit(X, y) first")

    def gate_score(self, X: ArrayLike) -> FloatArray:
        """g(x): > 0 sends the example to f0."""
        self._check_fitted()
        Xa = _check_X(X, self.n_features_in_)
        return np.asarray(Xa @ self.gate_coef_ + self.gate_intercept_, dtype=np.float64)

    def f1_proba(self, X: ArrayLike) -> FloatArray:
        self._check_fitted()
        Xa = _check_X(X, self.n_features_in_)
        S = Xa @ self.f1_coef_ + self.f1_intercept_
        return np.asarray(np.exp(S - logsumexp(S, axis=1, keepdims=True)), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# L1 baseline
# --------------------------------------------------------------------------------------------


class L1Baseline(_GatedClassifier):
    """The paper's L1 baseline (Sec. 5).

    1. L1-regularised logistic regression (regularisation ``C``, standardised features) on all
       data; S = features with a non-zero coefficient for any class.
    2. f1 = logistic regression on the features S.
    3. g = logistic regression on S fitted to f1's correctness (pseudo label 1 when f1 is
       right on the training example); an example goes to f0 when P(correct | x) <
       ``gate_threshold``.  f0 is a high-cost model on all features (default a random forest).

    Per-example ``feature_cost``: Σ c over S for examples answered by f1, Σ c over all features
    for examples sent to f0.
    """

    def __init__(
        self,
        C: float = 0.1,
        gate_threshold: float = 0.5,
        *,
        feature_costs: ArrayLike | None = None,
        f0: Any = None,
        random_state: int | None = 0,
    ) -> None:
        self.C = C
        self.gate_threshold = gate_threshold
        self.feature_costs = feature_costs
        self.f0 = f0
        self.random_state = random_state

    def fit(self, X: ArrayLike, y: ArrayLike) -> L1Baseline:
        C = _check_nonneg(self.C, "C")
        if C == 0.0:
            raise ValueError("C must be > 0")
        _check_fraction(self.gate_threshold, "gate_threshold")
        _check_f0_param(self.f0)
        Xa, classes, y_idx = _check_Xy(X, y)
        k = Xa.shape[1]
        self.classes_ = classes
        self.n_features_in_ = k
        self.costs_ = _check_costs(self.feature_costs, k)
        self.scaler_ = _Scaler.fit(Xa)
        Z = self.scaler_.transform(Xa)[:, :k]
        self.prior_ = np.bincount(y_idx, minlength=classes.size) / y_idx.size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            sel = LogisticRegression(
                C=C, l1_ratio=1.0, solver="saga", max_iter=5000, random_state=self.random_state
            ).fit(Z, y_idx)
            self.selected_ = np.flatnonzero(np.any(sel.coef_ != 0.0, axis=0)).astype(np.int64)
            S = self.selected_
            self.f1_ = LogisticRegression(max_iter=2000).fit(Z[:, S], y_idx) if S.size else None
            f1_pred = self._f1_predict_idx(Z)
            correct = (f1_pred == y_idx).astype(np.int64)
            if S.size and 0 < correct.sum() < correct.size:
                self.gate_: LogisticRegression | None = LogisticRegression(max_iter=2000).fit(
                    Z[:, S], correct
                )
                self.gate_const_ = math.nan
            else:
                self.gate_ = None
                self.gate_const_ = float(correct.mean())
        self.f0_ = _fit_f0(self.f0, Xa, y_idx, None, self.random_state).model
        self.n_classes_ = classes.size
        self.low_cost_ = float(self.costs_[self.selected_].sum())
        self.full_cost_ = float(self.costs_.sum())
        return self

    def _f1_proba_z(self, Z: FloatArray) -> FloatArray:
        if self.f1_ is None:
            return np.tile(self.prior_, (Z.shape[0], 1))
        return np.asarray(self.f1_.predict_proba(Z[:, self.selected_]), dtype=np.float64)

    def _f1_predict_idx(self, Z: FloatArray) -> IntArray:
        if self.f1_ is None:
            return np.full(Z.shape[0], int(np.argmax(self.prior_)), dtype=np.int64)
        return np.asarray(self.f1_.predict(Z[:, self.selected_]), dtype=np.int64)

    def _z(self, X: ArrayLike) -> FloatArray:
        if not hasattr(self, "f0_"):
            raise RuntimeError("this L1Baseline is not fitted yet; call fit(X, y) first")
        Xa = _check_X(X, self.n_features_in_)
        return self.scaler_.transform(Xa)[:, : self.n_features_in_]

    def p_correct(self, X: ArrayLike) -> FloatArray:
        """The gate's estimate of P(f1 is right | x)."""
        Z = self._z(X)
        if self.gate_ is None:
            return np.full(Z.shape[0], self.gate_const_)
        return np.asarray(self.gate_.predict_proba(Z[:, self.selected_])[:, 1], dtype=np.float64)

    def route(self, X: ArrayLike) -> BoolArray:
        """True where the example is sent to f0."""
        return np.asarray(self.p_correct(X) < float(self.gate_threshold), dtype=np.bool_)

    def predict_proba(self, X: ArrayLike) -> FloatArray:
        Z = self._z(X)
        Xa = np.asarray(X, dtype=np.float64)
        proba = self._f1_proba_z(Z)
        return self._answer_with_f0(Xa, proba)


# --------------------------------------------------------------------------------------------
# Synthetic-2
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Synthetic2:
    X: FloatArray
    y: IntArray
    cluster: IntArray


# cluster centres (feature 1 = horizontal x, feature 2 = vertical y) and labels
SYNTHETIC2_CENTRES: tuple[tuple[float, float], ...] = (
    (-4.0, 4.0),
    (0.0, 4.0),
    (0.0, 0.0),
    (0.0, -4.0),
)
SYNTHETIC2_LABELS: tuple[int, ...] = (1, 0, 1, 0)


def make_synthetic2(
    n_per_cluster: int | Sequence[int] = 100, *, std: float = 0.25, seed: int = 0
) -> Synthetic2:
    """The paper's Synthetic-2 (Fig. 3): four Gaussian clusters, two unit-cost features.

    The paper gives no coordinates; this layout has the properties its text states:

    * cluster 1 (left, top, class 1) is split from the rest by a *vertical* line (feature 1),
      and feature 1 is the first to enter the L1 path (|corr(x_1, y)| ≈ 0.58 > |corr(x_2, y)|
      ≈ 0.30), so the L1 baseline picks feature 1; with feature 1 alone f1 can only be sure of
      cluster 1, so its best full-accuracy system sends clusters 2-4 to f0: cost 1 + 3/4 = 1.75;
    * clusters 1, 2 (top) vs 3, 4 (bottom) are split by a *horizontal* line, and so are
      clusters 3 and 4: g and f1 on feature 2 alone send 1, 2 to f0 and classify 3, 4, which is
      the optimal adaptive system at full accuracy, cost 0.5·2 + 0.5·1 = 1.5.

    Clusters have equal size by default (the text says clusters 1 and 2 get more points, but the
    quoted costs 1.75 and 1.5 are those of equal clusters).
    """
    counts = (
        [int(n_per_cluster)] * 4
        if isinstance(n_per_cluster, int)
        else [int(c) for c in n_per_cluster]
    )
    if len(counts) != 4 or min(counts) < 1:
        raise ValueError("n_per_cluster must be a positive int or four positive ints")
    _check_nonneg(std, "std")
    rng = np.random.default_rng(seed)
    xs, ys, cs = [], [], []
    for c, (centre, label, cnt) in enumerate(
        zip(SYNTHETIC2_CENTRES, SYNTHETIC2_LABELS, counts, strict=True)
    ):
        xs.append(rng.normal(loc=centre, scale=std, size=(cnt, 2)))
        ys.append(np.full(cnt, label, dtype=np.int64))
        cs.append(np.full(cnt, c, dtype=np.int64))
    return Synthetic2(np.vstack(xs), np.concatenate(ys), np.concatenate(cs))
