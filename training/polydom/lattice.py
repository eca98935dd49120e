"""Lattice traversal for Poly-Dom: which feature sets to expand (paper 002, Section 3.1).

Feature sets are int bitmasks over m features (bit j = feature j). *Expanding* a set means
training and scoring its model: the black-box ``evaluate(mask) -> accuracy``, memoised here.

:func:`expand_polydom` is the bidirectional search (Algorithm 2, Expand-Enumerate) with

* the relaxed sandwich property (3.11; 3.3 when δ = 0): H need not be expanded when some
  expanded F ⊊ H ⊊ G has a(G) + δ <= a(F) + ε. Checked in O(1) per set from two
  subset/superset DP tables: the best expanded proper subset and the worst expanded proper
  superset of every mask.
* the covering property (3.4) in its safe form: if every parent F ∪ {x} of a bottom-frontier
  set F lies below an expanded G ⊇ F ∪ {x} with a(G) + δ <= a(F) + ε, F's parents are not
  queued (each is sandwiched or expanded). Mirror rule for children of top-frontier sets.

The traversal alone is not provably complete (a set may be reached by no queue), so a
closure pass follows: any never-expanded set that is not sandwiched is expanded, to a
fixpoint. Afterwards every unexpanded H has an expanded F ⊊ H with a(H) <= a(F) + ε and,
since costs have non-negative coefficients, c_F <= c_H everywhere: H is ε-dominated
(Definition 3.1) and never needed (Theorem 3.2). So Theorem 3.5 holds by construction.

Batches: within a layer, whether a set is expanded depends only on the expansions made before
the layer (the sandwich check reads the DP tables, refreshed once per layer), so each layer's
expansions, and each closure round's, are independent. An ``evaluate`` with a
``prefetch(masks)`` method (:class:`BatchEvaluate`, e.g.
``training.bundles.digits.LatticeEvaluator`` on a parallel executor) is handed each such batch
before its sets are expanded, in the order they are expanded; the traversal and its result are
the same with or without it.
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
    """Memoised evaluations plus the subset-max / superset-min DP tables."""

    def __init__(self, m: int, evaluate: Evaluate) -> None:
        self.m = m
        self.full = (1 << m) - 1
        self.evaluate = evaluate
        self.prefetch = prefetcher(evaluate)
        self.acc: dict[int, float] = {}
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
        return self.acc[mask]

    def new(self, masks: Iterable[int]) -> list[int]:
        """The masks not expanded yet, handed to ``prefetch`` as one batch."""
        todo = [m for m in masks if m not in self.acc]
        if len(todo) > 1:
            self.prefetch(todo)
        return todo

    def refresh(self) -> None:
        """Recompute both DP tables from the expanded sets: O(m 2^m), vectorised."""
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

    def best_proper_subset(self, mask: int) -> float:
        """max a(F) over expanded F ⊊ mask (stale by at most one refresh: conservative)."""
        best = -np.inf
        rest = mask
        while rest:
            bit = rest & -rest
            rest ^= bit
            best = max(best, float(self.sub_max[mask ^ bit]))
        return best

    def worst_proper_superset(self, mask: int) -> float:
        """min a(G) over expanded G ⊋ mask."""
        worst = np.inf
        rest = self.full & ~mask
        while rest:
            bit = rest & -rest
            rest ^= bit
            worst = min(worst, float(self.sup_min[mask | bit]))
        return worst

    def sandwiched(self, mask: int, eps: float, delta: float) -> bool:
        """Relaxed sandwich (3.11): expanded F ⊊ mask ⊊ G with a(G) + δ <= a(F) + ε."""
        low = self.best_proper_subset(mask)
        high = self.worst_proper_superset(mask)
        return bool(high + delta <= low + eps)

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

    def unsandwiched_unexpanded(self, eps: float, delta: float) -> npt.NDArray[np.int64]:
        """Every never-expanded mask that no expanded pair sandwiches (closure check)."""
        size = 1 << self.m
        masks = np.arange(size, dtype=np.int64)
        low = np.full(size, -np.inf)
        high = np.full(size, np.inf)
        for i in range(self.m):
            bit = np.int64(1 << i)
            has = (masks & bit) != 0
            low = np.where(has, np.maximum(low, self.sub_max[masks ^ bit]), low)
            high = np.where(~has, np.minimum(high, self.sup_min[masks | bit]), high)
        expanded = np.zeros(size, dtype=bool)
        expanded[np.fromiter(self.acc.keys(), dtype=np.int64, count=len(self.acc))] = True
        bad = ~expanded & ~(high + delta <= low + eps)
        return masks[bad]


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
        lat.refresh()
        bad = lat.unsandwiched_unexpanded(eps, delta)
        if bad.size == 0:
            return len(lat.acc) - before
        sizes = np.bitwise_count(bad.astype(np.uint64))
        for mask in lat.new(int(m) for m in bad[sizes == sizes.min()].tolist()):
            lat.expand(mask)


def _layer(lat: _Lattice, queued: list[int], eps: float, delta: float) -> tuple[list[int], int]:
    """The queued sets one layer expands, in order (those neither expanded nor sandwiched),
    and how many were skipped as sandwiched.

    Expanding one of them changes neither test for another (the DP tables are only
    refreshed between layers), so they are decided up front and prefetched as one batch.
    """
    fresh = [mask for mask in queued if mask not in lat.acc]
    layer = lat.new(mask for mask in fresh if not lat.sandwiched(mask, eps, delta))
    return layer, len(fresh) - len(layer)


def expand_polydom(
    m: int, evaluate: Evaluate, epsilon_lattice: float, delta: float = 0.0
) -> ExpansionResult:
    """Bidirectional Expand-Enumerate (Algorithm 2) plus a completeness closure.

    Rounds alternate a bottom layer (queued parents of sets expanded from the bottom) and a
    top layer (queued children of sets expanded from the top). A dequeued set is expanded
    unless already expanded or sandwiched (3.11); covering (3.4) stops a frontier set from
    queueing its neighbours. Then the closure pass expands, smallest sets first, every set
    that is neither expanded nor sandwiched until none is left.
    """
    if not 1 <= m <= MAX_FEATURES:
        raise ValueError(f"m={m} features given; between 1 and {MAX_FEATURES} are supported.")
    lat = _Lattice(m, evaluate)
    full = lat.full
    for mask in lat.new([0, full]):
        lat.expand(mask)
    bottom: set[int] = set(_neighbours(0, m, up=True)) - {full}
    top: set[int] = set(_neighbours(full, m, up=False)) - {0}
    skips = 0
    prunes = 0
    while bottom or top:
        lat.refresh()
        layer, skipped = _layer(lat, sorted(bottom), epsilon_lattice, delta)
        skips += skipped
        next_bottom: set[int] = set()
        for mask in layer:
            lat.expand(mask)
            if lat.parents_covered(mask, epsilon_lattice, delta):
                prunes += 1
            else:
                next_bottom.update(_neighbours(mask, m, up=True))
        lat.refresh()
        layer, skipped = _layer(lat, sorted(top, reverse=True), epsilon_lattice, delta)
        skips += skipped
        next_top: set[int] = set()
        for mask in layer:
            lat.expand(mask)
            if lat.children_covered(mask, epsilon_lattice, delta):
                prunes += 1
            else:
                next_top.update(_neighbours(mask, m, up=False))
        bottom = {s for s in next_bottom if s not in lat.acc}
        top = {s for s in next_top if s not in lat.acc}
    traversal = len(lat.acc)
    close_lattice(lat, epsilon_lattice, delta)
    return ExpansionResult(
        m=m,
        accuracies=dict(lat.acc),
        traversal_expansions=traversal,
        closure_expansions=len(lat.acc) - traversal,
        sandwich_skips=skips,
        covering_prunes=prunes,
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
