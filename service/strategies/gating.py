"""Adaptive gating between a low-cost and a high-cost model (paper 001: ADAPT-LIN,
ADAPT-GBRT, the L1 baseline, GreedyMiser) as a strategy runtime.

A bundle's gating strategy holds operating points, each a gate g, a low-cost model f1 and the
high-cost model (f0, or a fixed subset's model). Per request the runtime takes the point
that delivers the most validation accuracy under the budget as a hard cap (within the
tolerance, the cheapest on average; see :meth:`GatingRuntime.choose`), the best fixed sensor
subsets of the spec competing with the gating points (:mod:`service.strategies.fixed`), where
a point that can also pay the high-cost model's features is worth its gated accuracy at

    expected cost = c(g's ∪ f1's features) + fraction_full · c(f0's features not among them)

and one that can pay only g's and f1's is worth its f1's accuracy, with each extractor's
calibrated cost at that size and cached features free. It then computes
g's and f1's features, evaluates g and, if g sends the item to f0 and what is left of the
budget covers f0's missing features, computes them and answers with f0; otherwise f1 answers.
The budget is a hard cap, re-checked before every feature: when g's and f1's features cannot
all be bought, the most accurate model computable from the features in hand answers (bundles
carry a feature-less prior); when f0's cannot, f1 does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from service.bundle import FixedPoint, GatePoint, GatingStrategy
from service.errors import BundleError
from service.inference import open_onnx
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
from service.strategies.fixed import ChoosesAPoint, FixedPoints, Option
from service.types import FloatVector


class _Point:
    """One operating point: its gate (an ONNX session, or None: never sends to f0) and the
    features of its two stages."""

    def __init__(self, spec: GatePoint, runtime: GatingRuntime) -> None:
        self.spec = spec
        self.low = spec.low_model
        self.high = spec.high_model
        what = f"gating strategy {runtime.name!r}, point {spec.id!r}"
        low = runtime.model_features[self.low]
        high = runtime.model_features[self.high]
        if spec.gate_file is not None and self.low == self.high:
            raise BundleError(f"{what}: the gate chooses between {self.low!r} and itself")
        # Stage 1: g's features, then f1's (computed for every item); stage 2: the rest of
        # the high-cost model's (f0, or a fixed subset's model).
        self.first = tuple(dict.fromkeys([*spec.gate_features, *low]))
        self.extra = tuple(f for f in high if f not in self.first)
        self.session: ort.InferenceSession | None = None
        self.input = ""
        if spec.gate_file is not None:
            self._load_gate(spec.gate_file, runtime, what)

    def _load_gate(self, file: str, runtime: GatingRuntime, what: str) -> None:
        if runtime.bundle_dir is None:
            raise BundleError(f"{what}: a gate needs its bundle folder to load from")
        session = open_onnx(runtime.bundle_dir, file, f"{what}: gate", field="gate_file")
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise BundleError(
                f"{what}: gate {file!r} has {len(inputs)} inputs and {len(outputs)} outputs, "
                "expected one of each (features -> score)"
            )
        width = inputs[0].shape[-1] if inputs[0].shape else None
        declared = self.spec.gate_input_dims
        if isinstance(width, int) and width != declared:
            raise BundleError(
                f"{what}: gate {file!r} takes {width} inputs, its gate_features "
                f"{self.spec.gate_features} give {declared}"
            )
        self.session, self.input = session, inputs[0].name
        try:
            probe = self._run(np.zeros(declared, dtype=np.float32))
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise BundleError(
                f"{what}: gate {file!r} does not run on its {declared} declared inputs: {exc}"
            ) from exc
        if probe.shape != (1, 1):
            raise BundleError(
                f"{what}: gate {file!r} outputs shape {probe.shape}, expected (1, 1): one score"
            )

    def _run(self, x: FloatVector) -> FloatVector:
        assert self.session is not None
        out = self.session.run(None, {self.input: x.reshape(1, -1)})[0]
        result: FloatVector = np.asarray(out, dtype=np.float32)
        return result

    def score(self, features: Mapping[str, FloatVector]) -> float | None:
        """g's score on the features in hand; None without a gate."""
        if self.session is None:
            return None
        parts = [features[f] for f in self.spec.gate_features]
        x = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        return float(self._run(x.astype(np.float32, copy=False))[0, 0])

    def expected_cost(self, per_feature: Mapping[str, float], in_hand: frozenset[str]) -> float:
        first = sum(per_feature[f] for f in self.first if f not in in_hand)
        extra = sum(per_feature[f] for f in self.extra if f not in in_hand)
        return first + self.spec.fraction_full * extra


Outcome = Literal["low", "high", "fallback"]


class GatingSession(Session):
    def __init__(
        self,
        runtime: GatingRuntime,
        point: _Point,
        per_feature: dict[str, float],
        planned: float,
    ) -> None:
        self.runtime = runtime
        self.point = point
        self.per_feature = per_feature
        self.planned = planned
        self.expected_accuracy = point.spec.accuracy
        self.gated = False  # g has run (its and f1's features are in hand)
        self.gate_score: float | None = None
        self.sent_to_high = False
        self.outcome: Outcome = "fallback"
        self.visited: list[list[str]] = [[]]

    def _cost(self, features: list[str]) -> float:
        return sum(self.per_feature[f] for f in features)

    def _visit(self, features: list[str]) -> None:
        if features != self.visited[-1]:
            self.visited.append(features)

    def _answer(self, outcome: Outcome, model: str, *, as_planned: bool) -> Answer:
        self.outcome = outcome
        # The point's held-out accuracy holds for the gated system it measured; an answer
        # that departs from it reports the answering model's own estimate.
        if not as_planned:
            self.expected_accuracy = None
        return Answer(model)

    def _best_in_hand(self, in_hand: Mapping[str, FloatVector]) -> Answer:
        return self._answer(
            "fallback", self.runtime.best_computable(set(in_hand)), as_planned=False
        )

    def step(self, obs: Observation) -> Step:
        point, in_hand = self.point, obs.features
        if not self.gated:
            missing = [f for f in point.first if f not in in_hand]
            if missing:
                # The hard cap, re-checked before each feature: if the rest of g's and f1's
                # features no longer fits, buying part of them is wasted.
                if not affordable(self._cost(missing), obs.remaining, obs.budget):
                    return self._best_in_hand(in_hand)
                return Acquire(missing[0])
            self.gated = True
            self._visit(list(point.first))
            self.gate_score = point.score(in_hand)
            self.sent_to_high = (
                self.gate_score is not None and self.gate_score > point.spec.threshold
            )
            if not self.sent_to_high:
                return self._answer("low", point.low, as_planned=True)
        missing = [f for f in self.runtime.model_features[point.high] if f not in in_hand]
        if not missing:
            self._visit([*point.first, *point.extra])
            return self._answer("high", point.high, as_planned=True)
        if not affordable(self._cost(missing), obs.remaining, obs.budget):
            return self._answer("low", point.low, as_planned=False)
        return Acquire(missing[0])

    def fallback(self, obs: Observation) -> Answer:
        if self.gated:  # f1's features are in hand
            return self._answer("low", self.point.low, as_planned=not self.sent_to_high)
        return self._best_in_hand(obs.features)

    def path(self) -> list[list[str]]:
        return [list(v) for v in self.visited]

    def report(self) -> dict[str, Any]:
        return {
            "kind": "gating",
            "point": self.point.spec.id,
            "method": self.point.spec.method,
            "score": self.gate_score,
            "sent_to_high": self.sent_to_high,
            "answered_by": (
                "high"
                if self.outcome == "low" and self.point.low == self.point.high
                else self.outcome
            ),
        }


@register_strategy
class GatingRuntime(ChoosesAPoint, StrategyRuntime[GatingStrategy]):
    kind = "gating"

    def setup(self) -> None:
        spec = self.spec
        self.points = [_Point(p, self) for p in spec.points]
        self.by_id = {p.spec.id: p for p in self.points}
        self.fixed = FixedPoints(self, spec.fixed)
        self.tolerance = float(spec.tolerance)

    def options(
        self, per_feature: Mapping[str, float], budget: float, in_hand: frozenset[str]
    ) -> list[Option[_Point | FixedPoint]]:
        """Every point the budget can serve, with its expected cost and the validation
        accuracy it delivers under the budget as a hard cap, and every fixed subset that fits.

        A point delivers its (gated) accuracy only when the budget also covers the high-cost
        model's missing features for the items its gate routes; when it covers g's and f1's
        features only, routed items are answered by f1, so the point is worth its f1's
        accuracy at the cost of g's and f1's features. (With a mean budget,
        :class:`ChoosesAPoint`, ``budget`` is the cap and ``pick`` weighs the expected costs
        against the mean.)"""
        out: list[Option[_Point | FixedPoint]] = []
        for p in self.points:
            first = sum(per_feature[f] for f in p.first if f not in in_hand)
            extra = sum(per_feature[f] for f in p.extra if f not in in_hand)
            if affordable(first + extra, budget, budget):
                out.append(Option(first + p.spec.fraction_full * extra, p.spec.accuracy, p))
            elif affordable(first, budget, budget):
                out.append(Option(first, self.accuracy[p.low], p))
        out.extend(self.fixed.options(per_feature, budget, in_hand))
        return out

    def choose(
        self, per_feature: Mapping[str, float], budget: float, in_hand: frozenset[str]
    ) -> tuple[_Point | FixedPoint, float, float]:
        """The point to serve with ``budget`` (a gating point or a fixed subset), with its
        expected cost and the validation accuracy it can deliver under that budget: among
        the options, those within ``tolerance`` of the best are equal and the cheapest
        (expected cost) wins; when none is affordable, the cheapest gating point (the session
        then answers with the best model computable from what it could buy)."""
        chosen = self.pick(
            self.options(per_feature, budget, in_hand), self.spec.margin, self.spec.validation_rows
        )
        if chosen is None:
            cheapest = min(
                self.points, key=lambda p: (p.expected_cost(per_feature, in_hand), -p.spec.accuracy)
            )
            return cheapest, cheapest.expected_cost(per_feature, in_hand), 0.0
        return chosen.entry, chosen.cost, chosen.accuracy

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        point, planned, deliverable = self.choose(per_feature, budget, in_hand)
        if isinstance(point, FixedPoint):
            return self.fixed.session(point, per_feature, planned)
        session = GatingSession(self, point, per_feature, planned)
        if deliverable < point.spec.accuracy and point.low != point.high:
            # f0's features would not fit for the items the gate routes: the point is worth
            # its f1 alone under this budget, and says so.
            session.expected_accuracy = self.accuracy[point.low]
        return session

    def skyline(self, size: int) -> list[tuple[float, float, str]]:
        """(expected cost at ``size``, validation accuracy, point id or fixed model id) of the
        points worth their cost."""
        per_feature = self.costs.at(size)
        none: frozenset[str] = frozenset()
        points = [
            (p.expected_cost(per_feature, none), p.spec.accuracy, p.spec.id) for p in self.points
        ]
        fixed = [
            (self.fixed.cost(f, per_feature, none), f.accuracy, f.model) for f in self.fixed.points
        ]
        return pareto(points + fixed)

    def skyline_features(self, entry: str) -> list[str]:
        """A point's features computed for every item: g's and f1's (a fixed subset's: its
        model's)."""
        if entry in self.by_id:
            return list(self.by_id[entry].first)
        return list(self.model_features[entry])

    def answerable(self) -> list[str]:
        points = {m for p in self.points for m in (p.low, p.high)}
        return sorted(points | set(self.fixed.models()))
