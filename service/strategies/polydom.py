"""Poly-Dom as strategy runtimes: the paper's static plan, and an anytime variant.

Static (paper 002): one index lookup plans the whole request, O(log I + log S), provisioned
for the (p95) cost curves. Extraction runs cheapest feature first; if the budget runs out the
handler asks for ``fallback``: the best model whose features are already computed.

Anytime (the paper's future work): the same candidates and index, but the plan is re-made
after every extraction with the *measured* remaining budget, features in hand costing
nothing. When extractions ran faster than predicted the target is upgraded; when slower, it
falls back to the best set still reachable. Features are extracted in the order that keeps
every prefix a good answer (the next feature is the one whose addition gives the most
accurate computable model, cheapest first on ties), and an extraction only starts when its
predicted cost fits what is left, so a request overruns by at most one extraction's
misprediction.

Planning uses the index when nothing is in hand, the size lies in the index's domain and the
cost curves are the profiled ones (or calibration scaled them all alike). When calibration
corrected the extractors unevenly, a calibrated index built in the service from the
factors (``service.strategies.polydom_calibrated``: exact, the scan's own plan, while the
factors stay within 10 % of those it was built for; rebuilt off the request path when they
move) plans instead. Otherwise (cached features change every candidate's cost, the index
carries no guarantee outside its domain, no calibrated index holds yet) it scans every
model with its current predicted cost.
"""

from __future__ import annotations

import numpy as np

from service.bundle import PolyDomStrategy
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    register_strategy,
)
from service.strategies.polydom_calibrated import CalibratedIndex, IndexKeeper, ranges_for
from service.strategies.polydom_index import CompiledIndex

_REL_TOLERANCE = 1e-9
_UNIFORM_FACTORS = 0.02  # calibration factors within 2 % of each other count as uniform
_CALIBRATED_TOLERANCE = 0.10  # the calibrated index holds while factors move < 10 % (relative)
_REBUILD_INTERVAL_S = 1.0  # at most one calibrated-index rebuild per second


class StaticSession(Session):
    def __init__(self, runtime: PolyDomRuntime, target: str, order: list[str], planned: float):
        self.runtime = runtime
        self.target = target
        self.order = order
        self.planned = planned

    def step(self, obs: Observation) -> Step:
        for feature in self.order:
            if feature not in obs.features:
                return Acquire(feature)
        return Answer(self.target)

    def fallback(self, obs: Observation) -> Answer:
        return Answer(self.runtime.best_computable(set(obs.features)))


class AnytimeSession(Session):
    def __init__(
        self,
        runtime: PolyDomRuntime,
        size: int,
        per_feature: dict[str, float],
        target: str,
        planned: float,
        in_hand: frozenset[str],
    ) -> None:
        self.runtime = runtime
        self.size = size
        self.per_feature = per_feature
        self.target = target
        self.planned = planned
        self._planned_with = in_hand

    def step(self, obs: Observation) -> Step:
        rt = self.runtime
        in_hand = frozenset(obs.features)
        if in_hand != self._planned_with:  # an extraction finished: re-plan with what is left
            self.target, _ = rt.scan(obs.remaining, in_hand, self.per_feature)
            self._planned_with = in_hand
        target = self.target
        missing = [f for f in rt.model_features[target] if f not in in_hand]
        best_now = rt.best_computable(in_hand)
        base = rt.accuracy[best_now]
        if not missing:  # both are computable: the better one answers
            return Answer(target if rt.accuracy[target] > base else best_now)
        if base >= rt.accuracy[target]:
            return Answer(best_now)

        # Keep every prefix a good answer: next, the feature that buys the most accuracy
        # (of the best model computable once it is in hand) per predicted millisecond.
        def value(f: str) -> tuple[float, float, str]:
            gain = rt.accuracy[rt.best_computable(in_hand | {f})] - base
            cost = self.per_feature[f]
            return (gain / max(cost, 1e-9), -cost, f)

        return Acquire(max(missing, key=value))

    def fallback(self, obs: Observation) -> Answer:
        return Answer(self.runtime.best_computable(set(obs.features)))


def _uniform_scale(factors: dict[str, float]) -> float | None:
    """The common factor when every extractor's is within 2 % of the others', else None."""
    values = list(factors.values())
    low, high = min(values), max(values)
    if low > 0 and high / low <= 1.0 + _UNIFORM_FACTORS:
        return (low + high) / 2.0
    return None


@register_strategy
class PolyDomRuntime(StrategyRuntime[PolyDomStrategy]):
    kind = "polydom"

    def setup(self) -> None:
        spec = self.spec
        self.anytime = spec.anytime
        self.size_domain = spec.size_domain
        self.candidates = list(spec.candidates)
        position = {model_id: i for i, model_id in enumerate(self.candidates)}
        self._candidate_acc = [self.accuracy[c] for c in self.candidates]
        self.index = CompiledIndex(
            spec.index.breakpoints,
            [[position[m] for m in skyline] for skyline in spec.index.skylines],
            np.stack(
                [self.costs.set_coefficients(self.model_features[c]) for c in self.candidates]
            ),
            upper=self.size_domain[1],
        )
        # Models by falling accuracy, as feature bitmasks: best_computable in one early-exit scan.
        bit = {name: 1 << i for i, name in enumerate(self.costs.names)}
        ranked = sorted(self.model_features, key=lambda m: -self.accuracy[m])
        self._ranked = [(sum(bit[f] for f in self.model_features[m]), m) for m in ranked]
        self._bit = bit
        self._fallback_model = self.best_computable(frozenset())
        # The scan as one matrix product: models by falling accuracy (ties in the manifest's
        # order, as a loop keeping the first strictly better model would), by feature.
        order = sorted(
            enumerate(self.model_features), key=lambda im: (-self.accuracy[im[1]], im[0])
        )
        self._scan_models = [m for _, m in order]
        names = self.costs.names
        self._scan_matrix = np.array(
            [[f in self.model_features[m] for f in names] for m in self._scan_models],
            dtype=np.float64,
        ).reshape(len(self._scan_models), len(names))
        # Under uneven calibration: an index rebuilt off the request path from the factors
        # (service.strategies.polydom_calibrated); only for curves non-decreasing in n.
        self._ranges = ranges_for(self.size_domain)
        self.calibrated_index = IndexKeeper(self.build_calibrated_index, _REBUILD_INTERVAL_S)
        self._calibrated_ok = bool(np.all(self.costs.coefficients >= 0.0))

    def build_calibrated_index(self) -> CalibratedIndex:
        """An index exact for the calibration factors now (and any within the tolerance):
        every exported model, as the scan considers them."""
        return CalibratedIndex(
            list(self.model_features),
            self.model_features,
            self.accuracy,
            self.costs.names,
            self.costs.coefficients,
            [(start, end) for start, end, _ in self._ranges],
            [self.costs.factors_at(start) for start, _, _ in self._ranges],
            _CALIBRATED_TOLERANCE,
        )

    def answerable(self) -> list[str]:
        return list(self.candidates)

    def best_computable(self, in_hand: frozenset[str] | set[str]) -> str:
        hand = 0
        for f in in_hand:
            hand |= self._bit.get(f, 0)
        for mask, model in self._ranked:
            if mask & ~hand == 0:
                return model
        raise LookupError("bundle has no model computable from the features in hand")

    def index_scale(self, size: int, in_hand: frozenset[str]) -> float | None:
        """When the index can plan this request: the factor to divide the budget by (1 with
        the profiled curves; the common factor when calibration scaled every extractor
        alike at this size), else None (features in hand change costs, the size is outside
        the index's domain, or calibration reordered the extractors' costs)."""
        if in_hand or not self.size_domain[0] <= size <= self.size_domain[1]:
            return None
        if not self.costs.calibrated:
            return 1.0
        return _uniform_scale(self.costs.factors_at(size))

    def plan(
        self,
        size: int,
        budget: float,
        in_hand: frozenset[str],
        per_feature: dict[str, float],
        factors: dict[str, float] | None = None,
    ) -> tuple[str, float]:
        """The model to answer with and its predicted cost (of the features not in hand)
        within ``budget``: two binary searches in the index when it applies; under uneven
        calibration the calibrated index (the scan's very plan) while it holds; else a scan.
        ``factors``: the calibration factors ``per_feature`` was computed with, if at hand."""
        if in_hand or not self.size_domain[0] <= size <= self.size_domain[1]:
            return self.scan(budget, in_hand, per_feature)
        scale = 1.0
        if self.costs.calibrated:
            if factors is None:
                factors = self.costs.factors_at(size)
            uniform = _uniform_scale(factors)
            if uniform is None:
                found = self._calibrated_plan(size, budget, factors, per_feature)
                return self.scan(budget, in_hand, per_feature) if found is None else found
            scale = uniform
        pos = self.index.lookup(size, budget / scale)
        if pos is None:
            return self._fallback_model, 0.0
        target = self.candidates[pos]
        return target, sum(per_feature[f] for f in self.model_features[target])

    def _calibrated_plan(
        self, size: int, budget: float, factors: dict[str, float], per_feature: dict[str, float]
    ) -> tuple[str, float] | None:
        """The calibrated index's plan (the scan's), or None when no index holds for the
        factors now (a rebuild is then requested, to run off the request path)."""
        if not self._calibrated_ok:
            return None
        index = self.calibrated_index.index
        if index is not None:
            limit = max(budget, 0.0) + _REL_TOLERANCE * max(abs(budget), 1.0)
            found = index.lookup(size, factors, per_feature, limit)
            if found is not None:
                return found if found[0] else (self._fallback_model, 0.0)
        self.calibrated_index.request_rebuild()
        return None

    def scan(
        self, budget: float, in_hand: frozenset[str], per_feature: dict[str, float]
    ) -> tuple[str, float]:
        """The most accurate of the bundle's models whose missing features fit ``budget``
        (features in hand are free). Every exported model is scanned, not only the
        candidates: they were pruned under the profiled costs, which no longer hold here."""
        # Re-planning subtracts measured costs from the budget and sums predicted ones in
        # another order: compare with a relative tolerance so that float rounding alone
        # never makes an exactly affordable set unaffordable.
        # Models whose features are all in hand cost nothing and fit even an exhausted budget.
        limit = max(budget, 0.0) + _REL_TOLERANCE * max(abs(budget), 1.0)
        missing = np.array(
            [0.0 if f in in_hand else per_feature[f] for f in self.costs.names], dtype=np.float64
        )
        costs = self._scan_matrix @ missing  # every model's cost, most accurate first
        fits = np.flatnonzero(costs <= limit)
        if not len(fits):
            return self._fallback_model, 0.0
        best = self._scan_models[int(fits[0])]
        # (its cost summed feature by feature, as every other planner of this module sums it)
        return best, sum(per_feature[f] for f in self.model_features[best] if f not in in_hand)

    def planned_ms(self, size: int, budget: float, in_hand: frozenset[str]) -> float | None:
        per_feature, factors = self.costs.at_with_factors(size)
        return self.plan(size, budget, in_hand, per_feature, factors)[1]

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature, factors = self.costs.at_with_factors(size)
        target, planned = self.plan(size, budget, in_hand, per_feature, factors)
        if self.anytime:
            return AnytimeSession(self, size, per_feature, target, planned, in_hand)
        order = sorted(
            (f for f in self.model_features[target] if f not in in_hand),
            key=lambda f: per_feature[f],
        )
        return StaticSession(self, target, order, planned)
