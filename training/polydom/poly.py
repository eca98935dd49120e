"""Polynomial helpers for Poly-Dom cost curves (paper 002, Sections 3.1 and 3.2).

A cost curve is a power-basis coefficient vector, constant first: ``c(n) = Σ_k c_k n^k``.
Feature costs have non-negative coefficients, so every set cost is non-negative and
non-decreasing in the item size n, and a subset never costs more than its superset.

Everything here is numerically defensive: comparisons use a relative tolerance
(:data:`REL_TOL`) against the magnitude of the terms being compared, and root finding
errs on the side of returning *extra* candidate points (callers validate each one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from service.types import FloatArray, horner

IntArray = npt.NDArray[np.int64]

#: Relative tolerance under which two cost values (or derivatives) count as equal.
REL_TOL = 1e-9
#: Relative tolerance for cost dominance (Definition 3.1): practically exact.
DOM_TOL = 1e-12

Coeffs = Sequence[float]


def mask_bits(masks: IntArray | Sequence[int], m: int) -> npt.NDArray[np.bool_]:
    """Membership matrix (len(masks) x m) of feature-set bitmasks."""
    arr = np.asarray(masks, dtype=np.int64).reshape(-1, 1)
    return ((arr >> np.arange(m, dtype=np.int64)) & 1).astype(bool)


def set_costs(masks: IntArray | Sequence[int], costs: FloatArray) -> FloatArray:
    """Cost coefficients of each feature set: the sum of its members' rows.

    Rows are added one feature at a time in feature order, so a set's coefficients do not
    depend on which other sets are computed alongside it (bit-for-bit reproducible).
    """
    bits = mask_bits(masks, costs.shape[0])
    out = np.zeros((bits.shape[0], costs.shape[1]), dtype=np.float64)
    for j in range(costs.shape[0]):
        out += np.where(bits[:, j : j + 1], costs[j], 0.0)
    return out


def derivative_at(c: Coeffs, k: int, t: float) -> tuple[float, float]:
    """The k-th derivative of ``c`` at ``t`` and the magnitude of its terms (for tolerances)."""
    value = 0.0
    scale = 0.0
    for p in range(len(c) - 1, k - 1, -1):
        factor = float(math.perm(p, k))
        value = value * t + c[p] * factor
        scale = scale * abs(t) + abs(c[p]) * factor
    return value, scale


def compare_right(a: Coeffs, b: Coeffs, t: float) -> int:
    """Sign of ``a - b`` just to the right of ``t`` (-1, 0 or 1).

    Compares values, then successive derivatives (a Taylor expansion), each up to
    :data:`REL_TOL`; 0 means the curves coincide to within tolerance at and after ``t``.
    This is the order the sweep (Algorithm 3) maintains between intersection points.
    """
    degree = max(len(a), len(b))
    for k in range(degree):
        va, sa = derivative_at(a, k, t)
        vb, sb = derivative_at(b, k, t)
        d = va - vb
        if abs(d) > REL_TOL * (sa + sb):
            return 1 if d > 0 else -1
    return 0


def equal_at(a: Coeffs, b: Coeffs, t: float) -> bool:
    """Whether two curves take the same value at ``t`` up to :data:`REL_TOL`."""
    va, sa = derivative_at(a, 0, t)
    vb, sb = derivative_at(b, 0, t)
    return abs(va - vb) <= REL_TOL * (sa + sb)


def trim(c: Coeffs, scale: float) -> list[float]:
    """Drop leading (highest-degree) terms negligible over ``|n| <= scale``."""
    contrib = [abs(v) * scale**k for k, v in enumerate(c)]
    top = max(contrib, default=0.0)
    out = list(c)
    while out and contrib[len(out) - 1] <= 1e-13 * top:
        out.pop()
    return out


def real_roots(c: Coeffs, scale: float) -> list[float]:
    """Candidate real roots of a polynomial, ascending.

    May include points that are only near-roots (e.g. tangencies reported as a complex
    pair with a tiny imaginary part); callers must validate each point. Returns [] for the
    zero polynomial (coincident curves never cross).
    """
    t = trim(c, scale)
    if len(t) <= 1:
        return []
    if len(t) == 2:
        return [-t[0] / t[1]]
    if len(t) == 3:
        c0, b, a = t
        disc = b * b - 4.0 * a * c0
        if disc < 0.0:
            # A tangency can come out slightly negative: keep it as a candidate.
            return [-b / (2.0 * a)] if disc >= -1e-12 * b * b else []
        q = -0.5 * (b + math.copysign(math.sqrt(disc), b))
        roots = [q / a]
        if q != 0.0:
            roots.append(c0 / q)
        return sorted(roots)
    found = np.roots(np.asarray(t[::-1], dtype=np.float64))
    keep = [float(r.real) for r in found if abs(r.imag) <= 1e-6 * max(1.0, abs(r.real))]
    return sorted(keep)


def dominates_on(f: Coeffs, g: Coeffs, lo: float, hi: float) -> bool:
    """Whether ``f(n) <= g(n)`` for every n in ``[lo, hi]`` (the cost half of Def. 3.1).

    Exact up to :data:`DOM_TOL`: the minimum of ``g - f`` on the interval is attained at an
    endpoint or a critical point, so those (clipped into the interval) are checked.
    """
    width = max(len(f), len(g))
    d = [(g[k] if k < len(g) else 0.0) - (f[k] if k < len(f) else 0.0) for k in range(width)]
    deriv = [k * d[k] for k in range(1, width)]
    points = [lo, hi]
    scale = max(abs(lo), abs(hi), 1.0)
    points += [min(max(r, lo), hi) for r in real_roots(deriv, scale)]
    for p in points:
        _, sf = derivative_at(f, 0, p)
        _, sg = derivative_at(g, 0, p)
        if float(horner(d, p)) < -DOM_TOL * (sf + sg):
            return False
    return True


def dominators(kept: FloatArray, g: FloatArray, lo: float, hi: float) -> npt.NDArray[np.bool_]:
    """Vectorised :func:`dominates_on` of every row of ``kept`` over one curve ``g``."""
    if kept.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    d = g[None, :] - kept
    absum = np.abs(g)[None, :] + np.abs(kept)
    ok = np.ones(kept.shape[0], dtype=bool)
    for p in (lo, hi):
        powers = float(p) ** np.arange(d.shape[1])
        ok &= d @ powers >= -DOM_TOL * (absum @ np.abs(powers))
    if d.shape[1] <= 2 or not ok.any():
        return ok
    if d.shape[1] == 3:
        a2 = d[:, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(a2 > 0, -d[:, 1] / (2.0 * a2), lo)
        v = np.clip(np.nan_to_num(v, nan=lo, posinf=hi, neginf=lo), lo, hi)
        val = d[:, 0] + v * (d[:, 1] + v * d[:, 2])
        mag = absum[:, 0] + np.abs(v) * (absum[:, 1] + np.abs(v) * absum[:, 2])
        ok &= val >= -DOM_TOL * mag
        return ok
    for i in np.flatnonzero(ok):
        ok[i] = dominates_on(kept[i].tolist(), g.tolist(), lo, hi)
    return ok
