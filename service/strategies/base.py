"""The strategy runtime interface: one small protocol every strategy implements.

A request is a dialogue between the handler and a :class:`Session`: the handler reports what
is known (features in hand, item size, budget, cost spent so far) and the session answers
with the next step, either *acquire this feature* or *answer with this model*; the runtime
then predicts from the features in hand (``StrategyRuntime.predict``). Static plans
(Poly-Dom) and adaptive policies (anytime Poly-Dom, greedy sequences, DAGs, gates, trees)
fit the same loop; adaptive ones read ``Observation.spent`` (and feature values) after every
step, and may override ``predict`` (a gate choosing between models, a tree mixing leaves).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol

import numpy as np
import numpy.typing as npt
from typing_extensions import TypeVar

from service.bundle import Manifest, StrategySpec
from service.inference import LoadedModel
from service.types import FloatVector, horner


@dataclass(frozen=True, slots=True, repr=False)
class Acquire:
    """Compute this feature next.

    ``then``: more features, each with its predicted cost, that the request loop computes
    after it, in order, without asking the session again; each only while the budget is not
    spent and its cost fits in what is left of the planned budget less ``reserve``
    (:func:`affordable`, as a session would check it). The session is asked again after the
    last of them, or at the first that does not fit. For plans that do not depend on the
    values they acquire (a structured session's base templates, a policy's chosen parts):
    one step instead of one per feature."""

    feature: str
    then: tuple[tuple[str, float], ...] = ()
    reserve: float = 0.0

    def __repr__(self) -> str:
        if not self.then:
            return f"Acquire(feature={self.feature!r})"
        return f"Acquire(feature={self.feature!r}, then={self.then!r}, reserve={self.reserve!r})"


@dataclass(frozen=True, slots=True)
class Answer:
    """Stop and predict with this model (its features are all in hand)."""

    model: str


Step = Acquire | Answer


@dataclass(frozen=True, slots=True)
class Observation:
    """What is known at a step. ``budget`` is what may be planned (the request's budget less
    the overhead reserve); ``spent`` is the measured cost so far, cache read included."""

    size: int
    budget: float
    spent: float
    features: Mapping[str, FloatVector]

    @property
    def remaining(self) -> float:
        return self.budget - self.spent


# Relative slack of budget comparisons (float sums of costs), as the trainers' comparisons.
TOLERANCE = 1e-9


def affordable(cost: float, available: float, budget: float) -> bool:
    """Whether ``cost`` fits in ``available`` (of a request's ``budget``), up to the float
    rounding of summed costs."""
    return cost <= available + TOLERANCE * max(1.0, abs(budget))


class Session(ABC):
    """One request's plan. ``planned`` is the predicted cost of the plan made at the start."""

    planned: float = 0.0
    # The accuracy to report when the strategy knows better than the answering model's own
    # estimate (a DAG policy's held-out accuracy on the items it routes); None: the model's.
    expected_accuracy: float | None = None
    # The prediction when it is not one class (a structured strategy's word), set by
    # ``decode``; None: the class of highest probability.
    prediction: str | None = None

    def decode(self, features: Mapping[str, FloatVector]) -> FloatVector | None:
        """Structured strategies decode the whole item here, after the session answered
        (timed as inference), and return the class probabilities to report; None (the
        default): the runtime's ``predict`` answers."""
        return None

    @abstractmethod
    def step(self, obs: Observation) -> Step:
        """The next step given what is known now."""

    @abstractmethod
    def fallback(self, obs: Observation) -> Answer:
        """The best answer from the features in hand (the budget has run out)."""

    def path(self) -> list[list[str]] | None:
        """The states visited, for strategies that walk a graph of states (else None)."""
        return None

    def report(self) -> dict[str, Any] | None:
        """A small JSON-ready account of the strategy's decisions for this request, returned
        to the client as ``PredictResponse.decision`` (gating: the operating point, the gate's
        score and which model answered); None for strategies with nothing to add."""
        return None


class Calibration(Protocol):
    """Live corrections of the profiled cost curves (``service.calibration``)."""

    @property
    def active(self) -> bool: ...

    def factors_at(self, n: float) -> dict[str, float]: ...


# How many sizes' profiled costs a CostModel keeps (an image bundle sees many sizes; a word
# bundle a few dozen); the cache starts over when full.
_PROFILED_SIZES = 1024


class CostModel:
    """A bundle's per-extractor cost curves: the profiled polynomials, corrected by live
    calibration once it has data. Shared by every strategy of the bundle."""

    def __init__(self, manifest: Manifest, calibration: Calibration | None = None) -> None:
        self.names = [e.name for e in manifest.extractors]
        self.position = {name: i for i, name in enumerate(self.names)}
        width = max(len(e.cost.coefficients) for e in manifest.extractors) if self.names else 1
        self.coefficients = np.zeros((len(self.names), width), dtype=np.float64)
        for i, e in enumerate(manifest.extractors):
            self.coefficients[i, : len(e.cost.coefficients)] = e.cost.coefficients
        self.calibration = calibration
        self._profiled: dict[float, dict[str, float]] = {}

    @property
    def calibrated(self) -> bool:
        """Whether live corrections are in force (profiled curves no longer the truth)."""
        return self.calibration is not None and self.calibration.active

    def factors_at(self, n: float) -> dict[str, float]:
        """The calibration factor of every extractor at size ``n`` (1.0 uncalibrated)."""
        if self.calibrated:
            assert self.calibration is not None
            factors = self.calibration.factors_at(n)
            return {k: factors.get(k, 1.0) for k in self.names}
        return dict.fromkeys(self.names, 1.0)

    def profiled_at(self, n: float) -> dict[str, float]:
        """Every extractor's profiled cost at size ``n`` (a fresh dict: the curves at a
        size are evaluated once and kept, for the last ``_PROFILED_SIZES`` sizes)."""
        known = self._profiled.get(n)
        if known is None:
            values = np.asarray(horner(self.coefficients, n))
            known = dict(zip(self.names, values.tolist(), strict=True))
            if len(self._profiled) >= _PROFILED_SIZES:
                self._profiled.clear()
            self._profiled[n] = known
        return dict(known)

    def at(self, n: float) -> dict[str, float]:
        """Every extractor's predicted cost at size ``n`` (calibrated when available)."""
        return self.at_with_factors(n)[0]

    def at_with_factors(self, n: float) -> tuple[dict[str, float], dict[str, float] | None]:
        """:meth:`at` and the calibration factors it applied (None when uncalibrated), for
        planners that need both without computing the factors twice."""
        costs = self.profiled_at(n)
        if self.calibrated:
            factors = self.factors_at(n)
            return {k: v * factors[k] for k, v in costs.items()}, factors
        return costs, None

    def set_coefficients(self, features: Sequence[str]) -> npt.NDArray[np.float64]:
        rows = [self.position[f] for f in features]
        if not rows:
            return np.zeros(self.coefficients.shape[1])
        summed: npt.NDArray[np.float64] = self.coefficients[rows].sum(axis=0)
        return summed


# The spec a runtime serves; a bare ``StrategyRuntime`` is one of any spec.
SpecT = TypeVar("SpecT", bound=StrategySpec, default=StrategySpec)


class StrategyRuntime(ABC, Generic[SpecT]):
    """Built once per strategy of a loaded bundle; ``begin`` is called per request.

    Typed by the spec it serves (``class PolyDomRuntime(StrategyRuntime[PolyDomStrategy])``):
    ``self.spec`` is that spec, checked by ``kind`` when the runtime is built."""

    kind: ClassVar[str]
    #: What a request may set for itself (:meth:`with_options`): none by default.
    request_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        manifest: Manifest,
        spec: SpecT,
        models: dict[str, LoadedModel],
        costs: CostModel,
        bundle_dir: Path | None = None,
    ) -> None:
        if spec.kind != self.kind:
            raise ValueError(
                f"{type(self).__name__} serves strategies of kind {self.kind!r}; strategy "
                f"{spec.name!r} is of kind {spec.kind!r} (build its runtime with "
                f"strategy_for({spec.kind!r}))"
            )
        self.manifest = manifest
        self.bundle_dir = bundle_dir
        self.spec: SpecT = spec
        self.name: str = spec.name
        self.models = models
        self.costs = costs
        self.accuracy = {m.id: m.accuracy for m in manifest.models}
        self.model_features = {m.id: tuple(m.features) for m in manifest.models}
        self.setup()

    def with_options(self, **options: Any) -> StrategyRuntime[SpecT]:
        """This runtime as one request asks for it: a shallow copy with each option set as
        an attribute (e.g. ``tolerance``: the tabular runtimes' choice of a point). Every
        option must be one of :attr:`request_options`; ``ValueError`` names the others."""
        unknown = sorted(set(options) - self.request_options)
        if unknown:
            takes = sorted(self.request_options) or "none"
            raise ValueError(
                f"strategy {self.name!r} (kind {self.kind!r}) takes no per-request "
                f"{', '.join(repr(u) for u in unknown)}; it takes: {takes}"
            )
        view = copy.copy(self)
        for name, value in options.items():
            setattr(view, name, value)
        return view

    def setup(self) -> None:
        """Build what the strategy needs from ``self.spec`` (runs once, at the end of
        ``__init__``); raise ``BundleError`` or ``ValueError`` for a spec it cannot serve."""

    def forget_timings(self) -> None:
        """Forget what the runtime learnt from timing its own requests (the loader's warm-up
        runs are no sample of the requests to come); nothing by default."""

    @abstractmethod
    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        """Plan a request for an item of ``size`` with ``budget``; ``in_hand`` are free."""

    def planned_ms(self, size: int, budget: float, in_hand: frozenset[str]) -> float | None:
        """What :meth:`begin`'s plan for ``budget`` is predicted to cost (the features not in
        hand), when the strategy can say so without beginning it; None when it cannot. The
        service runs a plan predicted this small on its event loop rather than handing it
        to a thread (``service.handler``: the hand-off costs more than a small plan)."""
        return None

    def predict(self, answer: Answer, features: Mapping[str, FloatVector]) -> FloatVector:
        """Class probabilities for ``answer`` from the features in hand."""
        return self.models[answer.model].predict_proba(features)

    def skyline(self, size: int) -> list[tuple[float, float, str]]:
        """(cost, accuracy, entry) of the models this strategy may answer with that are
        worth their cost at ``size``: sorted by cost, accuracy strictly rising. An entry is a
        model id, or what the strategy chooses between (a gating operating point); its
        features are ``skyline_features(entry)``."""
        per_feature = self.costs.at(size)
        return pareto(
            (sum(per_feature[f] for f in self.model_features[m]), self.accuracy[m], m)
            for m in self.answerable()
        )

    def skyline_features(self, entry: str) -> list[str]:
        """The features a skyline entry computes (its model's, by default)."""
        return list(self.model_features[entry])

    def answerable(self) -> list[str]:
        """Model ids this strategy may answer with (all of the bundle's by default)."""
        return list(self.model_features)

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


def pareto(points: Iterable[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (cost, accuracy, id) points worth their cost: sorted by cost (then accuracy,
    best first), each strictly more accurate than every cheaper one."""
    out: list[tuple[float, float, str]] = []
    for cost, accuracy, entry in sorted(points, key=lambda p: (p[0], -p[1], p[2])):
        if not out or accuracy > out[-1][1]:
            out.append((cost, accuracy, entry))
    return out


# The one map from a spec's ``kind`` to its runtime, filled by ``@register_strategy`` when
# ``service.strategies`` imports the built-in runtimes.
_REGISTRY: dict[str, type[StrategyRuntime[Any]]] = {}

RuntimeT = TypeVar("RuntimeT", bound=StrategyRuntime[Any])


def register_strategy(cls: type[RuntimeT]) -> type[RuntimeT]:
    """Class decorator: serve specs of ``cls.kind`` with ``cls``."""
    if cls.kind in _REGISTRY and _REGISTRY[cls.kind] is not cls:
        raise ValueError(
            f"strategy kind {cls.kind!r} already has a runtime, {_REGISTRY[cls.kind].__name__}"
        )
    _REGISTRY[cls.kind] = cls
    return cls


def strategy_for(kind: str) -> type[StrategyRuntime[Any]]:
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise LookupError(
            f"strategy kind {kind!r} has no runtime; known: {sorted(_REGISTRY)}"
        ) from None
