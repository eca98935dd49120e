"""The solvers of ADAPT-LIN's alternating minimisation (Nan & Saligrama, NIPS 2017, Alg. 1): the
closed-form q-step (OPT1, :func:`q_step`) and FISTA with backtracking for the (g, f1)-step (OPT2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import expit

from service.types import FloatArray
from training._validation import check_fraction

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
    p_full = check_fraction(p_full, "p_full")
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
