"""Cost-sensitive trees and cascades of classifiers (paper 003: CSTC, CSCC, Cronus) as a
strategy runtime.

A ``cstc`` strategy holds operating points, each a tree (or cascade) of nodes with linear
routing. Per request the budget picks the most accurate point (validation accuracy) whose
average cost fits, or a best fixed sensor subset of the spec when that is more accurate
(:mod:`service.strategies.fixed`; within the tolerance, the cheapest). The item then walks
the point's nodes from the
root: at each node the runtime acquires the node's features that are not yet in hand
(cached and given ones are free), computes the node's routing score from the manifest's
weights (an exactly rounded sum, so the walk is the trained model's to the last bit) and
goes to the upper child when it is > 0, to the lower one otherwise; a node without that
child (a terminal element, a cascade's early exit, a leaf) answers with its own model. A node
with a confidence exit (``exit_confidence``) answers when its model's top class probability
reaches that level and otherwise goes on: to its one child (a cascade's stage) or by its
routing score (a tree's routing node). The decision's ``scores`` hold, in walk order, each
exit's probability and each routing score (a tree's exit node adds both).

The budget is a hard cap, re-checked before every node: when the next node's missing
features do not fit in what is left, the walk stops and the node reached last (its
features all in hand) answers; when even the root's do not fit, the most accurate model
computable from the features in hand (the prior at worst) answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from service.bundle import CstcNode, CstcPoint, CstcStrategy, FixedPoint
from service.errors import BundleError
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    affordable,
    pareto,
    register_strategy,
)
from service.strategies.fixed import ChoosesAPoint, FixedPoints, Option, capped_at
from service.types import FloatVector


def route_score(node: CstcNode, features: Mapping[str, FloatVector]) -> float:
    """The node's routing score on the features in hand (all of the node's must be)."""
    values: list[float] = []
    for f in node.features:
        values.extend(float(v) for v in features[f])
    return math.fsum(
        [w * v for w, v in zip(node.route_weights, values, strict=True)] + [node.route_bias]
    )


class CstcSession(Session):
    def __init__(
        self, runtime: CstcRuntime, point: CstcPoint, per_feature: dict[str, float]
    ) -> None:
        self.runtime = runtime
        self.point = point
        self.per_feature = per_feature
        self.planned = CstcRuntime.mean_cost(point, per_feature)
        self.expected_accuracy = point.accuracy
        self.current = 0  # the node being paid for
        self.visited: list[int] = []  # nodes whose features are in hand, in walk order
        self.acquired: list[list[str]] = []  # per visited node: features it acquired
        self.pending: list[str] | None = None  # the current node's features missing on arrival
        self.scores: list[float] = []
        self.stopped = False

    def _fallback(self, in_hand: Mapping[str, FloatVector]) -> Answer:
        self.stopped = True
        self.expected_accuracy = None
        if self.visited:
            return Answer(self.point.nodes[self.visited[-1]].model)
        return Answer(self.runtime.best_computable(set(in_hand)))

    def step(self, obs: Observation) -> Step:
        in_hand = obs.features
        for _ in range(len(self.point.nodes)):
            node = self.point.nodes[self.current]
            missing = [f for f in node.features if f not in in_hand]
            if self.pending is None:
                self.pending = list(missing)
            if missing:
                # The hard cap, re-checked before each feature: when the rest of this node's
                # features no longer fits, buying part of them is wasted; its parent answers.
                cost = sum(self.per_feature[f] for f in missing)
                if not affordable(cost, obs.remaining, obs.budget):
                    return self._fallback(in_hand)
                return Acquire(missing[0])
            self.visited.append(self.current)
            self.acquired.append(self.pending)
            self.pending = None
            if node.upper is None and node.lower is None:
                return Answer(node.model)
            if node.exit_confidence is not None:
                # A confidence exit: the node's own model decides whether it answers.
                top = float(np.max(self.runtime.predict(Answer(node.model), in_hand)))
                self.scores.append(top)
                if top >= node.exit_confidence:
                    return Answer(node.model)
                if not node.scores_routes:  # a cascade's stage: on to its one child
                    nxt = node.upper if node.upper is not None else node.lower
                    assert nxt is not None  # a child: checked when the manifest is read
                    self.current = nxt
                    continue
            score = route_score(node, in_hand)
            self.scores.append(score)
            child = node.upper if score > 0 else node.lower
            if child is None:
                return Answer(node.model)
            self.current = child
        raise BundleError(f"cstc point {self.point.id!r}: the walk did not reach a terminal")

    def fallback(self, obs: Observation) -> Answer:
        return self._fallback(obs.features)

    def path(self) -> list[list[str]]:
        """The features in hand after each node visited (cumulative), as graph strategies
        report the states they walked."""
        out: list[list[str]] = []
        have: list[str] = []
        for acquired in self.acquired:
            have = have + [f for f in acquired if f not in have]
            out.append(list(have))
        return out

    def report(self) -> dict[str, Any]:
        return {
            "kind": "cstc",
            "point": self.point.id,
            "method": self.point.method,
            "nodes": list(self.visited),
            "acquired": [list(a) for a in self.acquired],
            "scores": list(self.scores),
            "answered_by_node": self.visited[-1] if self.visited else None,
            "stopped_by_budget": self.stopped,
        }


@register_strategy
class CstcRuntime(ChoosesAPoint, StrategyRuntime[CstcStrategy]):
    kind = "cstc"

    def setup(self) -> None:
        self.points = list(self.spec.points)
        self.by_id = {p.id: p for p in self.points}
        if len(self.by_id) != len(self.points):
            raise BundleError(f"cstc strategy {self.name!r}: duplicate point ids")
        self.fixed = FixedPoints(self, self.spec.fixed)
        self.tolerance = float(self.spec.tolerance)

    def _root_cost(self, point: CstcPoint, per_feature: Mapping[str, float]) -> float:
        return sum(per_feature[f] for f in point.nodes[0].features)

    @staticmethod
    def mean_cost(point: CstcPoint, per_feature: Mapping[str, float]) -> float:
        """The point's average cost at the item's size: Σ rate_f · c_f(n) when the bundle
        gives feature rates (size-dependent costs), its declared ``mean_cost`` otherwise."""
        if point.feature_rates is None:
            return point.mean_cost
        return sum(rate * per_feature[f] for f, rate in point.feature_rates.items())

    def options(
        self, per_feature: Mapping[str, float], budget: float, in_hand: frozenset[str]
    ) -> list[Option[CstcPoint | FixedPoint]]:
        """Every point whose average cost (and root) fits the budget, with its validation
        accuracy, and every fixed subset whose missing features fit. (With a mean budget,
        :class:`ChoosesAPoint`, ``budget`` is the per-item cap and
        :meth:`ChoosesAPoint.pick` weighs the averages against the mean.)"""
        out: list[Option[CstcPoint | FixedPoint]] = []
        for p in self.points:
            if p.capped:
                # the budget is a per-item hard cap: the point's numbers with every walk
                # stopped there (features in hand are not priced in: a lower bound)
                at = capped_at(p.capped, budget)
                if at is not None:
                    out.append(Option(at.mean_cost, at.accuracy, p))
            elif affordable(self.mean_cost(p, per_feature), budget, budget) and affordable(
                self._root_cost(p, per_feature), budget, budget
            ):
                out.append(Option(self.mean_cost(p, per_feature), p.accuracy, p))
        out.extend(self.fixed.options(per_feature, budget, in_hand))
        return out

    def choose(
        self,
        per_feature: Mapping[str, float],
        budget: float,
        in_hand: frozenset[str] = frozenset(),
    ) -> CstcPoint | FixedPoint:
        """The most accurate (validation) point or fixed subset that fits the budget, within
        ``tolerance`` the cheapest; the cheapest point when none fits."""
        return self._choose(per_feature, budget, in_hand).entry

    def _choose(
        self, per_feature: Mapping[str, float], budget: float, in_hand: frozenset[str]
    ) -> Option[CstcPoint | FixedPoint]:
        chosen = self.pick(
            self.options(per_feature, budget, in_hand), self.spec.margin, self.spec.validation_rows
        )
        if chosen is None:
            cheapest = min(self.points, key=lambda p: (self.mean_cost(p, per_feature), -p.accuracy))
            return Option(self.mean_cost(cheapest, per_feature), cheapest.accuracy, cheapest)
        return chosen

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        chosen = self._choose(per_feature, budget, in_hand)
        if isinstance(chosen.entry, FixedPoint):
            cost = self.fixed.cost(chosen.entry, per_feature, in_hand)
            return self.fixed.session(chosen.entry, per_feature, cost)
        session = CstcSession(self, chosen.entry, per_feature)
        if chosen.entry.capped:
            session.planned, session.expected_accuracy = chosen.cost, chosen.accuracy
        return session

    def skyline(self, size: int) -> list[tuple[float, float, str]]:
        per_feature = self.costs.at(size)
        none: frozenset[str] = frozenset()
        fixed = [
            (self.fixed.cost(f, per_feature, none), f.accuracy, f.model) for f in self.fixed.points
        ]
        return pareto(
            [(self.mean_cost(p, per_feature), p.accuracy, p.id) for p in self.points] + fixed
        )

    def skyline_features(self, entry: str) -> list[str]:
        if entry not in self.by_id:
            return list(self.model_features[entry])
        point = self.by_id[entry]
        return sorted({f for n in point.nodes for f in n.features})

    def answerable(self) -> list[str]:
        nodes = {n.model for p in self.points for n in p.nodes}
        return sorted(nodes | set(self.fixed.models()))
