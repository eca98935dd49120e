"""Alg. 2 of Wang, Trapeznikov & Saligrama (NIPS 2015): greedy submodular selection of the
sensor subsets the DAG's groups are made of (:func:`select_subsets`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.model_selection import StratifiedKFold

from service.types import FloatArray
from training.dag.sensors import (
    _BUDGET_SLACK,
    _TIE,
    BoolArray,
    IntArray,
    _validate_sensors,
    _validate_xy,
)


@dataclass(frozen=True)
class SubsetSelection:
    """Result of :func:`select_subsets`.

    ``subsets``: the t subsets (sensor names in declaration order; some may be empty if the
    budget or the gains ran out); ``steps``: the greedy additions in order, each
    ``(subset index, sensor name, reward G after the addition)``; ``reward``: the final G;
    ``prior_reward``: G of t empty subsets (the majority-class accuracy); ``evaluations``: the
    number of distinct subsets whose out-of-fold correctness was computed; ``seconds``: wall
    time; ``budget``: the cost constraint used.
    """

    subsets: list[list[str]]
    steps: list[tuple[int, str, float]]
    reward: float
    prior_reward: float
    evaluations: int
    seconds: float
    budget: float


class _LeastSquaresOOF:
    """Out-of-fold correctness of a ridge least-squares classifier (one-hot targets, argmax) on
    any subset of columns, from per-fold Gram matrices computed once: each evaluation costs one
    small linear solve per fold. Data are standardised once globally (selection only)."""

    def __init__(
        self, X: FloatArray, y: IntArray, folds: int, random_state: int, ridge: float
    ) -> None:
        n = X.shape[0]
        std = X.std(axis=0)
        Z = (X - X.mean(axis=0)) / np.where(std > 0, std, 1.0)
        self.Z = np.hstack([np.ones((n, 1)), Z])  # column 0: intercept
        n_classes = int(y.max()) + 1
        Y = np.eye(n_classes)[y]
        self.y = y
        self.ridge = ridge
        self.splits: list[tuple[IntArray, IntArray, FloatArray, FloatArray]] = []
        cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=random_state)
        for tr, va in cv.split(X, y):
            Ztr = self.Z[tr]
            self.splits.append((tr, va, Ztr.T @ Ztr, Ztr.T @ Y[tr]))

    def correct(self, cols: Sequence[int]) -> BoolArray:
        """Out-of-fold correctness (one bool per row) using the given columns of X."""
        idx = np.array([0, *(c + 1 for c in cols)], dtype=np.int64)
        out = np.zeros(self.y.shape[0], dtype=bool)
        penalty = self.ridge * np.eye(idx.size)
        penalty[0, 0] = 0.0
        for _tr, va, gram, rhs in self.splits:
            A = gram[np.ix_(idx, idx)] + penalty
            beta = np.linalg.lstsq(A, rhs[idx], rcond=None)[0]
            pred = np.argmax(self.Z[np.ix_(va, idx)] @ beta, axis=1)
            out[va] = pred == self.y[va]
        return out


def select_subsets(
    X: Any,
    y: Any,
    *,
    sensors: Mapping[str, Sequence[int]],
    n_subsets: int,
    costs: Mapping[str, float] | None = None,
    budget: float | None = None,
    folds: int = 5,
    random_state: int = 0,
    ridge: float = 1.0,
) -> SubsetSelection:
    """Alg. 2: greedily choose ``n_subsets`` sensor subsets maximising
    ``G(σ_1..σ_t) = (1/N) Σ_i max_j 1[f_σj(x_i) = y_i]`` under ``Σ_j cost(σ_j) <= budget``.

    f_σ is a cheap ridge least-squares classifier on the standardised columns of σ (out-of-fold
    over ``folds`` stratified folds); a still-empty subset counts for nothing. Each step adds the
    (subset j, sensor m ∉ σ_j) pair with the largest gain in G per unit cost of m (for uniform
    costs: the largest gain, as in the paper; for non-uniform costs the cost-benefit variant) among
    pairs that fit the budget; ties go to the lower subset index, then the earlier sensor. Empty
    subsets are interchangeable, so only the first empty one is tried. When no pair gains, an
    empty subset is still started with the sensor whose classifier is most accurate on its own
    (the paper's loop runs until the size budget is spent, so all t subsets get used).
    Selection stops when no pair fits, or every subset is in use and no pair gains. ``budget``
    defaults to twice the total cost of all sensors (2 x the number of sensors for unit
    costs). Correctness vectors are cached per sensor set, so a step only evaluates the sets
    grown from the subset changed by the previous step.
    """
    t0 = time.perf_counter()
    names, columns, cost_arr = _validate_sensors(sensors, costs)
    if isinstance(n_subsets, bool) or not isinstance(n_subsets, int) or n_subsets < 1:
        raise ValueError(f"n_subsets must be an int >= 1, got {n_subsets!r}")
    if not isinstance(folds, int) or folds < 2:
        raise ValueError(f"folds must be an int >= 2, got {folds!r}")
    Xa, y_enc, _classes = _validate_xy(X, y, columns, folds)
    if budget is None:
        budget = 2.0 * float(cost_arr.sum())
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"subset budget must be finite and > 0, got {budget!r}")
    oof = _LeastSquaresOOF(Xa, y_enc, folds, random_state, ridge)
    prior_correct = y_enc == int(np.argmax(np.bincount(y_enc)))
    cache: dict[frozenset[int], BoolArray] = {frozenset(): prior_correct}

    def correct(members: frozenset[int]) -> BoolArray:
        hit = cache.get(members)
        if hit is None:
            cols = [c for m in sorted(members) for c in columns[m]]
            hit = oof.correct(cols)
            cache[members] = hit
        return hit

    t = n_subsets
    subsets: list[frozenset[int]] = [frozenset() for _ in range(t)]
    # An empty subset is not a classifier of the system: it gets no credit. (Crediting it as
    # a majority-class classifier lets one subset right on the other classes saturate G at 1
    # after a single step on balanced data, and the greedy stops.)
    corr = np.zeros((t, len(y_enc)), dtype=bool)
    reward = 0.0
    prior_reward = float(prior_correct.mean())
    spent = 0.0
    steps: list[tuple[int, str, float]] = []
    m_count = len(names)
    while True:
        count = corr.sum(axis=0)
        best: tuple[tuple[float, float], int, int, float, BoolArray] | None = None
        first_empty_seen = False
        for j in range(t):
            if not subsets[j]:
                if first_empty_seen:
                    continue
                first_empty_seen = True
            others = (count - corr[j]) > 0
            for m in range(m_count):
                if m in subsets[j] or spent + cost_arr[m] > budget + _BUDGET_SLACK:
                    continue
                grown = subsets[j] | {m}
                if grown in subsets:  # a copy of another subset adds nothing to the DAG
                    continue
                c = correct(grown)
                g = float(np.mean(others | c))
                gain = g - reward
                if gain <= _TIE and subsets[j]:
                    continue
                # Positive gains first (per unit cost); a step without gain may still start
                # an empty subset, so that all t subsets get filled as in the paper's loop,
                # the most accurate one on its own first.
                rate = (
                    0.0 if gain <= _TIE else (gain / cost_arr[m] if cost_arr[m] > 0 else math.inf)
                )
                score = (rate, float(np.mean(c)))
                if best is None or score > best[0]:
                    best = (score, j, m, g, c)
        if best is None:
            break
        _, j, m, g, c = best
        subsets[j] = subsets[j] | {m}
        corr[j] = c
        spent += float(cost_arr[m])
        reward = g
        steps.append((j, names[m], g))
    return SubsetSelection(
        subsets=[[names[m] for m in sorted(s)] for s in subsets],
        steps=steps,
        reward=reward,
        prior_reward=prior_reward,
        evaluations=len(cache) - 1,
        seconds=time.perf_counter() - t0,
        budget=float(budget),
    )
