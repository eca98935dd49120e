"""Candidate-Set-Construction (paper 002, Algorithm 1; Properties 3.6 and 3.7).

An expanded set G is dropped when a *kept* candidate F ε-dominates it: a(G) <= a(F) + ε and
c_F(n) <= c_G(n) for every n in the size domain (3.7; 3.6 is the special case F ⊂ G, whose
cost dominance is automatic with non-negative coefficients). Requiring the dominator to be
kept stops ε from compounding along chains (G dropped for F dropped for E ...): every
dropped set has a surviving candidate within ε of it, so Theorem 3.8 holds with ε.

Sets are visited in ascending cost at the domain's upper end (ties: higher accuracy first),
so a dominator, which is never costlier there, is usually decided first. The order only
affects how many sets survive, never correctness.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from service.types import FloatArray
from training.polydom.poly import dominators, set_costs


def prune_candidates(
    accuracies: Mapping[int, float],
    costs: FloatArray,
    size_domain: tuple[float, float],
    epsilon: float,
) -> list[int]:
    """The candidate masks among ``accuracies`` (expanded sets), in visiting order.

    ``costs`` is the per-feature (m x D) coefficient matrix, ``size_domain`` = (lo, hi).
    Dominance in cost is checked exactly over [lo, hi] (endpoints and critical points).
    """
    lo, hi = float(size_domain[0]), float(size_domain[1])
    masks = np.fromiter(accuracies.keys(), dtype=np.int64, count=len(accuracies))
    acc = np.fromiter(accuracies.values(), dtype=np.float64, count=len(accuracies))
    coef = set_costs(masks, costs)
    at_hi = coef @ (hi ** np.arange(coef.shape[1], dtype=np.float64))
    at_lo = coef @ (lo ** np.arange(coef.shape[1], dtype=np.float64))
    order = np.lexsort((masks, -acc, at_lo, at_hi))
    kept_idx: list[int] = []
    kept_coef = np.empty((len(order), coef.shape[1]), dtype=np.float64)
    kept_acc = np.empty(len(order), dtype=np.float64)
    for i in order.tolist():
        k = len(kept_idx)
        if k:
            near = np.flatnonzero(kept_acc[:k] + epsilon >= acc[i])
            if near.size and dominators(kept_coef[near], coef[i], lo, hi).any():
                continue
        kept_coef[k] = coef[i]
        kept_acc[k] = acc[i]
        kept_idx.append(i)
    return [int(masks[i]) for i in kept_idx]
