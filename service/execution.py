"""The plan → acquire → infer loop of one request.

One loop, :func:`run_session`, drives a strategy session to its answer. It is shared by the
HTTP handler and offline evaluation (through :func:`execute`, ``budgetserve-train
evaluate``) and by the cost simulator (``training.simulate``), so all of them measure the same
thing. What differs between them is behind two small protocols:

* a :class:`FeatureSource` acquires a feature: the bundle's extractor run on the item
  (:class:`ExtractorSource`, in the calling thread; the handler runs the whole loop on its
  extraction threads, after the cache read) or a lookup in a simulation;
* a :class:`CostMeter` says what has been spent: measured wall time (:class:`MeasuredCost`,
  which also feeds the bundle's cost calibrator), the manifest's declared cost of each
  feature (:class:`DeclaredCost`), or a simulated cost drawn from a noise model.

The loop also holds every strategy to the session contract (``service.strategies.base``):
a step is an :class:`Acquire` of a feature the source knows and that is not yet in hand,
or an :class:`Answer`; the fallback answers; and no session takes more than one step per
feature plus the answer. A strategy that breaks it raises :class:`StrategyFault` — a server
bug, never the client's (the API answers 500) — instead of re-extracting, looping forever or
failing with a ``KeyError``.

The module stays whole (over 450 lines): the loop and the two protocols it drives (sources,
meters) with their implementations are one contract, and :func:`execute` is the loop as the
handler and offline evaluation call it; apart, each piece would import all the others.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import numpy as np

from service.calibration import CostCalibrator
from service.errors import ExtractionFailed, InvalidItem
from service.extractors.base import Extractor, FeatureUnavailable
from service.items import DecodedItem
from service.registry import Bundle
from service.strategies.base import (
    TOLERANCE,
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
)
from service.types import FloatVector


class StrategyFault(RuntimeError):
    """A strategy runtime broke the session contract of ``service.strategies.base``.

    A bug in the strategy (or its bundle), not in the request: the HTTP layer reports it as
    a 500 ``internal_error``. ``strategy`` names the runtime at fault."""

    def __init__(self, strategy: str, message: str) -> None:
        super().__init__(f"strategy {strategy!r} {message}")
        self.strategy = strategy


class FeatureSource(Protocol):
    """How a feature is acquired."""

    @property
    def names(self) -> Collection[str]:
        """Every feature this source can acquire (a session may ask for no other)."""
        ...

    def acquire(self, feature: str) -> FloatVector:
        """The feature's vector. Raise a ``BudgetServeError`` (e.g. ``ExtractionFailed``)
        for an item it cannot be computed from, or ``FeatureUnavailable`` for one that
        cannot be had now (a sensor not sent and not fetched)."""
        ...


class CostMeter(Protocol):
    """How the cost a request has spent is metered, in the unit of its budget."""

    def spent(self) -> float:
        """The cost spent so far (called before every step and once at the end)."""
        ...

    def charge(self, feature: str, seconds: float) -> float:
        """Account for acquiring ``feature``, which took ``seconds`` of wall time; returns
        the cost charged for it."""
        ...


class ExtractorSource:
    """The bundle's extractors run on the item, in the calling thread; each result is
    checked to be ``(dims,)`` finite float32, else :class:`ExtractionFailed`."""

    def __init__(self, extractors: Mapping[str, Extractor], data: Any) -> None:
        self.extractors = extractors
        self.data = data

    @property
    def names(self) -> Collection[str]:
        return self.extractors.keys()

    def acquire(self, feature: str) -> FloatVector:
        extractor = self.extractors[feature]
        try:
            vector = np.ascontiguousarray(extractor.extract(self.data), dtype=np.float32)
        except FeatureUnavailable:
            raise
        except (ValueError, TypeError, ArithmeticError, IndexError) as exc:
            raise ExtractionFailed(feature, str(exc)) from exc
        if vector.shape != (extractor.dims,) or not np.isfinite(vector).all():
            raise ExtractionFailed(
                feature,
                f"returned shape {vector.shape} or non-finite values; expected "
                f"({extractor.dims},) finite float32",
            )
        return vector


# Below this CPU share a step of several extractions is not recorded extractor by extractor
# (MeasuredCost.charge_step).
SHARED_STEP_MIN_SHARE = 0.8


class MeasuredCost:
    """Milliseconds of wall time since ``start`` (a ``perf_counter()``); every extraction's
    time is recorded in ``calibrator`` for items of ``size``, with its thread CPU time when
    :func:`run_session` measured it (:meth:`charge_step`)."""

    def __init__(self, start: float, calibrator: CostCalibrator, size: int) -> None:
        self.start = start
        self.calibrator = calibrator
        self.size = size

    def spent(self) -> float:
        return _ms_since(self.start)

    def charge(self, feature: str, seconds: float) -> float:
        self.calibrator.record(feature, self.size, seconds * 1000.0)
        return seconds * 1000.0

    def charge_step(self, timed: list[tuple[str, float]], cpu_share: float) -> None:
        """Tell the calibrator the extractions of one step of the request loop, each
        ``(feature, seconds)`` of wall time, with its thread CPU time: its wall time times
        the step's ``cpu_share`` (so a busy machine is not taken for a slow extractor:
        ``service.calibration``). :meth:`charge` without the calibration record is what
        they were charged.

        A step of several extractions that lost the CPU for a noticeable part of its time
        (share below ``SHARED_STEP_MIN_SHARE``) cannot say which of them lost it: giving
        each the step's share would make the one that waited look slow. Only the machine's
        contention learns from it then."""
        if len(timed) > 1 and cpu_share < SHARED_STEP_MIN_SHARE:
            total = sum(s for _, s in timed) * 1000.0
            self.calibrator.record_contention(total, total * cpu_share)
            return
        self.calibrator.record_many(
            self.size, [(f, s * 1000.0, s * cpu_share * 1000.0) for f, s in timed]
        )


class DeclaredCost:
    """The declared cost of each feature acquired (``per_feature``, e.g. the manifest's
    curves at the item's size), in the manifest's own unit; time is not charged, except for
    the features in ``timed``: their acquisition's wall time in milliseconds (sensor
    acquirers with ``charge: measured``, in bundles whose unit is ms)."""

    def __init__(self, per_feature: Mapping[str, float], timed: Collection[str] = ()) -> None:
        self.per_feature = per_feature
        self.timed = frozenset(timed)
        self.total = 0.0

    def spent(self) -> float:
        return self.total

    def charge(self, feature: str, seconds: float) -> float:
        cost = seconds * 1000.0 if feature in self.timed else self.per_feature[feature]
        self.total += cost
        return cost


@dataclass
class SessionRun:
    """What :func:`run_session` produced: the answer, how it was reached and what was
    acquired. ``acquired``, ``charged`` and ``acquire_ms`` are in acquisition order:
    the vectors, the cost each was charged and the wall time each took (``acquire_ms`` also
    holds the time of a failed acquisition, which is not charged). ``unavailable``:
    the feature the session asked for that could not be had (``FeatureUnavailable``) and
    why; the session's fallback then answered, and that feature is the one to collect next.
    """

    answer: Answer
    session: Session
    features: dict[str, FloatVector]
    acquired: dict[str, FloatVector]
    charged: dict[str, float]
    acquire_ms: dict[str, float]
    stopped_early: bool
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def next_feature(self) -> str | None:
        """The feature to collect before asking again (None: nothing was missing)."""
        return next(iter(self.unavailable), None)


def _noop(name: str, seconds: float) -> None:
    return None


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _refuse(
    runtime: StrategyRuntime,
    feature: str,
    names: Collection[str],
    acquired: Mapping[str, FloatVector],
) -> NoReturn:
    """Raise the :class:`StrategyFault` for acquiring ``feature``: one the source does not
    know, or one in hand (the session contract)."""
    if feature not in names:
        raise StrategyFault(
            runtime.name,
            f"asked to acquire {feature!r}, which is not one of the features it can "
            f"acquire ({sorted(names)}); a session may only acquire the bundle's extractors",
        )
    how = "acquired earlier in this request" if feature in acquired else "given in hand"
    raise StrategyFault(
        runtime.name,
        f"asked to acquire {feature!r}, which it already has ({how}); a session must "
        "acquire each feature at most once and never one it was given",
    )


def run_session(
    runtime: StrategyRuntime,
    size: int,
    budget: float,
    in_hand: Mapping[str, FloatVector],
    source: FeatureSource,
    meter: CostMeter,
    *,
    reserve: float = 0.0,
    cap: float = math.inf,
    on_acquire: Callable[[str, float], None] = _noop,
) -> SessionRun:
    """Drive one session of ``runtime`` to its answer.

    Features are planned within ``budget - reserve`` (never below 0) less what ``meter``
    has already spent, and at most ``cap`` from the session's start (a share of what is
    left, counted from when planning begins: the time spent getting here is not taken from
    it); ``in_hand`` are free. Before every step, once ``meter.spent()``
    passes ``budget`` the session's fallback answers from the features in hand
    (``stopped_early``). Each acquisition goes through ``source``, is reported to
    ``on_acquire(feature, seconds)`` and charged to ``meter``. An ``Acquire``'s ``then``
    features follow its feature in the same step, each only while the budget is not spent
    and its cost fits (:class:`~service.strategies.base.Acquire`). An acquisition that raises
    ``FeatureUnavailable`` is charged nothing (its time still counts for a measured meter)
    and the session's fallback answers from the features in hand; the feature and the
    reason are in ``SessionRun.unavailable``.

    Raises :class:`StrategyFault` when the session breaks its contract: a step that is
    neither ``Acquire`` nor ``Answer``, a fallback that does not answer, an ``Acquire`` of a
    feature ``source`` does not know or of one already in hand, or no answer within one
    step per feature of ``source`` plus one.
    """
    features: dict[str, FloatVector] = dict(in_hand)
    acquired: dict[str, FloatVector] = {}
    charged: dict[str, float] = {}
    acquire_ms: dict[str, float] = {}
    plan_budget = max(budget - reserve, 0.0)
    spent = meter.spent()
    plan_budget = min(plan_budget, spent + max(cap, 0.0))
    session = runtime.begin(size, max(plan_budget - spent, 0.0), frozenset(features))
    names = source.names
    # Each step acquires a new feature of ``names`` or ends the loop (the checks below), so no
    # session, faulty or not, takes more steps than this; the bound states that termination
    # locally rather than leaving it to those checks.
    steps = len(names) + 1
    # the measured meter, whose spent time and calibration records the loop reads directly
    # (not a subclass, which may count otherwise)
    clock = meter if type(meter) is MeasuredCost else None
    for _ in range(steps):
        spent = meter.spent()
        obs = Observation(size=size, budget=plan_budget, spent=spent, features=features)
        if spent > budget:
            answer = session.fallback(obs)
            if not isinstance(answer, Answer):
                raise StrategyFault(
                    runtime.name,
                    f"fell back with {answer!r}; a fallback must return an Answer with a "
                    "model computable from the features in hand",
                )
            return SessionRun(
                answer, session, features, acquired, charged, acquire_ms, stopped_early=True
            )
        step: Step = session.step(obs)
        if isinstance(step, Answer):
            return SessionRun(
                step, session, features, acquired, charged, acquire_ms, stopped_early=False
            )
        if not isinstance(step, Acquire):
            raise StrategyFault(
                runtime.name, f"returned {step!r} as a step; required: an Acquire or an Answer"
            )
        # The step's feature, then those of ``then`` while they fit (Acquire). The thread's
        # CPU clock (a system call on some VMs, as dear as a small extractor) is read once
        # around the step: each extraction's CPU time is its wall time times the step's
        # CPU share (the measured meter's calibration records are made at the end).
        batch = step.then
        feature = step.feature
        timed: list[tuple[str, float]] = []
        # ``then``'s fit, as affordable(cost, plan_budget - spent - reserve, plan_budget)
        limit = plan_budget - step.reserve + TOLERANCE * max(1.0, abs(plan_budget))
        w0 = time.perf_counter()
        c0 = time.thread_time() if clock is not None else 0.0
        try:
            for i in range(len(batch) + 1):
                if i:
                    feature, cost = batch[i - 1]
                    # meter.spent(), without the calls when measured
                    spent = (
                        (time.perf_counter() - clock.start) * 1000.0
                        if clock is not None
                        else meter.spent()
                    )
                    if spent > budget or not cost <= limit - spent:  # NaN does not fit
                        break
                if feature in features or feature not in names:
                    _refuse(runtime, feature, names, acquired)
                t0 = time.perf_counter()
                try:
                    vector = source.acquire(feature)
                except FeatureUnavailable as exc:
                    # Its time is reported (timings), not charged: nothing was acquired.
                    acquire_ms[feature] = (time.perf_counter() - t0) * 1000.0
                    answer = session.fallback(
                        Observation(
                            size=size, budget=plan_budget, spent=meter.spent(), features=features
                        )
                    )
                    if not isinstance(answer, Answer):
                        raise StrategyFault(
                            runtime.name,
                            f"fell back with {answer!r}; a fallback must return an Answer "
                            "with a model computable from the features in hand",
                        ) from exc
                    return SessionRun(
                        answer,
                        session,
                        features,
                        acquired,
                        charged,
                        acquire_ms,
                        stopped_early=False,
                        unavailable={feature: exc.reason},
                    )
                elapsed = time.perf_counter() - t0
                on_acquire(feature, elapsed)
                if clock is not None:
                    timed.append((feature, elapsed))
                    charged[feature] = elapsed * 1000.0
                else:
                    charged[feature] = meter.charge(feature, elapsed)
                acquire_ms[feature] = elapsed * 1000.0
                features[feature] = vector
                acquired[feature] = vector
        finally:
            if clock is not None and timed:
                wall = time.perf_counter() - w0
                share = min((time.thread_time() - c0) / wall, 1.0) if wall > 0.0 else 1.0
                clock.charge_step(timed, share)
    raise StrategyFault(
        runtime.name,
        f"did not answer within {steps} steps (one per feature, plus the answer); a session "
        "must answer once it has nothing left to acquire",
    )


@dataclass
class Execution:
    answer: str
    probabilities: FloatVector
    planned: float
    stopped_early: bool
    extracted: dict[str, FloatVector]
    extraction_ms: dict[str, float]
    inference_ms: float
    spent: float
    path: list[list[str]] | None = None
    expected_accuracy: float | None = None
    report: dict[str, Any] | None = None
    charged: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    next_feature: str | None = None
    prediction: str | None = None

    def over_budget(self, budget: float) -> bool:
        return self.spent > budget


def execute(
    bundle: Bundle,
    item: DecodedItem,
    budget: float,
    in_hand: dict[str, FloatVector],
    start: float,
    *,
    reserve_ms: float = 0.0,
    cap_ms: float = math.inf,
    runtime: StrategyRuntime | None = None,
    on_extraction: Callable[[str, float], None] = _noop,
    on_inference: Callable[[str, float], None] = _noop,
) -> Execution:
    """Run one request's plan on ``bundle``'s extractors, then infer.

    ``start`` is the ``perf_counter()`` the budget counts from (work already done, such as
    the cache read, lies between it and now). Features are planned within what is left of
    ``budget - reserve_ms``, and at most ``cap_ms`` from when planning begins; once the
    measured time passes ``budget`` the session's fallback answers from the features in hand
    (``stopped_early``). ``runtime`` is the strategy
    (the bundle's default when None). Every extraction's time is recorded in the bundle's
    cost calibrator.

    With ``cost_basis == "declared"`` (e.g. tabular sensors with costs in their own unit) a
    request spends the declared cost of each feature it acquires (cached ones are free);
    there is no reserve and nothing to calibrate.
    """
    runtime = bundle.runtime if runtime is None else runtime
    meter: CostMeter
    if bundle.manifest.cost_basis == "measured":
        meter = MeasuredCost(start, bundle.calibrator, item.size)
    else:
        timed = [n for n, e in bundle.extractors.items() if getattr(e, "charge", "") == "measured"]
        meter = DeclaredCost(bundle.costs.profiled_at(item.size), timed)
        reserve_ms = 0.0
    run = run_session(
        runtime,
        item.size,
        budget,
        in_hand,
        ExtractorSource(bundle.extractors, item.data),
        meter,
        reserve=reserve_ms,
        cap=cap_ms,
        on_acquire=on_extraction,
    )
    t0 = time.perf_counter()
    decoded = run.session.decode(run.features)
    probabilities = runtime.predict(run.answer, run.features) if decoded is None else decoded
    inference_s = time.perf_counter() - t0
    if not np.all(np.isfinite(probabilities)):
        # e.g. a polynomial model fed values far outside its training range overflows
        raise InvalidItem(
            f"model {run.answer.model!r} gave non-finite probabilities for this item: the "
            f"values of {', '.join(sorted(run.features))} are outside the range the model can "
            "score; send values in the range of the data the bundle was trained on",
            model=run.answer.model,
            features=sorted(run.features),
        )
    spent = meter.spent()
    on_inference(bundle.name, inference_s)
    session = run.session
    return Execution(
        answer=run.answer.model,
        probabilities=probabilities,
        planned=session.planned,
        stopped_early=run.stopped_early,
        extracted=run.acquired,
        extraction_ms=run.acquire_ms,
        inference_ms=inference_s * 1000.0,
        spent=spent,
        path=session.path(),
        expected_accuracy=session.expected_accuracy,
        report=session.report(),
        charged=run.charged,
        unavailable=run.unavailable,
        next_feature=run.next_feature,
        prediction=session.prediction,
    )
