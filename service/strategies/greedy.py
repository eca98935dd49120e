"""Greedy, Greedy-Acc and Greedy-Cost (paper 002, Alg. 4) as an anytime strategy runtime.

Offline, each λ of a grid gave a sequence of features (add the one maximising
Δaccuracy − λ·Δcost at a reference size) and a model per prefix. Online, the budget picks a
sequence on the skyline at the reference size; then the sequence's features are added in
order while the next one's predicted cost *at this item's size* fits the measured remaining
budget, and the model of the longest prefix in hand answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.bundle import GreedyStrategy, Manifest
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


class GreedySession(Session):
    def __init__(
        self,
        features: list[str],
        models: list[str],
        per_feature: dict[str, float],
        planned: float,
    ) -> None:
        self.features = features
        self.models = models
        self.per_feature = per_feature
        self.planned = planned

    def _prefix(self, in_hand: Any) -> int:
        k = 0
        while k < len(self.features) and self.features[k] in in_hand:
            k += 1
        return k

    def step(self, obs: Observation) -> Step:
        k = self._prefix(obs.features)
        if k < len(self.features) and self.per_feature[self.features[k]] <= obs.remaining:
            return Acquire(self.features[k])
        return Answer(self.models[k])

    def fallback(self, obs: Observation) -> Answer:
        return Answer(self.models[self._prefix(obs.features)])


@register_strategy
class GreedyRuntime(StrategyRuntime):
    kind = "greedy"

    def __init__(
        self,
        manifest: Manifest,
        spec: Any,
        models: dict[str, LoadedModel],
        costs: CostModel,
        bundle_dir: Path | None = None,
    ) -> None:
        super().__init__(manifest, spec, models, costs, bundle_dir)
        assert isinstance(spec, GreedyStrategy)
        self.reference_size = spec.reference_size
        self.sequences = [(list(s.features), list(s.models)) for s in spec.sequences]
        self.skyline_entries = list(spec.skyline)

    def answerable(self) -> list[str]:
        return sorted({m for _, models in self.sequences for m in models})

    def choose(self, budget: float) -> int:
        """The sequence of the skyline entry with the largest cost <= budget at the reference
        size (the cheapest entry's when none fits)."""
        at_ref = self.costs.at(self.reference_size)
        chosen = self.skyline_entries[0][0]
        for seq, length in self.skyline_entries:  # accuracy rises along the skyline
            features = self.sequences[seq][0][:length]
            if sum(at_ref[f] for f in features) <= budget:
                chosen = seq
        return chosen

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        features, models = self.sequences[self.choose(budget)]
        per_feature = self.costs.at(size)
        planned, k = 0.0, 0
        while k < len(features):
            cost = 0.0 if features[k] in in_hand else per_feature[features[k]]
            if planned + cost > budget:
                break
            planned += cost
            k += 1
        return GreedySession(features, models, per_feature, planned)
