"""Greedy, Greedy-Acc and Greedy-Cost (paper 002, Alg. 4) as an anytime strategy runtime.

Offline, each λ of a grid gave a sequence of features (add the one maximising
Δaccuracy − λ·Δcost at a reference size) and a model per prefix. Online, a sequence is
chosen, then its features are added in order while the next one's predicted cost *at this
item's size* fits the measured remaining budget, and the model of the longest prefix in
hand answers.

Choosing the sequence: the paper picks it on the skyline at the reference size
(``selection = "reference"``). That choice ignores the item's size: on a much larger item
the chosen sequence's first feature may not fit and the answer falls back to the prior,
so a bigger budget can buy *less* accuracy. By default (``selection = "item"``) the
sequence is the one whose longest affordable prefix at this item's size (cached features
free) is the most accurate — what the skyline at that size promises.
"""

from __future__ import annotations

from typing import Any

from service.bundle import GreedyStrategy
from service.strategies.base import (
    Acquire,
    Answer,
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
        accuracy: dict[str, float],
    ) -> None:
        self.features = features
        self.models = models
        self.per_feature = per_feature
        self.planned = planned
        # Accuracy need not rise along a sequence: answer with the best prefix in hand.
        self.best_upto = []
        best = models[0]
        for model in models:
            if accuracy[model] > accuracy[best]:
                best = model
            self.best_upto.append(best)

    def _prefix(self, in_hand: Any) -> int:
        k = 0
        while k < len(self.features) and self.features[k] in in_hand:
            k += 1
        return k

    def step(self, obs: Observation) -> Step:
        k = self._prefix(obs.features)
        if k < len(self.features) and self.per_feature[self.features[k]] <= obs.remaining:
            return Acquire(self.features[k])
        return Answer(self.best_upto[k])

    def fallback(self, obs: Observation) -> Answer:
        return Answer(self.best_upto[self._prefix(obs.features)])


@register_strategy
class GreedyRuntime(StrategyRuntime[GreedyStrategy]):
    kind = "greedy"

    def setup(self) -> None:
        spec = self.spec
        self.selection = spec.selection
        self.reference_size = spec.reference_size
        self.sequences = [(list(s.features), list(s.models)) for s in spec.sequences]
        self.skyline_entries = list(spec.skyline)

    def answerable(self) -> list[str]:
        return sorted({m for _, models in self.sequences for m in models})

    @staticmethod
    def _affordable(
        features: list[str], budget: float, per_feature: dict[str, float], in_hand: Any
    ) -> tuple[int, float]:
        """Length and predicted cost of the longest prefix that fits ``budget``."""
        spent, k = 0.0, 0
        while k < len(features):
            cost = 0.0 if features[k] in in_hand else per_feature[features[k]]
            if spent + cost > budget:
                break
            spent += cost
            k += 1
        return k, spent

    def choose(self, budget: float, per_feature: dict[str, float], in_hand: frozenset[str]) -> int:
        if self.selection == "reference":
            # Paper: the skyline entry with the largest cost <= budget at the reference size.
            at_ref = self.costs.at(self.reference_size)
            chosen = self.skyline_entries[0][0]
            for seq, length in self.skyline_entries:  # accuracy rises along the skyline
                if sum(at_ref[f] for f in self.sequences[seq][0][:length]) <= budget:
                    chosen = seq
            return chosen
        best, best_key = 0, (-1.0, 0.0)
        for i, (features, models) in enumerate(self.sequences):
            k, cost = self._affordable(features, budget, per_feature, in_hand)
            key = (max(self.accuracy[m] for m in models[: k + 1]), -cost)
            if key > best_key:
                best, best_key = i, key
        return best

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        features, models = self.sequences[self.choose(budget, per_feature, in_hand)]
        _, planned = self._affordable(features, budget, per_feature, in_hand)
        return GreedySession(features, models, per_feature, planned, self.accuracy)
