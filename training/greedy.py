"""The Greedy family: Greedy, Greedy-Acc and Greedy-Cost (paper 002, Section 4, Alg. 4).

Offline, for every λ of a grid, start from the empty set and repeatedly add the remaining
feature j maximising ``Δaccuracy − λ·Δcost``, where ``Δcost = c_j(n_ref)`` is feature j's
cost at a single reference size ``n_ref`` (the paper uses the median training size; we
default to the geometric mean of the size domain). Every prefix of the resulting order is a
feature set whose accuracy is evaluated (its model is recorded). Sequences that come out
identical for several λ are kept once. A skyline of (cost at ``n_ref``, accuracy) over all
(sequence, prefix length) pairs is the index.

Online (:meth:`GreedySequences.choose`): pick the skyline entry by budget (the most
expensive one that fits at ``n_ref``), take its sequence, and add features from the first
one while the budget lasts *for this item's size* — an anytime traversal that may end
before or after the skyline entry's prefix length.

Variants (the paper's text swaps their definitions; we follow their names):

* Greedy-Acc (:func:`greedy_acc`): λ = 0 only, the largest accuracy gain first;
* Greedy-Cost (:func:`greedy_cost`): λ = +inf only, the cheapest feature first;
* Greedy (:func:`greedy`): the default grid, 0, positive λs scaled to the workload, and +inf.

Ties are broken deterministically (exact float comparisons): for finite λ by the larger
score, then the lower cost, then the lower feature index (so λ = 0 is "largest Δaccuracy,
then cheapest"); for λ = +inf by the lower cost, then the larger Δaccuracy, then the lower
index. Greedy-Cost only evaluates the cheapest candidates at each step (all of them only on
a cost tie), so a tie-free Greedy-Cost run expands m + 1 sets.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.types import FloatArray, horner
from training._validation import check_cost_polynomials, check_size_domain
from training.polydom.lattice import prefetcher

#: Decades k of the default positive grid λ_k = 10**k / (typical feature cost at n_ref):
#: from λ·Δcost ≈ 0.001 (accuracy dominates) to ≈ 1000 (cost dominates), half-decade steps.
DEFAULT_DECADES: tuple[float, ...] = tuple(k / 2.0 for k in range(-6, 7))


@dataclass(frozen=True)
class GreedySequence:
    """One greedy order and its prefixes.

    ``lambdas`` are every grid λ that produced this order (ascending); ``order`` the feature
    indices in the order added; ``prefix_masks[k]`` the bitmask of the first k features
    (length m + 1, ``prefix_masks[0] == 0``); ``prefix_accuracies[k]`` its accuracy;
    ``prefix_costs[k]`` its cost coefficients ((m + 1) x D array, power basis constant
    first); ``prefix_ref_costs[k]`` its cost at the reference size.
    """

    lambdas: list[float]
    order: list[int]
    prefix_masks: list[int]
    prefix_accuracies: list[float]
    prefix_costs: FloatArray
    prefix_ref_costs: list[float]

    def cost_at(self, k: int, n: float) -> float:
        """Cost of the k-feature prefix at item size ``n``."""
        return float(horner(self.prefix_costs[k].tolist(), n))


@dataclass(frozen=True)
class GreedyStats:
    """Counters of one fit (Metrics 1 and 2 of the paper)."""

    expansions: int
    sequences: int
    lambdas: int
    skyline_size: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float | np.floating)


def _check_lambdas(lambdas: Any) -> list[float] | None:
    if lambdas is None:
        return None
    if isinstance(lambdas, str | bytes) or not isinstance(lambdas, Sequence | np.ndarray):
        raise ValueError(
            f"lambdas={lambdas!r} was given; a sequence of numbers >= 0 (inf allowed) "
            "or None is required."
        )
    values = list(lambdas)
    if not values:
        raise ValueError("lambdas=[] was given; at least one λ >= 0 is required.")
    for lam in values:
        if not _is_number(lam) or math.isnan(lam) or lam < 0:
            raise ValueError(
                f"lambdas contains {lam!r}; every λ must be a number >= 0 (inf allowed)."
            )
    return sorted({float(v) for v in values})


def _check_reference(value: Any, lo: float, hi: float) -> float:
    if value is None:
        return math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2.0
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"reference_size={value!r} was given; a finite number is required.")
    if not lo <= value <= hi:
        raise ValueError(
            f"reference_size={value!r} is outside size_domain=({lo!r}, {hi!r}); "
            "lo <= reference_size <= hi is required."
        )
    return float(value)


def default_lambdas(feature_costs: Sequence[float] | FloatArray) -> list[float]:
    """The default Greedy grid: 0, 10**k / typical cost for k in DEFAULT_DECADES, +inf.

    The typical cost is the median of the positive per-feature costs at the reference size
    (1.0 if none is positive), so λ·Δcost spans 0.001 to 1000 times a typical feature cost.
    """
    arr = np.asarray(feature_costs, dtype=np.float64)
    positive = arr[arr > 0]
    typical = float(np.median(positive)) if positive.size else 1.0
    return [0.0, *(10.0**k / typical for k in DEFAULT_DECADES), math.inf]


class GreedySequences:
    """Cost-sensitive model selection by greedy feature sequences (Algorithm 4).

    Parameters
    ----------
    lambdas : sequence of float >= 0 (inf allowed), optional
        The λ grid. None (default) uses :func:`default_lambdas` of the per-feature costs at
        the reference size: 0, 13 log-spaced positive values and +inf.
    reference_size : float, optional
        The single item size n_ref at which costs are compared offline. None (default) uses
        the geometric mean ``sqrt(lo * hi)`` of ``size_domain`` (the midpoint if lo == 0);
        the paper uses the median training size. Must lie in ``size_domain``.

    Attributes (after ``fit``)
    --------------------------
    n_features_ : int
    size_domain_ : tuple[float, float]
    reference_size_ : float
    lambdas_ : list[float]
        The grid actually used (ascending, distinct).
    feature_costs_ : ndarray of shape (m,)
        Each feature's cost at the reference size (the Δcost of adding it).
    sequences_ : list[GreedySequence]
        Distinct orders, in order of the smallest λ producing each.
    expanded_ : dict[int, float]
        Every evaluated feature-set bitmask and its accuracy (Metric 1 = its length).
    skyline_ : list[tuple[int, int]]
        (sequence index, prefix length) pairs on the skyline of (cost at reference size,
        accuracy) over all prefixes of all sequences: sorted by cost, accuracy strictly
        rising; on equal cost and accuracy the lowest (sequence, prefix length) is kept.
    skyline_costs_, skyline_accuracies_ : list[float]
        Cost at the reference size and accuracy of each skyline entry.
    stats_ : GreedyStats
    """

    def __init__(
        self,
        *,
        lambdas: Sequence[float] | None = None,
        reference_size: float | None = None,
    ) -> None:
        self.lambdas = lambdas
        self.reference_size = reference_size

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {"lambdas": self.lambdas, "reference_size": self.reference_size}

    def fit(
        self,
        evaluate: Callable[[int], float],
        costs: npt.ArrayLike,
        size_domain: tuple[float, float],
    ) -> GreedySequences:
        """Build one greedy sequence per λ, deduplicate them and index their prefixes."""
        grid = _check_lambdas(self.lambdas)
        if not callable(evaluate):
            raise ValueError(
                f"evaluate={evaluate!r} was given; a callable mask -> accuracy is required."
            )
        coef = check_cost_polynomials(costs)
        lo, hi = check_size_domain(size_domain)
        ref = _check_reference(self.reference_size, lo, hi)
        m = coef.shape[0]
        feature_costs = np.array([float(horner(coef[j].tolist(), ref)) for j in range(m)])
        if grid is None:
            grid = default_lambdas(feature_costs)

        expanded: dict[int, float] = {}

        def accuracy(mask: int) -> float:
            if mask not in expanded:
                value = evaluate(mask)
                if not _is_number(value) or not math.isfinite(value):
                    raise ValueError(
                        f"evaluate({mask}) returned {value!r}; a finite accuracy is required."
                    )
                expanded[mask] = float(value)
            return expanded[mask]

        batch = prefetcher(evaluate)

        def prefetch(masks: list[int]) -> None:
            todo = [mk for mk in masks if mk not in expanded]
            if len(todo) > 1:
                batch(todo)

        orders: dict[tuple[int, ...], list[float]] = {}
        for lam in grid:
            order = tuple(_greedy_order(m, lam, feature_costs, accuracy, prefetch))
            orders.setdefault(order, []).append(lam)

        sequences = [
            _make_sequence(list(order), lams, coef, ref, expanded) for order, lams in orders.items()
        ]
        skyline = _skyline(sequences)

        self.n_features_ = m
        self.size_domain_ = (lo, hi)
        self.reference_size_ = ref
        self.lambdas_ = list(grid)
        self.feature_costs_ = feature_costs
        self.sequences_ = sequences
        self.expanded_ = expanded
        self.skyline_ = skyline
        self.skyline_costs_ = [sequences[s].prefix_ref_costs[k] for s, k in skyline]
        self.skyline_accuracies_ = [sequences[s].prefix_accuracies[k] for s, k in skyline]
        self.stats_ = GreedyStats(
            expansions=len(expanded),
            sequences=len(sequences),
            lambdas=len(grid),
            skyline_size=len(skyline),
        )
        return self

    def choose(self, n: float, budget: float) -> tuple[int, int]:
        """(sequence index, prefix length) for an item of size ``n`` under ``budget``.

        The sequence is the one of the skyline entry with the largest cost <= budget at the
        reference size (the cheapest entry if none fits); the prefix length is how far the
        sequence gets, adding features from the first, while its cost at ``n`` stays
        <= budget (0 if even the first feature does not fit).
        """
        self._check_fitted()
        if not _is_number(n) or not math.isfinite(n) or n < 0:
            raise ValueError(f"n={n!r} was given; a finite size >= 0 is required.")
        if not _is_number(budget) or math.isnan(budget):
            raise ValueError(f"budget={budget!r} was given; a number is required.")
        pos = max(bisect.bisect_right(self.skyline_costs_, float(budget)) - 1, 0)
        s = self.skyline_[pos][0]
        seq = self.sequences_[s]
        k = 0
        while k < self.n_features_ and seq.cost_at(k + 1, float(n)) <= budget:
            k += 1
        return s, k

    def lookup(self, n: float, budget: float) -> int:
        """Bitmask of the feature set :meth:`choose` ends on (0, the empty set, if none fits)."""
        s, k = self.choose(n, budget)
        return self.sequences_[s].prefix_masks[k]

    def _check_fitted(self) -> None:
        if not hasattr(self, "skyline_"):
            raise RuntimeError(
                "This GreedySequences instance is not fitted yet; call fit(evaluate, costs, "
                "size_domain) before using it."
            )


def _greedy_order(
    m: int,
    lam: float,
    feature_costs: FloatArray,
    accuracy: Callable[[int], float],
    prefetch: Callable[[list[int]], None] = lambda masks: None,
) -> list[int]:
    """One greedy order for λ (see the module docstring for the tie-breaking). Each step's
    candidate sets are handed to ``prefetch`` as one batch before they are evaluated."""
    remaining = list(range(m))
    order: list[int] = []
    mask = 0
    current = accuracy(0)
    while remaining:
        if math.isinf(lam):
            cheapest = min(float(feature_costs[j]) for j in remaining)
            tied = [j for j in remaining if float(feature_costs[j]) == cheapest]
            if len(tied) == 1:
                best = tied[0]
            else:
                prefetch([mask | 1 << j for j in tied])
                keys = [(accuracy(mask | 1 << j) - current, -j) for j in tied]
                best = -max(keys)[1]
        else:
            prefetch([mask | 1 << j for j in remaining])
            scored = []
            for j in remaining:
                c = float(feature_costs[j])
                scored.append(((accuracy(mask | 1 << j) - current) - lam * c, -c, -j))
            best = -max(scored)[2]
        remaining.remove(best)
        order.append(best)
        mask |= 1 << best
        current = accuracy(mask)
    return order


def _make_sequence(
    order: list[int],
    lambdas: list[float],
    coef: FloatArray,
    ref: float,
    expanded: dict[int, float],
) -> GreedySequence:
    masks = [0]
    for j in order:
        masks.append(masks[-1] | 1 << j)
    # Members' rows added in feature-index order, as polydom.poly.set_costs does (so a set
    # costs the same bit for bit whichever order reached it), without its int64 masks.
    prefix_costs = np.zeros((len(masks), coef.shape[1]), dtype=np.float64)
    for k, mk in enumerate(masks):
        for j in range(coef.shape[0]):
            if mk >> j & 1:
                prefix_costs[k] += coef[j]
    return GreedySequence(
        lambdas=lambdas,
        order=order,
        prefix_masks=masks,
        prefix_accuracies=[expanded[mk] for mk in masks],
        prefix_costs=prefix_costs,
        prefix_ref_costs=[float(horner(row.tolist(), ref)) for row in prefix_costs],
    )


def _skyline(sequences: list[GreedySequence]) -> list[tuple[int, int]]:
    """Non-dominated (sequence, prefix length) pairs by (cost at reference size, accuracy)."""
    pairs = [
        (seq.prefix_ref_costs[k], -seq.prefix_accuracies[k], s, k)
        for s, seq in enumerate(sequences)
        for k in range(len(seq.prefix_masks))
    ]
    pairs.sort()
    out: list[tuple[int, int]] = []
    best = -math.inf
    for _, neg_acc, s, k in pairs:
        if -neg_acc > best:
            out.append((s, k))
            best = -neg_acc
    return out


def greedy(
    *, lambdas: Sequence[float] | None = None, reference_size: float | None = None
) -> GreedySequences:
    """Greedy: the full λ grid (default :func:`default_lambdas`)."""
    return GreedySequences(lambdas=lambdas, reference_size=reference_size)


def greedy_acc(*, reference_size: float | None = None) -> GreedySequences:
    """Greedy-Acc: λ = 0, the largest accuracy gain first (ties: cheapest, lowest index)."""
    return GreedySequences(lambdas=[0.0], reference_size=reference_size)


def greedy_cost(*, reference_size: float | None = None) -> GreedySequences:
    """Greedy-Cost: λ = +inf, the cheapest feature first (ties: larger gain, lowest index)."""
    return GreedySequences(lambdas=[math.inf], reference_size=reference_size)


#: Factories by the paper's variant names.
VARIANTS: dict[str, Callable[..., GreedySequences]] = {
    "greedy": greedy,
    "greedy-acc": greedy_acc,
    "greedy-cost": greedy_cost,
}
