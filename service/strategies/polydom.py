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
cost curves are the profiled ones; otherwise (cached features change every candidate's
cost, the index carries no guarantee outside its domain, and calibrated curves may reorder
the candidates) it scans the candidates with their current predicted costs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import Manifest, PolyDomStrategy
from service.inference import LoadedModel
from service.strategies.base import (
    Acquire,
    Answer,
    CostModel,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    register_strategy,
)
from service.strategies.polydom_index import CompiledIndex

_REL_TOLERANCE = 1e-9


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
            self.target, _ = rt.plan(self.size, obs.remaining, in_hand, self.per_feature)
            self._planned_with = in_hand
        target = self.target
        missing = [f for f in rt.model_features[target] if f not in in_hand]
        best_now = rt.best_computable(in_hand)
        if not missing or rt.accuracy[best_now] >= rt.accuracy[target]:
            return Answer(best_now if rt.accuracy[best_now] > rt.accuracy[target] else target)
        # Keep every prefix a good answer: add the feature that makes the best model.
        return Acquire(
            max(
                missing,
                key=lambda f: (rt.accuracy[rt.best_computable(in_hand | {f})],
                               -self.per_feature[f], f),
            )
        )

    def fallback(self, obs: Observation) -> Answer:
        return Answer(self.runtime.best_computable(set(obs.features)))


@register_strategy
class PolyDomRuntime(StrategyRuntime):
    kind = "polydom"

    def __init__(
        self,
        manifest: Manifest,
        spec: Any,
        models: dict[str, LoadedModel],
        costs: CostModel,
        bundle_dir: Path | None = None,
    ) -> None:
        super().__init__(manifest, spec, models, costs, bundle_dir)
        assert isinstance(spec, PolyDomStrategy)
        self.anytime = spec.anytime
        self.size_domain = spec.size_domain
        self.candidates = list(spec.candidates)
        position = {model_id: i for i, model_id in enumerate(self.candidates)}
        self._candidate_acc = [self.accuracy[c] for c in self.candidates]
        self.index = CompiledIndex(
            spec.index.breakpoints,
            [[position[m] for m in skyline] for skyline in spec.index.skylines],
            np.stack([costs.set_coefficients(self.model_features[c]) for c in self.candidates]),
        )
        # Models by falling accuracy, as feature bitmasks: best_computable in one early-exit scan.
        bit = {name: 1 << i for i, name in enumerate(costs.names)}
        ranked = sorted(self.model_features, key=lambda m: -self.accuracy[m])
        self._ranked = [(sum(bit[f] for f in self.model_features[m]), m) for m in ranked]
        self._bit = bit
        self._fallback_model = self.best_computable(frozenset())

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

    def plan(
        self,
        size: int,
        budget: float,
        in_hand: frozenset[str],
        per_feature: dict[str, float] | None = None,
    ) -> tuple[str, float]:
        """The candidate to answer with and its predicted cost (of the features not in
        hand) within ``budget``."""
        use_index = (
            not in_hand
            and per_feature is None
            and not self.costs.calibrated
            and self.size_domain[0] <= size <= self.size_domain[1]
        )
        per_feature = self.costs.at(size) if per_feature is None else per_feature
        if use_index:
            pos = self.index.lookup(size, budget)
            if pos is None:
                return self._fallback_model, 0.0
            target = self.candidates[pos]
            return target, sum(per_feature[f] for f in self.model_features[target])
        # Re-planning subtracts measured costs from the budget and sums predicted ones in
        # another order: compare with a relative tolerance so that float rounding alone
        # never makes an exactly affordable set unaffordable.
        limit = budget + _REL_TOLERANCE * max(abs(budget), 1.0)
        best, best_cost, best_acc = self._fallback_model, 0.0, -1.0
        for model_id, acc in zip(self.candidates, self._candidate_acc, strict=True):
            cost = sum(per_feature[f] for f in self.model_features[model_id] if f not in in_hand)
            if cost <= limit and acc > best_acc:
                best, best_cost, best_acc = model_id, cost, acc
        return best, best_cost

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        target, planned = self.plan(size, budget, in_hand)
        per_feature = self.costs.at(size)
        if self.anytime:
            return AnytimeSession(self, size, per_feature, target, planned, in_hand)
        order = sorted(
            (f for f in self.model_features[target] if f not in in_hand),
            key=lambda f: per_feature[f],
        )
        return StaticSession(self, target, order, planned)
