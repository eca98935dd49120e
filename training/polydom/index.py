"""The Poly-Dom index: skylines between intersection points (paper 002, Section 3.2).

Candidate cost curves cross at intersection points; between two consecutive points their
cost order, hence the skyline, is fixed (Lemma 3.12). :func:`build_index` is Algorithm 3
(PolyDomIntersections): a left-to-right sweep keeping the curves ordered by cost, where only
adjacent curves can cross next, so their next crossings sit in a priority queue
(Bentley–Ottmann). At a crossing the affected block — the swapped pair plus every neighbour
with the same cost there, so concurrent crossings, tangencies and coincident curves are
handled together — is re-sorted by cost *just after* the point (a Taylor comparison), and
new neighbours' crossings are pushed.

An intersection point is *interesting* (Theorem 3.13) when the skyline changes there. Only
the curves of the re-sorted block can change membership (the set of curves below any other
curve is unchanged), so the test compares the block's skyline members before and after,
given the best accuracy below the block. For a two-curve swap this is exactly the theorem's
case analysis: both on the skyline (the cheaper-now, more accurate curve evicts the other),
or the rising curve off and the falling one on (it may enter unless something below beats it).

Skylines are stored only at interesting points, each sorted by cost with accuracy strictly
rising, ready for :class:`service.strategies.polydom_index.CompiledIndex`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cmp_to_key

import numpy as np

from service.strategies.polydom_index import CompiledIndex
from service.types import FloatArray
from training.polydom.poly import Coeffs, compare_right, equal_at, real_roots


@dataclass(frozen=True)
class PolyDomIndex:
    """Breakpoints (sizes, ascending) and per-range skylines of candidate positions.

    ``skylines[i]`` holds for sizes in ``[breakpoints[i], breakpoints[i+1])``, sorted by
    cost, accuracy strictly rising. ``visited`` intersection points were processed,
    ``interesting`` of them changed the skyline.
    """

    breakpoints: list[float]
    skylines: list[list[int]]
    visited: int = 0
    interesting: int = 0
    compiled: CompiledIndex | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        """Stored skyline entries (the paper's index size, Metric 2)."""
        return sum(len(s) for s in self.skylines)

    @property
    def n_ranges(self) -> int:
        return len(self.breakpoints)

    def compile(self, costs: FloatArray, upper: float | None = None) -> CompiledIndex:
        """A :class:`CompiledIndex` over the candidates' (K x D) cost coefficients, ``upper``
        the end of the size domain."""
        return CompiledIndex(self.breakpoints, self.skylines, costs, upper)


def skyline_at(accuracies: FloatArray, costs: FloatArray, n: float) -> list[int]:
    """Skyline from scratch at size ``n`` (the oracle).

    Sort by c(n) (ties: higher accuracy first, then position) and keep each curve whose
    accuracy strictly beats every cheaper one.
    """
    if len(accuracies) == 0:
        return []
    values = costs @ (float(n) ** np.arange(costs.shape[1], dtype=np.float64))
    order = np.lexsort((np.arange(len(accuracies)), -accuracies, values))
    return _skyline_of(order, accuracies[order])


def _skyline_of(order: np.ndarray, acc_sorted: FloatArray) -> list[int]:
    running = np.maximum.accumulate(acc_sorted)
    keep = np.empty(len(acc_sorted), dtype=bool)
    keep[0] = True
    keep[1:] = acc_sorted[1:] > running[:-1]
    return [int(v) for v in order[keep]]


def _validate(
    accuracies: Sequence[float] | FloatArray, costs: FloatArray, size_domain: tuple[float, float]
) -> tuple[FloatArray, FloatArray, float, float]:
    acc = np.asarray(accuracies, dtype=np.float64)
    coef = np.asarray(costs, dtype=np.float64)
    if coef.ndim != 2 or coef.shape[0] != acc.shape[0]:
        raise ValueError(
            f"costs has shape {coef.shape}; one row of coefficients per candidate "
            f"({acc.shape[0]} candidates) is required."
        )
    if acc.shape[0] == 0:
        raise ValueError("no candidates given; at least one is required.")
    lo, hi = float(size_domain[0]), float(size_domain[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"size_domain={size_domain!r}; finite lo < hi is required.")
    return acc, coef, lo, hi


class _Sweep:
    """State of Algorithm 3's sweep: the cost order, positions and pending crossings."""

    def __init__(self, acc: FloatArray, coef: FloatArray, lo: float, hi: float) -> None:
        self.acc = acc
        self.curves: list[list[float]] = [row.tolist() for row in coef]
        self.lo, self.hi = lo, hi
        self.scale = max(abs(lo), abs(hi), 1.0)
        self.order: list[int] = sorted(range(len(acc)), key=cmp_to_key(self._cmp_at(lo)))
        self.pos = [0] * len(acc)
        for p, c in enumerate(self.order):
            self.pos[c] = p
        self.acc_pos: FloatArray = acc[self.order].copy()
        self.heap: list[tuple[float, int, int]] = []
        self.pending: dict[tuple[int, int], float] = {}

    def _cmp_at(self, t: float) -> Callable[[int, int], int]:
        curves, acc = self.curves, self.acc

        def cmp(i: int, j: int) -> int:
            s = compare_right(curves[i], curves[j], t)
            if s:
                return s
            if acc[i] != acc[j]:
                return -1 if acc[i] > acc[j] else 1
            return i - j

        return cmp

    def next_crossing(self, low: int, up: int, x: float) -> float | None:
        """First t >= x (t < hi) after which ``up`` is cheaper than ``low``."""
        a, b = self.curves[up], self.curves[low]
        d: Coeffs = [
            (a[k] if k < len(a) else 0.0) - (b[k] if k < len(b) else 0.0)
            for k in range(max(len(a), len(b)))
        ]
        tol = 1e-9 * max(1.0, abs(x))
        for r in real_roots(d, self.scale):
            if r < x - tol or r >= self.hi:
                continue
            t = max(r, x)
            if compare_right(a, b, t) < 0:
                return t
        return None

    def schedule(self, p: int, x: float) -> None:
        low, up = self.order[p], self.order[p + 1]
        t = self.next_crossing(low, up, x)
        if t is not None:
            self.pending[(low, up)] = t
            heapq.heappush(self.heap, (t, low, up))

    def members(self, lo_pos: int, hi_pos: int) -> set[int]:
        """Skyline members among positions [lo_pos, hi_pos]."""
        best = float(self.acc_pos[:lo_pos].max()) if lo_pos > 0 else -math.inf
        out: set[int] = set()
        for p in range(lo_pos, hi_pos + 1):
            c = self.order[p]
            if self.acc[c] > best:
                out.add(c)
                best = float(self.acc[c])
        return out

    def skyline(self) -> list[int]:
        return _skyline_of(np.asarray(self.order), self.acc_pos)

    def pop_event(self) -> tuple[float, int] | None:
        """Next valid crossing: (t, position of the lower curve of the adjacent pair)."""
        while self.heap:
            t, low, up = heapq.heappop(self.heap)
            if self.pending.get((low, up)) != t:
                continue
            del self.pending[(low, up)]
            p = self.pos[low]
            if p + 1 < len(self.order) and self.order[p + 1] == up:
                return t, p
        return None

    def resolve(self, t: float, p: int) -> bool:
        """Re-sort the block around positions p, p+1 just after t; True if skyline changed."""
        curves, order = self.curves, self.order
        a, b = p, p + 1
        while a > 0 and equal_at(curves[order[a - 1]], curves[order[a]], t):
            a -= 1
        while b < len(order) - 1 and equal_at(curves[order[b]], curves[order[b + 1]], t):
            b += 1
        before = self.members(a, b)
        block = sorted(order[a : b + 1], key=cmp_to_key(self._cmp_at(t)))
        order[a : b + 1] = block
        for q in range(a, b + 1):
            self.pos[order[q]] = q
        self.acc_pos[a : b + 1] = self.acc[block]
        after = self.members(a, b)
        for q in range(max(a - 1, 0), min(b, len(order) - 2) + 1):
            self.schedule(q, t)
        return before != after


def build_index(
    accuracies: Sequence[float] | FloatArray,
    costs: FloatArray,
    size_domain: tuple[float, float],
) -> PolyDomIndex:
    """Algorithm 3 (PolyDomIntersections): skylines at interesting intersection points.

    ``accuracies[i]`` and ``costs[i]`` describe candidate position i. The first breakpoint is
    ``lo``; a skyline is stored again only where it changes (Theorem 3.13), and consecutive
    identical skylines are merged. The result carries its :class:`CompiledIndex`.
    """
    acc, coef, lo, hi = _validate(accuracies, costs, size_domain)
    sweep = _Sweep(acc, coef, lo, hi)
    for p in range(len(acc) - 1):
        sweep.schedule(p, lo)
    breakpoints = [lo]
    skylines = [sweep.skyline()]
    visited = interesting = 0
    while (event := sweep.pop_event()) is not None:
        t, p = event
        visited += 1
        if not sweep.resolve(t, p):
            continue
        interesting += 1
        snapshot = sweep.skyline()
        if breakpoints[-1] >= t - 1e-9 * max(1.0, abs(t)):
            skylines[-1] = snapshot  # same point (up to rounding): the later state holds
        else:
            breakpoints.append(t)
            skylines.append(snapshot)
    merged_b: list[float] = []
    merged_s: list[list[int]] = []
    for bp, sk in zip(breakpoints, skylines, strict=True):
        if merged_s and merged_s[-1] == sk:
            continue
        merged_b.append(bp)
        merged_s.append(sk)
    compiled = CompiledIndex(merged_b, merged_s, coef, hi)
    return PolyDomIndex(merged_b, merged_s, visited, interesting, compiled)


def intersection_points(costs: FloatArray, size_domain: tuple[float, float]) -> list[float]:
    """Every crossing of every pair of curves strictly inside the domain, ascending, unique."""
    lo, hi = float(size_domain[0]), float(size_domain[1])
    scale = max(abs(lo), abs(hi), 1.0)
    k, width = costs.shape
    points: set[float] = set()
    if width == 3:
        i, j = np.triu_indices(k, 1)
        d = costs[i] - costs[j]
        c0, b, a = d[:, 0], d[:, 1], d[:, 2]
        quad = np.abs(a) * scale * scale > 1e-13 * (np.abs(b) * scale + np.abs(c0))
        lin = ~quad & (np.abs(b) * scale > 1e-13 * np.abs(c0))
        with np.errstate(divide="ignore", invalid="ignore"):
            disc = b * b - 4.0 * a * c0
            sq = np.sqrt(np.where(disc >= 0, disc, np.nan))
            q = -0.5 * (b + np.copysign(sq, b))
            r1 = np.where(quad, q / a, np.where(lin, -c0 / b, np.nan))
            r2 = np.where(quad & (q != 0), c0 / q, np.nan)
        for r in (r1, r2):
            r = r[np.isfinite(r) & (r > lo) & (r < hi)]
            points.update(r.tolist())
    else:
        rows = costs.tolist()
        for i_ in range(k):
            for j_ in range(i_ + 1, k):
                diff = [x - y for x, y in zip(rows[i_], rows[j_], strict=True)]
                points.update(r for r in real_roots(diff, scale) if lo < r < hi)
    return sorted(points)


def index_all(
    accuracies: Sequence[float] | FloatArray,
    costs: FloatArray,
    size_domain: tuple[float, float],
) -> PolyDomIndex:
    """Poly-Dom-Index-All: a skyline at every intersection point of every pair of curves.

    Computed independently of the sweep: all pairwise roots inside the domain, then each
    range's skyline from scratch at the range's midpoint (:func:`skyline_at`).
    """
    acc, coef, lo, hi = _validate(accuracies, costs, size_domain)
    breakpoints = [lo, *intersection_points(coef, (lo, hi))]
    ends = [*breakpoints[1:], hi]
    skylines = [
        skyline_at(acc, coef, 0.5 * (start + end))
        for start, end in zip(breakpoints, ends, strict=True)
    ]
    compiled = CompiledIndex(breakpoints, skylines, coef, hi)
    return PolyDomIndex(breakpoints, skylines, len(breakpoints), len(breakpoints), compiled)


def index_all_size(
    accuracies: Sequence[float] | FloatArray,
    costs: FloatArray,
    size_domain: tuple[float, float],
) -> tuple[int, int]:
    """(index size, number of ranges) of Poly-Dom-Index-All without storing the skylines."""
    acc, coef, lo, hi = _validate(accuracies, costs, size_domain)
    breakpoints = [lo, *intersection_points(coef, (lo, hi))]
    ends = [*breakpoints[1:], hi]
    total = sum(
        len(skyline_at(acc, coef, 0.5 * (start + end)))
        for start, end in zip(breakpoints, ends, strict=True)
    )
    return total, len(breakpoints)
