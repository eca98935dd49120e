"""The Poly-Dom estimator: lattice pruning, candidates, index (paper 002, Section 3).

``PolyDom(epsilon=ε, delta=δ).fit(evaluate, costs, (lo, hi))`` spends ε/2 on the lattice
(sandwich 3.11 / covering 3.4) and ε/2 on candidate pruning (3.6 / 3.7). For every size n in
[lo, hi] and budget C, the index then returns a candidate that fits C and whose accuracy is
within ε of the best affordable accuracy over *all* 2^m feature sets (given Axiom 3.10 with
the same δ): an unexpanded set is (ε/2)-dominated by an expanded subset, an expanded set by
a kept candidate within ε/2, and the index returns the best affordable candidate exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.strategies.polydom_index import CompiledIndex
from training._validation import check_cost_polynomials, check_size_domain
from training.polydom.candidates import prune_candidates
from training.polydom.index import PolyDomIndex, build_index
from training.polydom.lattice import MAX_FEATURES, expand_polydom
from training.polydom.poly import set_costs


@dataclass(frozen=True)
class PolyDomStats:
    """Counters of one fit (Metrics 1 and 2 of the paper)."""

    expansions: int
    traversal_expansions: int
    closure_expansions: int
    sandwich_skips: int
    covering_prunes: int
    candidates: int
    index_size: int
    ranges: int
    intersections_visited: int
    intersections_interesting: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _check_unit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} was given; a finite number is required.")
    if value < 0:
        raise ValueError(f"{name}={value!r} was given; a value >= 0 is required.")
    return float(value)


class PolyDom:
    """Cost-sensitive model selection by the Poly-Dom lattice pruning and index.

    Parameters
    ----------
    epsilon : float, default 0.01
        Total accuracy slack ε >= 0: answers are within ε of the best affordable set.
    delta : float, default 0.0
        Allowed monotonicity violation δ >= 0 (Axiom 3.10); δ = 0 assumes Axiom 2.1.

    Attributes (after ``fit``)
    --------------------------
    expanded_ : dict[int, float]
        Every expanded feature-set bitmask and its accuracy.
    candidates_ : list[int]
        Candidate bitmasks; position i is candidate i in ``index_``.
    candidate_accuracies_, candidate_costs_ : ndarray
        Accuracy and (K x D) cost coefficients of each candidate.
    index_ : PolyDomIndex
        Breakpoints and skylines of candidate positions, with ``index_.compiled``.
    stats_ : PolyDomStats
    """

    def __init__(self, *, epsilon: float = 0.01, delta: float = 0.0) -> None:
        self.epsilon = epsilon
        self.delta = delta

    def get_params(self, deep: bool = True) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta}

    def fit(
        self,
        evaluate: Callable[[int], float],
        costs: npt.ArrayLike,
        size_domain: tuple[float, float],
    ) -> PolyDom:
        """Expand the lattice, prune to candidates and build the index."""
        eps = _check_unit("epsilon", self.epsilon)
        delta = _check_unit("delta", self.delta)
        if not callable(evaluate):
            raise ValueError(
                f"evaluate={evaluate!r} was given; a callable mask -> accuracy is required."
            )
        coef = check_cost_polynomials(costs, max_features=MAX_FEATURES)
        lo, hi = check_size_domain(size_domain)
        m = coef.shape[0]
        expansion = expand_polydom(m, evaluate, eps / 2.0, delta)
        candidates = prune_candidates(expansion.accuracies, coef, (lo, hi), eps / 2.0)
        acc = np.array([expansion.accuracies[c] for c in candidates], dtype=np.float64)
        cand_costs = set_costs(np.asarray(candidates, dtype=np.int64), coef)
        index = build_index(acc, cand_costs, (lo, hi))
        self.n_features_ = m
        self.size_domain_ = (lo, hi)
        self.expanded_ = expansion.accuracies
        self.candidates_ = candidates
        self.candidate_accuracies_ = acc
        self.candidate_costs_ = cand_costs
        self.index_: PolyDomIndex = index
        self.stats_ = PolyDomStats(
            expansions=expansion.expansions,
            traversal_expansions=expansion.traversal_expansions,
            closure_expansions=expansion.closure_expansions,
            sandwich_skips=expansion.sandwich_skips,
            covering_prunes=expansion.covering_prunes,
            candidates=len(candidates),
            index_size=index.size,
            ranges=index.n_ranges,
            intersections_visited=index.visited,
            intersections_interesting=index.interesting,
        )
        return self

    @property
    def compiled_(self) -> CompiledIndex:
        """The index ready for lookups (positions into ``candidates_``)."""
        self._check_fitted()
        compiled = self.index_.compiled
        assert compiled is not None
        return compiled

    def lookup(self, n: float, budget: float) -> int | None:
        """Bitmask of the best affordable candidate at size ``n``, or None if none fits."""
        pos = self.compiled_.lookup(n, budget)
        return None if pos is None else self.candidates_[pos]

    def _check_fitted(self) -> None:
        if not hasattr(self, "index_"):
            raise RuntimeError(
                "This PolyDom instance is not fitted yet; call fit(evaluate, costs, "
                "size_domain) before using it."
            )
