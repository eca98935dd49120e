"""The strategy runtime interface: one small protocol every strategy implements.

A request is a dialogue between the handler and a :class:`Session`: the handler reports what
is known (features in hand, item size, budget, cost spent so far) and the session answers
with the next step, either *acquire this feature* or *answer with this model*; the runtime
then predicts from the features in hand (``StrategyRuntime.predict``). Static plans
(Poly-Dom) and adaptive policies (greedy sequences, DAGs, gates, trees) fit the same loop;
adaptive ones read the feature values in ``Observation.features`` and may override
``predict`` (a gate choosing between models, a tree mixing leaves).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from service.bundle import Manifest
from service.inference import LoadedModel
from service.types import FloatVector, horner


@dataclass(frozen=True, slots=True)
class Acquire:
    """Compute this feature next."""

    feature: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Stop and predict with this model (its features are all in hand)."""

    model: str


Step = Acquire | Answer


@dataclass(frozen=True, slots=True)
class Observation:
    size: int
    budget: float
    spent: float
    features: Mapping[str, FloatVector]

    @property
    def remaining(self) -> float:
        return self.budget - self.spent


class Session(ABC):
    """One request's plan. ``planned`` is the predicted cost of the plan made at the start."""

    planned: float = 0.0

    @abstractmethod
    def step(self, obs: Observation) -> Step:
        """The next step given what is known now."""

    @abstractmethod
    def fallback(self, obs: Observation) -> Answer:
        """The best answer from the features in hand (the budget has run out)."""


class CostTable:
    """Per-extractor cost polynomials of a bundle, as a coefficient matrix."""

    def __init__(self, manifest: Manifest) -> None:
        self.names = [e.name for e in manifest.extractors]
        self.position = {name: i for i, name in enumerate(self.names)}
        width = max(len(e.cost.coefficients) for e in manifest.extractors) if self.names else 1
        self.coefficients = np.zeros((len(self.names), width), dtype=np.float64)
        for i, e in enumerate(manifest.extractors):
            self.coefficients[i, : len(e.cost.coefficients)] = e.cost.coefficients

    def at(self, n: float) -> dict[str, float]:
        """Every extractor's predicted cost at size ``n``."""
        values = np.asarray(horner(self.coefficients, n))
        return dict(zip(self.names, values.tolist(), strict=True))

    def set_coefficients(self, features: list[str] | tuple[str, ...]) -> npt.NDArray[np.float64]:
        rows = [self.position[f] for f in features]
        return self.coefficients[rows].sum(axis=0) if rows else np.zeros(self.coefficients.shape[1])


class StrategyRuntime(ABC):
    """Built once per loaded bundle from its manifest; ``begin`` is called per request."""

    kind: ClassVar[str]

    def __init__(self, manifest: Manifest, models: dict[str, LoadedModel]) -> None:
        self.manifest = manifest
        self.models = models
        self.costs = CostTable(manifest)
        self.accuracy = {m.id: m.accuracy for m in manifest.models}
        self.model_features = {m.id: tuple(m.features) for m in manifest.models}

    @abstractmethod
    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        """Plan a request for an item of ``size`` with ``budget``; ``in_hand`` are free."""

    def predict(self, answer: Answer, features: Mapping[str, FloatVector]) -> FloatVector:
        """Class probabilities for ``answer`` from the features in hand."""
        return self.models[answer.model].predict_proba(features)

    def best_computable(self, in_hand: frozenset[str] | set[str]) -> str:
        """The most accurate model whose features are all in hand (the prior always is)."""
        best: str | None = None
        for model_id, feats in self.model_features.items():
            if all(f in in_hand for f in feats) and (
                best is None or self.accuracy[model_id] > self.accuracy[best]
            ):
                best = model_id
        if best is None:
            raise LookupError("bundle has no model computable from the features in hand")
        return best


_REGISTRY: dict[str, type[StrategyRuntime]] = {}


def register_strategy(cls: type[StrategyRuntime]) -> type[StrategyRuntime]:
    _REGISTRY[cls.kind] = cls
    return cls


def strategy_for(kind: str) -> type[StrategyRuntime]:
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise LookupError(
            f"strategy kind {kind!r} has no runtime; known: {sorted(_REGISTRY)}"
        ) from None
