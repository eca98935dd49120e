"""Gates that route where routing pays (issue 25): f1's own confidence as the gate, and a
high-cost model that may be f0 or any fixed sensor subset.

An ADAPT-GBRT / GreedyMiser f1 is kept as it was fitted; the gate becomes "f1's top class
probability is below a level", the level set on the validation rows so that a chosen fraction
of them goes on (:data:`~training.gating.sweep.ROUTED_FRACTIONS`), and the item goes on to a
high-cost model, f0 on every sensor or a fixed subset's model (:mod:`training.fixed_subsets`)
that costs more than f1 and is more accurate on validation. The high-cost model reads its own
sensors: those f1 has already bought are free, the others are paid only for the items sent on.
A fixed subset as the high-cost model is what makes routing deliverable below the full cost:
under a per-item hard cap a point is worth its gated accuracy only when the budget covers f1's
and the high model's sensors together. Which of these points are kept is the validation
Pareto set, as for every other gating point; the gate is exported as f1's graph followed by
``-max(probabilities)`` (:func:`training.export.gating.confidence_gate_onnx`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.types import FloatArray
from training.gating.base import IntArray, _GatedClassifier, groups_cost
from training.gating.gbrt import AdaptGbrt


@dataclass(frozen=True)
class HighModel:
    """A high-cost model a confidence gate may send items to: its bundle model id, the model
    (fitted on class indices) and the columns of X it reads."""

    model_id: str
    model: Any
    columns: list[int]


class _OnColumns:
    """A model over some columns of X, answering ``predict_proba`` on whole rows."""

    def __init__(self, model: Any, columns: Sequence[int]) -> None:
        self.model = model
        self.columns = list(columns)

    def predict_proba(self, X: Any) -> FloatArray:
        Xa = np.asarray(X, dtype=np.float64)
        return np.asarray(self.model.predict_proba(Xa[:, self.columns]), dtype=np.float64)


class ConfidenceGate(_GatedClassifier):
    """A fitted ADAPT-GBRT / GreedyMiser system's f1, gated by its own confidence: an item
    goes to ``high`` when f1's top class probability is below ``level`` (the gate score is
    ``-top``, routed above ``-level``). Built from fitted parts, never fitted itself."""

    def __init__(
        self,
        source: AdaptGbrt,
        high: HighModel,
        level: float,
        routed: float = 0.0,
        source_id: str = "",
    ) -> None:
        self.source = source
        self.source_id = source_id
        self.high = high
        self.level = level
        self.routed = routed
        self.p_full = routed
        self.lam = source.lam
        self.classes_ = source.classes_
        self.n_features_in_ = source.n_features_in_
        self.f0_ = _OnColumns(high.model, high.columns)
        self.f1_features_ = source.f1_features_
        self.gate_features_ = source.f1_features_
        groups, costs = source.groups_, source.costs_
        self.low_cost_ = groups_cost(groups, costs, source.f1_features_)
        both = np.union1d(source.f1_features_, np.asarray(high.columns, dtype=np.int64))
        self.full_cost_ = groups_cost(groups, costs, both)

    def f1_proba(self, X: Any) -> FloatArray:
        return self.source.f1_proba(X)

    def gate_score(self, X: Any) -> FloatArray:
        return np.asarray(-np.max(self.f1_proba(X), axis=1), dtype=np.float64)

    def routing_threshold(self) -> float:
        return -float(self.level)


def confidence_levels(top: FloatArray, fractions: Sequence[float]) -> list[tuple[float, float]]:
    """(level, fraction) pairs: each level routes about ``fraction`` of the rows whose f1
    top probabilities are ``top`` (midway between two distinct values, so float32
    inference does not move the rows that sit next to it); repeated levels dropped."""
    from training.gating.sweep import threshold_for_fraction

    out: list[tuple[float, float]] = []
    for fraction in fractions:
        level = -threshold_for_fraction(-np.asarray(top, dtype=np.float64), fraction)
        if np.isfinite(level) and all(level != seen for seen, _ in out):
            out.append((float(level), float(fraction)))
    return out


def confidence_systems(
    sources: Sequence[tuple[str, AdaptGbrt]],
    highs: Sequence[HighModel],
    X_val: FloatArray,
    y_val: npt.NDArray[Any],
    fractions: Sequence[float],
) -> list[ConfidenceGate]:
    """Every (f1, high-cost model, level) worth trying: per distinct f1 that reads some
    sensor, each high-cost model that is more accurate on the validation rows than f1 alone
    and reads a sensor f1 does not, at the levels routing each of ``fractions`` of the
    validation rows."""
    out: list[ConfidenceGate] = []
    seen: set[int] = set()
    if not sources:
        return []
    y_idx = _index(sources[0][1].classes_, y_val)
    high_acc = {
        h.model_id: float(
            np.mean(np.argmax(_OnColumns(h.model, h.columns).predict_proba(X_val), axis=1) == y_idx)
        )
        for h in highs
    }
    for source_id, source in sources:
        key = id(source.f1_booster_)
        if key in seen or source.f1_features_.size == 0:
            continue
        seen.add(key)
        proba = source.f1_proba(X_val)
        f1_acc = float(np.mean(source.classes_[np.argmax(proba, axis=1)] == y_val))
        levels = confidence_levels(np.max(proba, axis=1), fractions)
        f1_cols = set(source.f1_features_.tolist())
        for high in highs:
            if high_acc[high.model_id] <= f1_acc or set(high.columns) <= f1_cols:
                continue
            out += [
                ConfidenceGate(source, high, level, routed, source_id) for level, routed in levels
            ]
    return out


def confidence_points(
    systems: Sequence[ConfidenceGate],
    X_val: FloatArray,
    y_val: npt.NDArray[Any],
    X_test: FloatArray | None = None,
    y_test: npt.NDArray[Any] | None = None,
) -> list[Any]:
    """The systems as sweep points (method ``confidence``), scored on the validation rows
    (and the test rows when given) as :func:`training.gating.sweep.score` scores the others:
    accuracy, average cost, fraction routed (each f1 and high-cost model predicts once per
    set of rows)."""
    from training.gating.sweep import SweepPoint

    rows = [(X_val, y_val)] + ([(X_test, y_test)] if X_test is not None else [])
    cache: dict[tuple[int, int], FloatArray] = {}

    def proba(key: int, model: Any, which: int) -> FloatArray:
        if (key, which) not in cache:
            cache[(key, which)] = np.asarray(model.predict_proba(rows[which][0]))
        return cache[(key, which)]

    out: list[SweepPoint] = []
    for system in systems:
        numbers: list[tuple[float, float, float, float]] = []
        for which, (_, y) in enumerate(rows):
            p1 = proba(id(system.source), _F1(system), which)
            ph = proba(id(system.high), system.f0_, which)
            routed = np.max(p1, axis=1) < system.level
            pred = np.where(routed, np.argmax(ph, axis=1), np.argmax(p1, axis=1))
            labels = system.classes_[pred]
            paid = np.where(routed, system.full_cost_, system.low_cost_)
            f1_right = system.classes_[np.argmax(p1, axis=1)] == np.asarray(y)
            numbers.append(
                (
                    float(np.mean(labels == np.asarray(y))),
                    float(np.mean(paid)),
                    float(np.mean(routed)),
                    float(np.mean(f1_right)),
                )
            )
        accuracy, cost, fraction, f1 = numbers[0]
        point = SweepPoint(
            "confidence",
            system.routed,
            float(system.lam),
            system,
            accuracy,
            cost,
            fraction,
            params={"f1": system.source_id, "to": system.high.model_id},
            val_f1_accuracy=f1,
        )
        if len(numbers) > 1:
            test = numbers[1]
            point.test_accuracy, point.test_cost = test[0], test[1]
            point.test_fraction_full, point.test_f1_accuracy = test[2], test[3]
        out.append(point)
    return out


class _F1:
    """A confidence system's f1 as a model with ``predict_proba``."""

    def __init__(self, system: ConfidenceGate) -> None:
        self.system = system

    def predict_proba(self, X: Any) -> FloatArray:
        return self.system.f1_proba(X)


def _index(classes: npt.NDArray[Any], y: npt.NDArray[Any]) -> IntArray:
    """Labels as indices into ``classes`` (-1 for a label not among them)."""
    position = {c: i for i, c in enumerate(np.asarray(classes).tolist())}
    return np.asarray([position.get(v, -1) for v in np.asarray(y).tolist()], dtype=np.int64)
