"""ADAPT-GBRT (Nan & Saligrama, NIPS 2017, Alg. 2) and GreedyMiser, on LightGBM.

The gate g and the low-cost model f1 are boosted ensembles of small trees; f0 is a high-cost
model on all features (any classifier with ``predict_proba``; see :mod:`training.gating.adapt`).
A feature costs λ·c_α the first time either ensemble splits on it and nothing afterwards.

How the schedule maps to the paper's Alg. 2::

    Train f0. Initialise g, f1.                  -> f0 (+ out-of-fold losses); g ≡ 0, f1 ≡ 0
    repeat                                        -> for each of ``n_rounds`` rounds:
      Solve (OPT1) for q given g, f1.             ->   q_step(A, B, P_full) (closed form, β ≥ 0)
      for t = 1..T:                               ->   one block of ``trees_per_round`` trees:
        f1 += CART tree minimising (1)            ->     f1: LightGBM multiclass log-loss with
                                                  ->     per-example weights (1 − q_i), i.e. the
                                                  ->     q-weighted f1 term of (OPT2)
        u_α = 0 for every feature the tree uses   ->     cegb_penalty_feature_coupled =
                                                  ->     λ·N·c_α·u_α: LightGBM charges it on the
                                                  ->     first split on α in this block, and we
                                                  ->     zero u_α for features either ensemble
                                                  ->     already used in earlier blocks
        g += CART tree minimising (2)             ->     g: LightGBM cross-entropy against the
                                                  ->     soft targets q_i (the KL(q ‖ σ(g)) term)
        u_α = 0 for every feature the tree uses   ->     as above, shared with f1
    until convergence                             -> fixed number of rounds (objective recorded)

Differences from the paper, on purpose: trees are added in blocks (one LightGBM call per
block, continuing the ensemble with ``init_model``) rather than one at a time, and f1's tree
and g's tree of a step are grown in sequence (f1's block first) instead of interleaved; the
penalty is scaled by N because LightGBM's split gains are sums over examples while the paper's
impurity uses the mean. LightGBM's gain Σ G²/H is twice the second-order loss reduction (and
its multiclass objective scales the hessian by m/(m − 1)), so λ (``lam``) charges about λ/2 of
per-example log-loss per unit of feature cost: a cost weight per example like ADAPT-LIN's γ,
up to that constant. The sweep treats λ as a knob, not as γ's exact equivalent.
GreedyMiser (Xu et al. 2012) is the special case P_full = 0: no example goes to f0, g is never
trained, f1 is cost-efficient boosting alone (:func:`greedy_miser`).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightgbm as lgb
import numpy as np
from numpy.typing import ArrayLike
from scipy.special import log_softmax, softmax
from sklearn.model_selection import StratifiedKFold

from service.types import FloatArray
from training._validation import (
    check_costs,
    check_fitted,
    check_nonneg,
    check_pos_int,
    check_X,
    check_Xy,
)
from training.gating.base import (
    _EPS_PROB,
    BoolArray,
    IntArray,
    _fit_f0,
    _GatedClassifier,
    check_feature_groups,
    expand_to_groups,
    groups_cost,
)
from training.gating.solvers import q_step

__all__ = ["AdaptGbrt", "default_gbrt_f0", "greedy_miser"]


def default_gbrt_f0(random_state: int | None = 0) -> Any:
    """A compact, accurate f0 for tabular data: gradient boosting on all features."""
    return lgb.LGBMClassifier(
        n_estimators=300,
        learning_rate=0.05,
        num_leaves=31,
        random_state=random_state,
        n_jobs=1,
        verbose=-1,
    )


def _entropy(q: FloatArray) -> FloatArray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return -(np.where(q > 0, q * np.log(q), 0.0) + np.where(q < 1, (1 - q) * np.log1p(-q), 0.0))


class AdaptGbrt(_GatedClassifier):
    """ADAPT-GBRT (Alg. 2): boosted-tree gate g and low-cost model f1 sharing feature costs.

    Parameters
    ----------
    p_full : float in [0, 1]
        Largest fraction of training examples q may send to f0. 0 gives GreedyMiser.
    lam : float >= 0
        Cost weight λ: a split on a not-yet-used feature α must gain more than λ·N·c_α.
    feature_costs : array of shape (n_features,) or None (all 1)
    f0 : classifier, :class:`training.gating.adapt.FittedF0` or None (gradient boosting)
    f0_cv : int >= 2 or None
        Folds for f0's out-of-fold probabilities in B_i (None: in-sample).
    n_rounds : int >= 1
        Alternations (q-step, then a block of trees for f1 and for g).
    trees_per_round : int >= 1
        Boosting iterations per ensemble per round (T in Alg. 2).
    num_leaves, learning_rate, min_child_samples : LightGBM tree parameters (small trees, as
        the paper's "limited-depth regression trees").
    route_rule : "zero" (the paper's g(x) > 0), "expected" (route the training fraction
        mean(q)) or "value" (g(x) > ``route_threshold``); see :meth:`routing_threshold`
    route_threshold : float, the threshold of the "value" rule (the sweep sets it on
        validation rows)
    feature_groups : list of column lists, or None (each column its own)
        Sensors of several columns: a sensor's cost is paid once, whatever columns of it
        either ensemble reads. Each of its columns carries the sensor's cost in
        ``feature_costs``; a column's penalty is that cost until the block of trees in which
        any column of its sensor is first used, 0 afterwards (within one block LightGBM
        charges the columns separately, so two new columns of one sensor in the same block
        are charged twice: an approximation of the training penalty only; ``low_cost_`` and
        the exported points pay each sensor once).
    f1_cv : int >= 2 or None
        Folds for f1's *cross-fitted* losses in the q-step (None: f1's in-sample losses, as
        in the paper). f0's losses in B_i are out-of-fold (``f0_cv``); a boosted f1 fits its
        own training rows far better than new ones, so with in-sample losses q compares an
        optimistic f1 with an honest f0 and learns to keep on f1 exactly the items f0 gets
        wrong out of fold. Measured on the MiniBooNE sample (P_full 0.3, λ 0.003, tuned f0):
        without it the 30 % of validation items the gate ranks highest were items on which
        f1 and f0 agree (0 % disagreement against 4.3 % overall: routing them gains nothing);
        with ``f1_cv=3`` the top 5 % disagree 16 % of the time. With ``f1_cv`` = K, K shadow
        copies of f1 are grown on the other folds with the same schedule, weights and
        feature penalties, and A_i uses the copy that never saw row i; the served f1 is still
        the one fitted on every row (about (K + 1)/2 times f1's fitting time).
    random_state : int or None

    Attributes (after ``fit``)
    --------------------------
    classes_, n_features_in_, costs_, f0_, f1_booster_ (LightGBM multiclass Booster on all
    columns), gate_booster_ (cross-entropy Booster, raw score = g(x); None when P_full = 0),
    f1_features_, gate_features_ (the columns each reads, completed to whole groups),
    low_cost_features_ (g ∪ f1), low_cost_, full_cost_ (each group paid once), groups_, q_, beta_,
    objective_ (OPT value after each round).
    """

    def __init__(
        self,
        p_full: float = 0.3,
        lam: float = 0.001,
        *,
        feature_costs: ArrayLike | None = None,
        f0: Any = None,
        f0_cv: int | None = 3,
        n_rounds: int = 30,
        trees_per_round: int = 10,
        num_leaves: int = 31,
        learning_rate: float = 0.1,
        min_child_samples: int = 20,
        route_rule: str = "zero",
        route_threshold: float = 0.0,
        f1_cv: int | None = None,
        feature_groups: Any = None,
        random_state: int | None = 0,
    ) -> None:
        self.feature_groups = feature_groups
        self.f1_cv = f1_cv
        self.route_rule = route_rule
        self.route_threshold = route_threshold
        self.p_full = p_full
        self.lam = lam
        self.feature_costs = feature_costs
        self.f0 = f0
        self.f0_cv = f0_cv
        self.n_rounds = n_rounds
        self.trees_per_round = trees_per_round
        self.num_leaves = num_leaves
        self.learning_rate = learning_rate
        self.min_child_samples = min_child_samples
        self.random_state = random_state

    def _validate_params_(self) -> None:
        self._check_shared_params_()
        check_nonneg(self.lam, "lam")
        check_pos_int(self.n_rounds, "n_rounds")
        check_pos_int(self.trees_per_round, "trees_per_round")
        check_pos_int(self.num_leaves, "num_leaves", minimum=2)
        check_pos_int(self.min_child_samples, "min_child_samples")
        if self.f1_cv is not None:
            check_pos_int(self.f1_cv, "f1_cv", minimum=2)
        if check_nonneg(self.learning_rate, "learning_rate") == 0.0:
            raise ValueError("learning_rate must be > 0")

    def _params(
        self, objective: str, penalties: FloatArray, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "objective": objective,
            "num_leaves": int(self.num_leaves),
            "learning_rate": float(self.learning_rate),
            "min_child_samples": int(self.min_child_samples),
            "min_sum_hessian_in_leaf": 1e-6,
            "cegb_penalty_feature_coupled": penalties.tolist(),
            "cegb_tradeoff": 1.0,
            "num_threads": 1,
            "deterministic": True,
            "force_row_wise": True,
            "seed": 0 if self.random_state is None else int(self.random_state),
            "verbose": -1,
            **extra,
        }

    def _boost(
        self,
        booster: lgb.Booster | None,
        Xa: FloatArray,
        label: FloatArray | IntArray,
        weight: FloatArray | None,
        params: dict[str, Any],
    ) -> tuple[lgb.Booster, FloatArray]:
        """Add one block of trees; returns the booster and the block's raw-score increment."""
        start = 0 if booster is None else booster.current_iteration()
        data = lgb.Dataset(Xa, label=label, weight=weight, free_raw_data=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "init_model ... init_score" notes
            booster = lgb.train(
                params,
                data,
                num_boost_round=int(self.trees_per_round),
                init_model=booster,
                keep_training_booster=True,
            )
        delta = np.asarray(booster.predict(Xa, raw_score=True, start_iteration=start))
        return booster, delta.astype(np.float64)

    def _folds(self, y_idx: IntArray) -> list[tuple[IntArray, IntArray]]:
        """(fit rows, held-out rows) of f1's cross-fitting, stratified; [] without it."""
        if self.f1_cv is None:
            return []
        k = min(int(self.f1_cv), int(np.bincount(y_idx).min()))
        if k < 2:
            return []
        seed = 0 if self.random_state is None else int(self.random_state)
        splitter = StratifiedKFold(k, shuffle=True, random_state=seed)
        return [
            (tr.astype(np.int64), te.astype(np.int64))
            for tr, te in splitter.split(np.zeros(y_idx.size), y_idx)
        ]

    def _used(self, booster: lgb.Booster | None, k: int) -> BoolArray:
        """The columns the booster splits on, completed to whole groups (sensors)."""
        used = np.zeros(k, dtype=np.bool_)
        if booster is not None:
            split = np.flatnonzero(booster.feature_importance("split") > 0)
            used[expand_to_groups(self.groups_, split)] = True
        return used

    def fit(self, X: ArrayLike, y: ArrayLike) -> AdaptGbrt:
        self._validate_params_()
        Xa, classes, y_idx = check_Xy(X, y, type(self).__name__)
        n, k = Xa.shape
        m = classes.size
        costs = check_costs(self.feature_costs, k)
        groups = check_feature_groups(self.feature_groups, costs)
        self.classes_ = classes
        self.n_features_in_ = k
        self.costs_ = costs
        self.groups_ = groups
        p_full = float(self.p_full)
        if p_full > 0.0:
            fitted = _fit_f0(
                default_gbrt_f0(self.random_state) if self.f0 is None else self.f0,
                Xa,
                y_idx,
                self.f0_cv,
                self.random_state,
            )
            self.f0_ = fitted.model
            p0 = fitted.oof_proba
            loss0 = -np.log(np.clip(p0[np.arange(n), y_idx], _EPS_PROB, 1.0))
        else:  # GreedyMiser: q ≡ 0, f0 is never consulted (nor trained)
            self.f0_ = None
            loss0 = np.zeros(n)
        lam_n = float(self.lam) * n

        F = np.zeros((n, m))  # f1 raw scores (softmax logits)
        G = np.zeros(n)  # gate raw scores g(x): > 0 sends to f0
        f1_booster: lgb.Booster | None = None
        g_booster: lgb.Booster | None = None
        used = np.zeros(k, dtype=np.bool_)
        history: list[float] = []
        q = np.zeros(n)
        beta = 0.0
        # f1's cross-fitted raw scores for the q-step (F itself when f1_cv is None)
        folds = self._folds(y_idx) if p_full > 0.0 else []
        shadows: list[lgb.Booster | None] = [None] * len(folds)
        F_cf = np.zeros((n, m))
        for _ in range(int(self.n_rounds)):
            loss1 = -log_softmax(F_cf if folds else F, axis=1)[np.arange(n), y_idx]
            A = loss1 + np.logaddexp(0.0, G)
            B = loss0 + np.logaddexp(0.0, -G)
            q, beta = q_step(A, B, p_full)
            # f1: q-weighted multinomial log-loss (its first trees learn the class prior).
            params = self._params("multiclass", lam_n * costs * ~used, {"num_class": m})
            for j, (fit_rows, held) in enumerate(folds):
                shadow_params = self._params(
                    "multiclass", float(self.lam) * fit_rows.size * costs * ~used, {"num_class": m}
                )
                shadow, _ = self._boost(
                    shadows[j], Xa[fit_rows], y_idx[fit_rows], 1.0 - q[fit_rows], shadow_params
                )
                shadows[j] = shadow
                F_cf[held] = np.asarray(shadow.predict(Xa[held], raw_score=True)).reshape(-1, m)
            f1_booster, delta = self._boost(f1_booster, Xa, y_idx, 1.0 - q, params)
            F = F + delta.reshape(n, m)
            used |= self._used(f1_booster, k)
            if p_full > 0.0:
                params = self._params("cross_entropy", lam_n * costs * ~used, {})
                g_booster, delta = self._boost(g_booster, Xa, q, None, params)
                G = G + delta
                used |= self._used(g_booster, k)
            loss1 = -log_softmax(F_cf if folds else F, axis=1)[np.arange(n), y_idx]
            A = loss1 + np.logaddexp(0.0, G)
            B = loss0 + np.logaddexp(0.0, -G)
            cost_term = float(self.lam) * groups_cost(groups, costs, np.flatnonzero(used))
            history.append(float(np.mean((1 - q) * A + q * B - _entropy(q))) + cost_term)
        self.f1_booster_ = f1_booster
        self.gate_booster_ = g_booster
        self.f1_features_ = np.flatnonzero(self._used(f1_booster, k)).astype(np.int64)
        self.gate_features_ = np.flatnonzero(self._used(g_booster, k)).astype(np.int64)
        self.low_cost_features_ = np.union1d(self.f1_features_, self.gate_features_).astype(
            np.int64
        )
        self.low_cost_ = groups_cost(groups, costs, self.low_cost_features_)
        self.full_cost_ = groups_cost(groups, costs, np.arange(k))
        self.q_ = q
        self.beta_ = beta
        self.objective_ = history
        self._set_expected_threshold(G, q)
        return self

    # -- prediction ----------------------------------------------------------------------
    def _check_fitted(self) -> None:
        check_fitted(self, "f1_booster_")

    def f1_raw(self, X: ArrayLike) -> FloatArray:
        self._check_fitted()
        Xa = check_X(X, self.n_features_in_, type(self).__name__)
        booster = self.f1_booster_
        assert booster is not None
        raw = np.asarray(booster.predict(Xa, raw_score=True), dtype=np.float64)
        return raw.reshape(Xa.shape[0], -1)

    def f1_proba(self, X: ArrayLike) -> FloatArray:
        return np.asarray(softmax(self.f1_raw(X), axis=1), dtype=np.float64)

    def gate_score(self, X: ArrayLike) -> FloatArray:
        """g(x): > 0 sends the example to f0 (always ≤ 0 for GreedyMiser)."""
        self._check_fitted()
        Xa = check_X(X, self.n_features_in_, type(self).__name__)
        if self.gate_booster_ is None:
            return np.full(Xa.shape[0], -np.inf)
        return np.asarray(self.gate_booster_.predict(Xa, raw_score=True), dtype=np.float64)


def greedy_miser(lam: float = 0.001, **kwargs: Any) -> AdaptGbrt:
    """GreedyMiser (Xu et al. 2012) as the paper describes it: ADAPT-GBRT with P_full = 0 --
    cost-efficient boosting of f1 alone, no gate, f0 never used."""
    return AdaptGbrt(p_full=0.0, lam=lam, **kwargs)
