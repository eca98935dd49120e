"""Lattice traversal for Poly-Dom: which feature sets to expand (paper 002, Section 3.1).

Feature sets are int bitmasks over m features (bit j = feature j). *Expanding* a set means
training and scoring its model: the black-box ``evaluate(mask) -> accuracy``, memoised here.

Every unexpanded set H carries an interval: ``low[H]``, the best accuracy of an expanded
subset, and ``high[H]``, the worst accuracy of an expanded superset (two 2^m tables kept up
to date at each expansion). H is *sandwiched* (3.11; 3.3 when δ = 0) when
high[H] + δ <= low[H] + ε: an expanded F ⊊ H ⊊ G has a(G) + δ <= a(F) + ε, so H never
needs expanding.

:func:`expand_polydom` is the bidirectional search (Algorithm 2, Expand-Enumerate). Rounds
alternate a bottom half (parents of sets expanded from the bottom, smallest first) and a top
half (children of sets expanded from the top, largest first). A dequeued set is

* expanded when it is not sandwiched; unless covered (3.4, safe form: every neighbour
  further from its end lies between it and an expanded set within ε, see
  :meth:`_Lattice.parents_covered`), its neighbours join the next round's frontier;
* *passed through at once* when it is sandwiched with no slack (high + δ <= low): its
  neighbours join this half-round, so a chain of exact ties is crossed in one round;
* *passed through next round* when only the slack ε sandwiches it: it is not expanded, but
  its neighbours join the next round's frontier exactly as if it had been.

Passing through, instead of stopping at, skipped sets is what keeps a larger ε from costing
expansions (Property 3.9). When every child of the full set is sandwiched thanks to ε, a
search that stopped there would leave the bottom half to walk the lattice without the upper
bounds the top half would have found deeper down (at m = 14, γ = 0 that was 4,099
expansions at ε = 0.05 against 618 at ε = 0). Crossing exact ties within the round brings
those upper bounds (e.g. the chain of sets "all but the k best features" when a set's
accuracy is its best feature's, γ = 0) before the bottom half needs them. The number of
expansions is non-increasing in ε on the tested grid (``tests/training/polydom/test_lattice.py``:
m = 8..14, ε from 0 to 0.1, several seeds, three combiners); that is measured, not proved,
and the expanded sets at a larger ε are not always a subset of those at a smaller one.

The traversal alone is not provably complete (a set may be reached by no queue), so a
closure pass follows: any never-expanded set that is not sandwiched is expanded, smallest
first, to a fixpoint. Afterwards every unexpanded H has an expanded F ⊊ H with
a(H) <= a(F) + ε and, since costs have non-negative coefficients, c_F <= c_H everywhere: H
is ε-dominated (Definition 3.1) and never needed (Theorem 3.2). So Theorem 3.5 holds by
construction.

Batches: within a half-round, sets are decided one size level at a time. Sets of one size
are incomparable, so expanding one changes neither the sandwich nor the covering test of
another: each level's expansions are independent. An ``evaluate`` with a ``prefetch(masks)``
method (:class:`BatchEvaluate`, e.g. ``training.bundles.digits.LatticeEvaluator`` on a
parallel executor) is handed each such batch before its sets are expanded, in the order
they are expanded; the traversal and its result are the same with or without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from service.types import FloatArray

Evaluate = Callable[[int], float]


@runtime_checkable
class BatchEvaluate(Protocol):
    """An ``evaluate`` that can compute a batch of independent sets at once (and memoise
    them) before they are asked for one by one."""

    def __call__(self, mask: int) -> float: ...

    def prefetch(self, masks: Sequence[int]) -> None: ...


def prefetcher(evaluate: Evaluate) -> Callable[[Sequence[int]], None]:
    """``evaluate.prefetch`` when it has one, else a no-op."""
    if isinstance(evaluate, BatchEvaluate):
        return evaluate.prefetch
    return lambda masks: None


#: Largest lattice the DP tables are sized for (2^m floats each).
MAX_FEATURES = 22


@dataclass(frozen=True)
class ExpansionResult:
    """Outcome of a lattice traversal.

    ``accuracies`` maps every expanded mask to its accuracy. ``traversal_expansions`` were
    made by the bidirectional search, ``closure_expansions`` by the completeness pass.
    ``sandwich_skips`` counts dequeued sets skipped by 3.3/3.11, ``covering_prunes`` the
    frontier sets whose parents (or children) were not queued by 3.4.
    """

    m: int
    accuracies: dict[int, float]
    traversal_expansions: int
    closure_expansions: int
    sandwich_skips: int
    covering_prunes: int

    @property
    def expansions(self) -> int:
        """Number of evaluate calls (the paper's Metric 1)."""
        return len(self.accuracies)


class _Lattice:
    """Memoised evaluations plus the subset-max / superset-min tables, kept current.

    ``sub_max[H]`` is the best accuracy of an expanded F ⊆ H and ``sup_min[H]`` the worst of
    an expanded G ⊇ H (for an unexpanded H: proper subsets and supersets). Each expansion
    updates both in O(2^m), vectorised.
    """

    def __init__(self, m: int, evaluate: Evaluate) -> None:
        self.m = m
        self.full = (1 << m) - 1
        self.evaluate = evaluate
        self.prefetch = prefetcher(evaluate)
        self.acc: dict[int, float] = {}
        self.masks = np.arange(1 << m, dtype=np.int64)
        self.expanded = np.zeros(1 << m, dtype=bool)
        self.sub_max: FloatArray = np.full(1 << m, -np.inf)
        self.sup_min: FloatArray = np.full(1 << m, np.inf)

    def expand(self, mask: int) -> float:
        if mask not in self.acc:
            value = float(self.evaluate(mask))
            if not math.isfinite(value):
                raise ValueError(
                    f"evaluate({mask}) returned {value!r}; a finite accuracy is required."
                )
            self.acc[mask] = value
            self.expanded[mask] = True
            above = (self.masks & mask) == mask
            self.sub_max[above] = np.maximum(self.sub_max[above], value)
            below = (self.masks & ~mask) == 0
            self.sup_min[below] = np.minimum(self.sup_min[below], value)
        return self.acc[mask]

    def new(self, masks: Iterable[int]) -> list[int]:
        """The masks not expanded yet, handed to ``prefetch`` as one batch."""
        todo = [m for m in masks if m not in self.acc]
        if len(todo) > 1:
            self.prefetch(todo)
        return todo

    def refresh(self) -> None:
        """Recompute both tables from the expanded sets (they are kept current by
        :meth:`expand`; this is a consistency reset): O(m 2^m), vectorised."""
        size = 1 << self.m
        low = np.full(size, -np.inf)
        high = np.full(size, np.inf)
        if self.acc:
            keys = np.fromiter(self.acc.keys(), dtype=np.int64, count=len(self.acc))
            vals = np.fromiter(self.acc.values(), dtype=np.float64, count=len(self.acc))
            low[keys] = vals
            high[keys] = vals
        for i in range(self.m):
            lv = low.reshape(-1, 2, 1 << i)
            np.maximum(lv[:, 1, :], lv[:, 0, :], out=lv[:, 1, :])
            hv = high.reshape(-1, 2, 1 << i)
            np.minimum(hv[:, 0, :], hv[:, 1, :], out=hv[:, 0, :])
        self.sub_max = low
        self.sup_min = high

    def sandwiched(self, mask: int, eps: float, delta: float) -> bool:
        """Relaxed sandwich (3.11) of an unexpanded mask: expanded F ⊊ mask ⊊ G with
        a(G) + δ <= a(F) + ε."""
        return bool(self.sup_min[mask] + delta <= self.sub_max[mask] + eps)

    def parents_covered(self, mask: int, eps: float, delta: float) -> bool:
        """Covering (3.4), safe form, for a bottom-frontier set F = mask.

        True when every x ∉ F has an expanded G ⊇ F ∪ {x} with a(G) + δ <= a(F) + ε, so
        every parent F ∪ {x} is expanded or sandwiched between F and such a G.
        """
        floor = self.acc[mask] + eps - delta
        rest = self.full & ~mask
        while rest:
            bit = rest & -rest
            rest ^= bit
            if not self.sup_min[mask | bit] <= floor:
                return False
        return True

    def children_covered(self, mask: int, eps: float, delta: float) -> bool:
        """Mirror of :meth:`parents_covered` for a top-frontier set G = mask."""
        ceiling = self.acc[mask] + delta - eps
        rest = mask
        while rest:
            bit = rest & -rest
            rest ^= bit
            if not self.sub_max[mask ^ bit] >= ceiling:
                return False
        return True

    def covered(self, mask: int, eps: float, delta: float, up: bool) -> bool:
        if up:
            return self.parents_covered(mask, eps, delta)
        return self.children_covered(mask, eps, delta)

    def unsandwiched_unexpanded(self, eps: float, delta: float) -> npt.NDArray[np.int64]:
        """Every never-expanded mask that no expanded pair sandwiches (closure check)."""
        bad = ~self.expanded & ~(self.sup_min + delta <= self.sub_max + eps)
        return self.masks[bad]


def _neighbours(mask: int, m: int, up: bool) -> Iterable[int]:
    for j in range(m):
        bit = 1 << j
        if up and not mask & bit:
            yield mask | bit
        elif not up and mask & bit:
            yield mask ^ bit


def close_lattice(lat: _Lattice, eps: float, delta: float) -> int:
    """Completeness closure: expand unsandwiched never-expanded sets to a fixpoint.

    Each round expands the smallest such sets (they are pairwise incomparable, so none
    can sandwich another), then re-checks all 2^m sets. Returns the expansions made.
    """
    before = len(lat.acc)
    while True:
        bad = lat.unsandwiched_unexpanded(eps, delta)
        if bad.size == 0:
            return len(lat.acc) - before
        sizes = np.bitwise_count(bad.astype(np.uint64))
        for mask in lat.new(int(m) for m in bad[sizes == sizes.min()].tolist()):
            lat.expand(mask)


@dataclass
class _Counts:
    skips: int = 0
    prunes: int = 0


def _half_round(
    lat: _Lattice, frontier: set[int], up: bool, eps: float, delta: float, counts: _Counts
) -> set[int]:
    """One direction's half-round; returns that direction's next frontier.

    Sets are decided one size level at a time (bottom: smallest first; top: largest
    first), each level's expansions prefetched as one batch. Sets sandwiched with no slack
    pass their neighbours to the next level of this half-round, sets sandwiched thanks to
    ε to the next round; expanded sets pass theirs to the next round unless covered.
    """
    m = lat.m
    levels: dict[int, set[int]] = {}
    for mask in frontier:
        levels.setdefault(mask.bit_count(), set()).add(mask)
    seen: set[int] = set()
    following: set[int] = set()
    step = 1 if up else -1
    size = min(levels) if up else max(levels)
    end = m if up else 0
    while 0 <= size <= m and (size - end) * step <= 0:
        batch: list[int] = []
        for mask in sorted(levels.pop(size, ()), reverse=not up):
            if mask in lat.acc or mask in seen:
                continue
            seen.add(mask)
            if lat.sandwiched(mask, 0.0, delta):
                counts.skips += 1
                levels.setdefault(size + step, set()).update(_neighbours(mask, m, up))
            elif lat.sandwiched(mask, eps, delta):
                counts.skips += 1
                following.update(_neighbours(mask, m, up))
            else:
                batch.append(mask)
        for mask in lat.new(batch):
            lat.expand(mask)
        for mask in batch:
            if lat.covered(mask, eps, delta, up):
                counts.prunes += 1
            else:
                following.update(_neighbours(mask, m, up))
        if not levels:
            break
        size += step
    return {s for s in following if s not in lat.acc and s not in seen}


def expand_polydom(
    m: int, evaluate: Evaluate, epsilon_lattice: float, delta: float = 0.0
) -> ExpansionResult:
    """Bidirectional Expand-Enumerate (Algorithm 2) plus a completeness closure.

    Rounds alternate a bottom half and a top half (:func:`_half_round`): a dequeued set is
    expanded unless sandwiched (3.11); sandwiched sets are passed through (at once with no
    slack, next round when only ε sandwiches them); covering (3.4) stops an expanded
    frontier set from queueing its neighbours. Then the closure pass expands, smallest sets
    first, every set that is neither expanded nor sandwiched until none is left.
    """
    if not 1 <= m <= MAX_FEATURES:
        raise ValueError(f"m={m} features given; between 1 and {MAX_FEATURES} are supported.")
    lat = _Lattice(m, evaluate)
    full = lat.full
    for mask in lat.new([0, full]):
        lat.expand(mask)
    bottom: set[int] = set(_neighbours(0, m, up=True)) - {full}
    top: set[int] = set(_neighbours(full, m, up=False)) - {0}
    counts = _Counts()
    while bottom or top:
        if bottom:
            bottom = _half_round(lat, bottom, True, epsilon_lattice, delta, counts)
        if top:
            top = _half_round(lat, top, False, epsilon_lattice, delta, counts)
        bottom = {s for s in bottom if s not in lat.acc}
        top = {s for s in top if s not in lat.acc}
    traversal = len(lat.acc)
    close_lattice(lat, epsilon_lattice, delta)
    return ExpansionResult(
        m=m,
        accuracies=dict(lat.acc),
        traversal_expansions=traversal,
        closure_expansions=len(lat.acc) - traversal,
        sandwich_skips=counts.skips,
        covering_prunes=counts.prunes,
    )


def expand_all(m: int, evaluate: Evaluate) -> ExpansionResult:
    """Naive-Expand-All: evaluate every one of the 2^m feature sets."""
    if not 1 <= m <= MAX_FEATURES:
        raise ValueError(f"m={m} features given; between 1 and {MAX_FEATURES} are supported.")
    lat = _Lattice(m, evaluate)
    for mask in lat.new(range(1 << m)):
        lat.expand(mask)
    return ExpansionResult(
        m=m,
        accuracies=dict(lat.acc),
        traversal_expansions=len(lat.acc),
        closure_expansions=0,
        sandwich_skips=0,
        covering_prunes=0,
    )
