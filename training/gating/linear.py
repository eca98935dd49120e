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

ADAPT-GBRT and GreedyMiser are in :mod:`training.gating.gbrt`, the solvers in
:mod:`training.gating.solvers`, what every gated system shares in :mod:`training.gating.base`.
The module stays whole (over 450 lines): the two linear systems stay together because L1 is
ADAPT-LIN's baseline and they share its f1 model and export shape.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import expit, log_softmax, logsumexp
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from service.types import FloatArray
from training._validation import (
    check_costs,
    check_fitted,
    check_fraction,
    check_nonneg,
    check_pos_int,
    check_X,
    check_Xy,
)
from training.gating.base import (
    _EPS_PROB,
    BoolArray,
    IntArray,
    _check_f0_param,
    _fit_f0,
    _GatedClassifier,
)
from training.gating.solvers import _fista, _Scaler, q_step


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
        Number of initialisations (the first: f1 fitted on all data with g ≡ 0, so the first
        q-step routes the rows where f1's loss exceeds f0's most, up to P_full; the others
        start the gate from a random direction of scale ``init_scale`` in standardised units).
        (OPT) is biconvex, not convex, so alternating minimisation can stall in a local
        minimum; the run with the lowest final OPT objective is kept. On Synthetic-2 the first
        start alone ends at full accuracy and cost 1.75 (objective 0.212 at γ 0.05, P_full
        0.5), the fourth reaches the optimum, cost 1.5 (0.121): hence the default 4.
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
        n_init: int = 4,
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
        check_nonneg(self.gamma, "gamma")
        check_pos_int(self.n_alternations, "n_alternations")
        check_pos_int(self.max_inner_iter, "max_inner_iter")
        check_pos_int(self.n_init, "n_init")
        check_nonneg(self.init_scale, "init_scale")
        check_pos_int(self.reweight, "reweight", minimum=0)
        if check_nonneg(self.reweight_eps, "reweight_eps") == 0.0:
            raise ValueError("reweight_eps must be > 0")
        check_nonneg(self.l2, "l2")
        tol = check_nonneg(self.tol, "tol")
        if tol == 0.0:
            raise ValueError("tol must be > 0")

    # -- fitting -------------------------------------------------------------------------
    def fit(self, X: ArrayLike, y: ArrayLike) -> AdaptLin:
        self._validate_params_()
        Xa, classes, y_idx = check_Xy(X, y, type(self).__name__)
        n, k = Xa.shape
        m = classes.size
        costs = check_costs(self.feature_costs, k)
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

        def smooth_for(
            q: FloatArray, *, fit_gate: bool = True
        ) -> Callable[[FloatArray], tuple[float, FloatArray]]:
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
                if not fit_gate:  # g stays where it is (0 at the start: see below)
                    gv[:] = 0.0
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

        # Initialisation 0: f1 fitted on every example (q = 0) with the gate held at g ≡ 0,
        # which is indifferent (σ(0) = 1/2 either way). The first q-step then routes on the
        # loss gap A − B = ℓ(f1) − ℓ(f0) alone: the rows where f0 beats f1 most, as many as
        # P_full allows (β). Fitting g to q = 0 as well would drive its intercept far negative
        # (about −8.9 on Synthetic-2) and the q-steps would never route a row.
        # Further initialisations (n_init > 1) keep that f1 and start the gate from a random
        # direction; (OPT) is only biconvex, so the run with the lowest final objective wins.
        theta0 = _fista(
            smooth_for(np.zeros(n), fit_gate=False),
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
        check_fitted(self, "f0_")

    def gate_score(self, X: ArrayLike) -> FloatArray:
        """g(x): > 0 sends the example to f0."""
        self._check_fitted()
        Xa = check_X(X, self.n_features_in_, type(self).__name__)
        return np.asarray(Xa @ self.gate_coef_ + self.gate_intercept_, dtype=np.float64)

    def f1_proba(self, X: ArrayLike) -> FloatArray:
        self._check_fitted()
        Xa = check_X(X, self.n_features_in_, type(self).__name__)
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
        C = check_nonneg(self.C, "C")
        if C == 0.0:
            raise ValueError("C must be > 0")
        check_fraction(self.gate_threshold, "gate_threshold")
        _check_f0_param(self.f0)
        Xa, classes, y_idx = check_Xy(X, y, type(self).__name__)
        k = Xa.shape[1]
        self.classes_ = classes
        self.n_features_in_ = k
        self.costs_ = check_costs(self.feature_costs, k)
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
        check_fitted(self, "f0_")
        Xa = check_X(X, self.n_features_in_, type(self).__name__)
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
