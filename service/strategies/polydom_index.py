"""Online lookup in a Poly-Dom index: two binary searches (paper 002, Section 3.2).

``training`` builds the index, this module only reads it. Costs are given per candidate as
power-basis polynomial coefficients (constant first), padded to one width. Lookups run on
plain Python lists (a numpy call costs more than the whole search on a skyline of tens of
curves); Naive-Lookup, the paper's baseline, is the vectorised numpy scan.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from service.types import FloatArray, horner


def poly_eval(coefficients: FloatArray, n: float) -> FloatArray | float:
    """Evaluate power-basis polynomial(s) at ``n``; rows of a 2-D array are polynomials."""
    return horner(coefficients, n)


#: Cost curves up to this many coefficients (cubic) are stored padded to it and evaluated
#: by one inlined Horner expression; wider ones by a loop.
_INLINE_WIDTH = 4


class CompiledIndex:
    """A Poly-Dom index ready for lookups.

    ``breakpoints`` sorted ascending; ``skylines[i]`` lists candidate positions (rows of
    ``costs``) sorted by cost within ``[breakpoints[i], breakpoints[i+1])``, accuracy
    strictly rising. ``costs`` is a (candidates x degree+1) coefficient matrix.

    Lookups touch only plain Python lists built here once: per range, the skyline's
    positions and its members' coefficient tuples in skyline order, so one lookup is a
    ``bisect`` on the breakpoints plus a binary search evaluating at most
    ⌈log2(S + 1)⌉ cost curves, with no numpy call and no allocation.
    """

    __slots__ = ("_breakpoints", "_costs", "_curves", "_inline", "_rows", "_skylines")

    def __init__(
        self,
        breakpoints: Sequence[float],
        skylines: Sequence[Sequence[int]],
        costs: FloatArray,
    ) -> None:
        if len(breakpoints) != len(skylines) or not breakpoints:
            raise ValueError("one skyline per breakpoint, at least one, is required")
        self._breakpoints = [float(b) for b in breakpoints]
        self._skylines = [[int(p) for p in s] for s in skylines]
        self._costs = np.asarray(costs, dtype=np.float64)
        self._rows = [[float(c) for c in row] for row in self._costs]
        width = max((len(r) for r in self._rows), default=0)
        self._inline = width <= _INLINE_WIDTH
        if self._inline:  # constant first, zero-padded: c0 + n(c1 + n(c2 + n c3))
            padded = [tuple(r + [0.0] * (_INLINE_WIDTH - len(r))) for r in self._rows]
        else:  # highest power first, for a Horner loop
            padded = [tuple(reversed(r)) for r in self._rows]
        self._curves = [[padded[p] for p in s] for s in self._skylines]

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
        if i < 0:
            i = 0
        curves = self._curves[i]
        lo, hi = 0, len(curves)  # invariant: curves[:lo] fit, curves[hi:] do not
        if self._inline:
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


def naive_lookup(
    accuracies: FloatArray, costs: FloatArray, n: float, budget: float
) -> int | None:
    """Naive-Lookup (paper 002): scan every candidate; the best affordable one or None."""
    c = poly_eval(costs, n)
    affordable = np.flatnonzero(np.asarray(c) <= budget)
    if affordable.size == 0:
        return None
    return int(affordable[np.argmax(accuracies[affordable])])
