"""Online lookup in a Poly-Dom index: two binary searches (paper 002, Section 3.2).

``training`` builds the index, this module only reads it. Costs are given per candidate as
power-basis polynomial coefficients (constant first), padded to one width. Lookups run on
plain Python lists (a numpy call costs more than the whole search on a skyline of tens of
curves); Naive-Lookup, the paper's baseline, is the vectorised numpy scan.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from service.types import FloatArray, horner


def poly_eval(coefficients: FloatArray, n: float) -> FloatArray | float:
    """Evaluate power-basis polynomial(s) at ``n``; rows of a 2-D array are polynomials."""
    return horner(coefficients, n)


#: Cost curves up to this many coefficients (cubic) are evaluated by one inlined Horner
#: expression (quadratics by a shorter one); wider ones by a loop.
_INLINE_WIDTH = 4


class CompiledIndex:
    """A Poly-Dom index ready for lookups.

    ``breakpoints`` sorted ascending; ``skylines[i]`` lists candidate positions (rows of
    ``costs``) sorted by cost within ``[breakpoints[i], breakpoints[i+1])``, accuracy
    strictly rising. ``costs`` is a (candidates x degree+1) coefficient matrix; ``upper``,
    when given, is the end of the size domain (the last range's right end).

    Lookups touch only plain Python lists built here once: per range, the skyline's
    positions and its members' coefficient tuples in skyline order. When every coefficient
    is >= 0, each curve is non-decreasing in n (in floating point too: rounding is
    monotone), so its costs at the range's two ends bracket its cost anywhere inside: the
    members that fit even at the right end, and those that fit not even at the left end,
    are found by two C ``bisect`` calls on precomputed lists, and only the curves in
    between are evaluated at n. A lookup is thus a ``bisect`` on the breakpoints, two on
    the range's bounds and a few Horner evaluations: no numpy call, no allocation.
    """

    __slots__ = (
        "_breakpoints",
        "_costs",
        "_curves",
        "_fit_left",
        "_fit_right",
        "_inline",
        "_rows",
        "_skylines",
        "_upper",
    )

    def __init__(
        self,
        breakpoints: Sequence[float],
        skylines: Sequence[Sequence[int]],
        costs: FloatArray,
        upper: float | None = None,
    ) -> None:
        if len(breakpoints) != len(skylines) or not breakpoints:
            raise ValueError("one skyline per breakpoint, at least one, is required")
        self._breakpoints = [float(b) for b in breakpoints]
        self._skylines = [[int(p) for p in s] for s in skylines]
        self._costs = np.asarray(costs, dtype=np.float64)
        self._upper = math.inf if upper is None else float(upper)
        self._rows = [[float(c) for c in row] for row in self._costs]
        width = max((len(r) for r in self._rows), default=0)
        # 3: quadratic, c0 + n(c1 + n c2); 4: cubic; 0: a Horner loop (highest power first).
        self._inline = 3 if width <= 3 else (_INLINE_WIDTH if width <= _INLINE_WIDTH else 0)
        if self._inline:  # constant first, zero-padded
            padded = [tuple(r + [0.0] * (self._inline - len(r))) for r in self._rows]
        else:
            padded = [tuple(reversed(r)) for r in self._rows]
        self._curves = [[padded[p] for p in s] for s in self._skylines]
        # Per range: running max of the costs at the right end (a prefix that surely
        # fits) and suffix min of those at the left end (a suffix that surely does not).
        self._fit_right: list[list[float]] = []
        self._fit_left: list[list[float]] = []
        monotone = all(c >= 0.0 for r in self._rows for c in r)
        ends = [*self._breakpoints[1:], upper]
        for start, end, curves in zip(self._breakpoints, ends, self._curves, strict=True):
            if not monotone:
                self._fit_right.append([])
                self._fit_left.append([-math.inf] * len(curves))  # no curve ruled out
                continue
            right: list[float] = []
            if end is not None:
                top = -math.inf
                for curve in curves:
                    top = max(top, self._value(curve, float(end)))
                    right.append(top)
            left = [self._value(curve, start) for curve in curves]
            for k in range(len(left) - 2, -1, -1):
                left[k] = min(left[k], left[k + 1])
            self._fit_right.append(right)
            self._fit_left.append(left)

    def _value(self, curve: tuple[float, ...], n: float) -> float:
        """A curve's cost at n, by exactly the expression :meth:`lookup` uses."""
        if self._inline == 3:
            c0, c1, c2 = curve
            return c0 + n * (c1 + n * c2)
        if self._inline:
            c0, c1, c2, c3 = curve
            return c0 + n * (c1 + n * (c2 + n * c3))
        total = 0.0
        for c in curve:
            total = total * n + c
        return total

    @property
    def size(self) -> int:
        """Number of stored skyline entries (the paper's index size, Metric 2)."""
        return sum(len(s) for s in self._skylines)

    @property
    def n_ranges(self) -> int:
        return len(self._breakpoints)

    def skyline_at(self, n: float) -> list[int]:
        i = bisect_right(self._breakpoints, n) - 1
        return self._skylines[i if i > 0 else 0]

    def lookup(self, n: float, budget: float) -> int | None:
        """The most accurate candidate with cost(n) <= budget, or None if none fits."""
        i = bisect_right(self._breakpoints, n) - 1
        curves = self._curves[i if i > 0 else 0]
        if i >= 0:  # n inside a range: its ends bracket every cost
            # (past the domain's end only the left end bounds the last range)
            lo = bisect_right(self._fit_right[i], budget) if n <= self._upper else 0
            hi = bisect_right(self._fit_left[i], budget)
        else:  # below the first breakpoint: no bracket
            i, lo, hi = 0, 0, len(curves)
        # invariant: curves[:lo] fit, curves[hi:] do not
        inline = self._inline
        if inline == 3:
            while lo < hi:
                mid = (lo + hi) >> 1
                c0, c1, c2 = curves[mid]
                if c0 + n * (c1 + n * c2) <= budget:
                    lo = mid + 1
                else:
                    hi = mid
        elif inline:
            while lo < hi:
                mid = (lo + hi) >> 1
                c0, c1, c2, c3 = curves[mid]
                if c0 + n * (c1 + n * (c2 + n * c3)) <= budget:
                    lo = mid + 1
                else:
                    hi = mid
        else:
            while lo < hi:
                mid = (lo + hi) >> 1
                total = 0.0
                for c in curves[mid]:
                    total = total * n + c
                if total <= budget:
                    lo = mid + 1
                else:
                    hi = mid
        return self._skylines[i][lo - 1] if lo else None


def naive_lookup(accuracies: FloatArray, costs: FloatArray, n: float, budget: float) -> int | None:
    """Naive-Lookup (paper 002): scan every candidate; the best affordable one or None."""
    c = poly_eval(costs, n)
    affordable = np.flatnonzero(np.asarray(c) <= budget)
    if affordable.size == 0:
        return None
    return int(affordable[np.argmax(accuracies[affordable])])
