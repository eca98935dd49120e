"""What the tabular adaptive runtimes (DAG, gating, CSTC/CSCC) share: the best fixed sensor
subsets of their spec (:class:`~service.bundle.FixedPoint`) and the one budget → point choice.

Per request a runtime lists its :class:`Option` s: every adaptive point it could serve under
the budget, with the cost it expects and the validation accuracy it can deliver there (its
``capped`` numbers at the largest cap the budget covers, when the point has them: the budget
is a per-item hard cap, so a point whose average cost fits may still stop some walks short),
and every fixed subset whose missing features fit the budget (:meth:`FixedPoints.options`).
:func:`pick` serves the most accurate, or among those within the tolerance of it the
cheapest: so a budget never buys less validation accuracy than the best fixed subset it
affords. An adaptive point is ranked a ``margin`` of standard errors down against the fixed
subsets (the best of many adaptive points on validation is optimistic), so it replaces the
fixed pipeline only when it beats it by more than the noise. A fixed point is served by
:class:`FixedSession`: acquire the model's missing features (the budget a hard cap), answer
with the model.

A request may ask for its budget as a mean instead (:class:`ChoosesAPoint`): the options are
the same (the per-item cap is the request's ``max_cost`` or every sensor), and
:func:`mean_choice` serves the best average they deliver at the mean, two of them shared out
over the items when that beats one by more than the margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from service.bundle import CappedNumbers, FixedPoint
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    affordable,
)

E = TypeVar("E", covariant=True)


@dataclass(frozen=True, slots=True)
class Option(Generic[E]):
    """A point a budget may buy: its expected cost for this request (features in hand
    free), the validation accuracy it delivers under the budget, what serves it, and whether
    it is a fixed subset."""

    cost: float
    accuracy: float
    entry: E
    fixed: bool = False


def handicap(options: Sequence[Option[E]], margin: float, rows: int) -> float:
    """What an adaptive option's accuracy is ranked down by: ``margin`` standard errors of
    the best fixed option's validation accuracy p, sqrt(p (1 - p) / rows) (0 without a
    margin, rows or fixed options)."""
    fixed = [o.accuracy for o in options if o.fixed]
    if margin <= 0 or rows <= 0 or not fixed:
        return 0.0
    p = max(fixed)
    return margin * math.sqrt(max(p * (1.0 - p), 1.0 / rows) / rows)


def pick(
    options: Sequence[Option[E]], tolerance: float, margin: float = 0.0, rows: int = 0
) -> Option[E] | None:
    """The most accurate option, adaptive ones ranked ``margin`` standard errors down
    (:func:`handicap`); among those within ``tolerance`` of it, the cheapest (then the more
    accurate, then a fixed subset, then the first listed). None when there are none."""
    if not options:
        return None
    down = handicap(options, margin, rows)

    def rank(o: Option[E]) -> float:
        return o.accuracy if o.fixed else o.accuracy - down

    best = max(rank(o) for o in options)
    near = [o for o in options if rank(o) >= best - tolerance - 1e-12]
    return min(near, key=lambda o: (o.cost, -rank(o), not o.fixed))


@dataclass(frozen=True, slots=True)
class Shared(Generic[E]):
    """What a mean budget buys: ``low`` for a ``share`` of the items and ``high`` for the
    others (None: ``low`` for all)."""

    low: Option[E]
    high: Option[E] | None = None
    share: float = 1.0

    def of(self, draw: float) -> Option[E]:
        """The option of an item whose draw (uniform in [0, 1)) is ``draw``."""
        return self.low if self.high is None or draw < self.share else self.high


def mean_choice(
    options: Sequence[Option[E]],
    mean: float,
    tolerance: float = 0.0,
    margin: float = 0.0,
    rows: int = 0,
) -> Shared[E] | None:
    """Under a mean budget: the best the options can deliver *on average* at ``mean``.
    Serving option a to a share p of the items and b to the rest averages
    p·cost(a) + (1 - p)·cost(b) and p·acc(a) + (1 - p)·acc(b), so the best at ``mean`` is the
    upper concave hull of (cost, accuracy) there (adaptive options ranked ``margin`` standard
    errors down, as in :func:`pick`): the hull's two vertices around ``mean``, shared so that
    the average is ``mean``, when that beats the best single option that fits by more than
    that margin (else that option alone); with a ``tolerance``, the cheapest single option
    within it of the value. None when no option fits ``mean``."""
    if not options:
        return None
    down = handicap(options, margin, rows)

    def rank(o: Option[E]) -> float:
        return o.accuracy if o.fixed else o.accuracy - down

    # Pareto frontier by cost, then its upper concave hull.
    hull: list[Option[E]] = []
    for o in sorted(options, key=lambda o: (o.cost, -rank(o), not o.fixed)):
        if hull and rank(o) <= rank(hull[-1]):
            continue
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]  # b is below the chord a → o: never worth it
            if (rank(b) - rank(a)) * (o.cost - a.cost) <= (rank(o) - rank(a)) * (b.cost - a.cost):
                hull.pop()
            else:
                break
        hull.append(o)
    fits = [o for o in hull if affordable(o.cost, mean, mean)]
    if not fits:
        return None
    low = fits[-1]
    above = hull[len(fits)] if len(fits) < len(hull) else None
    # The best single option that fits (a frontier point under the hull's chord may beat
    # ``low`` alone).
    alone = max(
        (o for o in options if affordable(o.cost, mean, mean)),
        key=lambda o: (rank(o), -o.cost, o.fixed),
    )
    chosen: Shared[E] = Shared(alone)
    value = rank(alone)
    if above is not None and not affordable(above.cost, low.cost, mean):
        share = (above.cost - mean) / (above.cost - low.cost)
        shared = share * rank(low) + (1.0 - share) * rank(above)
        # What sharing adds must beat the noise as an adaptive point must: the larger of two
        # validation accuracies is optimistic too (on MiniBooNE, a mixture of two fixed
        # subsets chosen with no margin lost 1.2 points on test to the cheaper one alone).
        if shared - value > down:
            chosen, value = Shared(low, above, share), shared
    if tolerance > 0:
        near = [o for o in options if affordable(o.cost, mean, mean)]
        near = [o for o in near if rank(o) >= value - tolerance - 1e-12]
        if near:
            return Shared(min(near, key=lambda o: (o.cost, -rank(o), not o.fixed)))
    return chosen


class ChoosesAPoint:
    """What the tabular adaptive runtimes (DAG, gating, CSTC/CSCC) take per request: a
    ``tolerance`` and, with ``budget_mode`` "mean", the ``mean_budget`` and the item's
    ``mean_draw``.

    By default a request's budget is a hard cap on this item's spend, and a point is an
    option when what it delivers under that cap fits (:func:`pick`). With a mean budget the
    budget is the average spend the client asks for over its requests (the papers' budget:
    paper 000's and 001's points are compared at equal *average* cost), and the item may
    spend up to the hard cap (the request's ``max_cost``, else every sensor): the choice is
    :func:`mean_choice`'s, the best average the points can deliver at the mean, two of them
    shared out over the items (by the item's draw) when that is better than one. So easy
    items spend less than the budget and hard ones more, which a per-item cap cannot buy."""

    request_options: ClassVar[frozenset[str]] = frozenset({"tolerance", "mean_budget", "mean_draw"})
    tolerance: float = 0.0
    mean_budget: float | None = None
    mean_draw: float = 0.0
    # What the mean budget bought: set by pick on the request's copy (see with_options).
    shared: Shared[Any] | None = None

    def pick(self, options: Sequence[Option[E]], margin: float, rows: int) -> Option[E] | None:
        """The option to serve (None: none fits), by the request's budget mode."""
        if self.mean_budget is None:
            return pick(options, self.tolerance, margin, rows)
        chosen = mean_choice(options, self.mean_budget, self.tolerance, margin, rows)
        self.shared = chosen
        return None if chosen is None else chosen.of(self.mean_draw)


def capped_at(caps: Sequence[CappedNumbers], budget: float) -> CappedNumbers | None:
    """A point's validation numbers under ``budget`` as a hard cap: the entry of the largest
    cap that fits (None: below the first)."""
    fitting = [c for c in caps if affordable(c.cap, budget, budget)]
    return fitting[-1] if fitting else None


class FixedPoints:
    """A runtime's fixed points, with their features (each its model's)."""

    def __init__(self, runtime: StrategyRuntime[Any], points: Sequence[FixedPoint]) -> None:
        self.runtime = runtime
        self.points = list(points)
        self.features = {p.model: runtime.model_features[p.model] for p in self.points}

    def cost(
        self, point: FixedPoint, per_feature: Mapping[str, float], in_hand: frozenset[str]
    ) -> float:
        return sum(per_feature[f] for f in self.features[point.model] if f not in in_hand)

    def options(
        self, per_feature: Mapping[str, float], budget: float, in_hand: frozenset[str]
    ) -> list[Option[FixedPoint]]:
        """Every fixed point whose missing features fit ``budget``."""
        out = []
        for p in self.points:
            cost = self.cost(p, per_feature, in_hand)
            if affordable(cost, budget, budget):
                out.append(Option(cost, p.accuracy, p, fixed=True))
        return out

    def session(
        self, point: FixedPoint, per_feature: Mapping[str, float], planned: float
    ) -> FixedSession:
        return FixedSession(self.runtime, point, self.features[point.model], per_feature, planned)

    def models(self) -> list[str]:
        return [p.model for p in self.points]


class FixedSession(Session):
    """A fixed subset as a plain pipeline: acquire its model's missing features, cheapest
    first, while the rest of them fits what is left (the budget a hard cap; cached and
    given ones are free), then answer with the model. When they no longer fit, the most
    accurate model computable from the features in hand answers."""

    def __init__(
        self,
        runtime: StrategyRuntime[Any],
        point: FixedPoint,
        features: Sequence[str],
        per_feature: Mapping[str, float],
        planned: float,
    ) -> None:
        self.runtime = runtime
        self.point = point
        self.features = sorted(features, key=lambda f: (per_feature[f], f))
        self.per_feature = per_feature
        self.planned = planned
        self.expected_accuracy = point.accuracy
        self.stopped = False
        self.answered = False

    def step(self, obs: Observation) -> Step:
        missing = [f for f in self.features if f not in obs.features]
        if not missing:
            self.answered = True
            return Answer(self.point.model)
        cost = sum(self.per_feature[f] for f in missing)
        if not affordable(cost, obs.remaining, obs.budget):
            return self.fallback(obs)
        return Acquire(missing[0])

    def fallback(self, obs: Observation) -> Answer:
        if all(f in obs.features for f in self.features):
            self.answered = True
            return Answer(self.point.model)
        self.stopped = True
        self.expected_accuracy = None
        return Answer(self.runtime.best_computable(set(obs.features)))

    def path(self) -> list[list[str]]:
        return [[], sorted(self.features)] if self.answered else [[]]

    def report(self) -> dict[str, Any]:
        return {
            "kind": "fixed",
            "point": self.point.model,
            "features": sorted(self.features),
            "stopped_by_budget": self.stopped,
        }
