"""Poly-Dom as a (static) strategy runtime: one index lookup plans the whole request.

With nothing cached, the plan is the index answer for (n, budget): O(log I + log S).
Features already in the cache cost nothing, which changes every candidate's cost, so with
any feature in hand the plan is re-made by scanning the candidates with their *uncached*
costs. Extraction runs cheapest feature first; if the budget runs out the handler asks for
``fallback``: the best candidate whose features are already computed.
"""

from __future__ import annotations

import numpy as np

from service.bundle import Manifest, PolyDomStrategy
from service.inference import LoadedModel
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    register_strategy,
)
from service.strategies.polydom_index import CompiledIndex


class PolyDomSession(Session):
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


@register_strategy
class PolyDomRuntime(StrategyRuntime):
    kind = "polydom"

    def __init__(self, manifest: Manifest, models: dict[str, LoadedModel]) -> None:
        super().__init__(manifest, models)
        strategy = manifest.strategy
        assert isinstance(strategy, PolyDomStrategy)
        self.candidates = list(strategy.candidates)
        position = {model_id: i for i, model_id in enumerate(self.candidates)}
        self._candidate_costs = np.stack(
            [self.costs.set_coefficients(self.model_features[c]) for c in self.candidates]
        )
        self._candidate_acc = np.array([self.accuracy[c] for c in self.candidates])
        self.index = CompiledIndex(
            strategy.index.breakpoints,
            [[position[m] for m in skyline] for skyline in strategy.index.skylines],
            self._candidate_costs,
        )
        self._fallback_model = self.best_computable(frozenset())
        self.size_domain = strategy.size_domain

    def plan(
        self,
        size: int,
        budget: float,
        in_hand: frozenset[str],
        per_feature: dict[str, float] | None = None,
    ) -> tuple[str, float]:
        """The model to answer with and its predicted cost (of the features not in hand).

        The index answers when nothing is in hand and ``size`` lies in the domain it was
        built for; otherwise (free features change every candidate's cost, and outside the
        domain the index carries no guarantee) the candidates are scanned with their
        predicted costs at ``size``.
        """
        per_feature = self.costs.at(size) if per_feature is None else per_feature
        if not in_hand and self.size_domain[0] <= size <= self.size_domain[1]:
            pos = self.index.lookup(size, budget)
            if pos is None:
                return self._fallback_model, 0.0
            target = self.candidates[pos]
            return target, sum(per_feature[f] for f in self.model_features[target])
        best, best_cost, best_acc = self._fallback_model, 0.0, -1.0
        for model_id, acc in zip(self.candidates, self._candidate_acc.tolist(), strict=True):
            cost = sum(per_feature[f] for f in self.model_features[model_id] if f not in in_hand)
            if cost <= budget and acc > best_acc:
                best, best_cost, best_acc = model_id, cost, acc
        return best, best_cost

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        target, planned = self.plan(size, budget, in_hand, per_feature)
        order = sorted(
            (f for f in self.model_features[target] if f not in in_hand),
            key=lambda f: per_feature[f],
        )
        return PolyDomSession(self, target, order, planned)
