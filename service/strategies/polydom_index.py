"""Online lookup in a Poly-Dom index: two binary searches (paper 002, Section 3.2).

Pure numpy; ``training`` builds the index, this module only reads it. Costs are given per
candidate as power-basis polynomial coefficients (constant first), padded to one width.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from service.types import FloatArray, horner


def poly_eval(coefficients: FloatArray, n: float) -> FloatArray | float:
    """Evaluate power-basis polynomial(s) at ``n``; rows of a 2-D array are polynomials."""
    return horner(coefficients, n)


class CompiledIndex:
    """A Poly-Dom index ready for lookups.

    ``breakpoints`` sorted ascending; ``skylines[i]`` lists candidate positions (rows of
    ``costs``) sorted by cost within ``[breakpoints[i], breakpoints[i+1])``, accuracy
    strictly rising. ``costs`` is a (candidates x degree+1) coefficient matrix.
    """

    __slots__ = ("_breakpoints", "_costs", "_rows", "_skylines")

    def __init__(
        self,
        breakpoints: Sequence[float],
        skylines: Sequence[Sequence[int]],
        costs: FloatArray,
    ) -> None:
        if len(breakpoints) != len(skylines) or not breakpoints:
            raise ValueError("one skyline per breakpoint, at least one, is required")
        self._breakpoints = [float(b) for b in breakpoints]
        self._skylines = [list(s) for s in skylines]
        self._costs = np.asarray(costs, dtype=np.float64)
        self._rows = [[float(c) for c in row] for row in self._costs]  # scalar Horner: fast

    @property
    def size(self) -> int:
        """Number of stored skyline entries (the paper's index size, Metric 2)."""
        return sum(len(s) for s in self._skylines)

    @property
    def n_ranges(self) -> int:
        return len(self._breakpoints)

    def skyline_at(self, n: float) -> list[int]:
        i = bisect_right(self._breakpoints, n) - 1
        return self._skylines[max(i, 0)]

    def lookup(self, n: float, budget: float) -> int | None:
        """The most accurate candidate with cost(n) <= budget, or None if none fits."""
        skyline = self.skyline_at(n)
        lo, hi = 0, len(skyline)  # invariant: skyline[:lo] fit, skyline[hi:] do not
        rows = self._rows
        while lo < hi:
            mid = (lo + hi) // 2
            if horner(rows[skyline[mid]], n) <= budget:
                lo = mid + 1
            else:
                hi = mid
        return skyline[lo - 1] if lo > 0 else None


def naive_lookup(
    accuracies: FloatArray, costs: FloatArray, n: float, budget: float
) -> int | None:
    """Naive-Lookup (paper 002): scan every candidate; the best affordable one or None."""
    c = poly_eval(costs, n)
    affordable = np.flatnonzero(np.asarray(c) <= budget)
    if affordable.size == 0:
        return None
    return int(affordable[np.argmax(accuracies[affordable])])
