"""The plan → extract → infer loop of one request, shared by the HTTP handler and by
offline evaluation (``budgetserve-train evaluate``), so both measure the same thing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import ExtractionFailed
from service.items import DecodedItem
from service.registry import Bundle
from service.strategies.base import Acquire, Answer, Observation, Step, StrategyRuntime
from service.types import FloatVector


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

    def over_budget(self, budget: float) -> bool:
        return self.spent > budget


def _noop(name: str, seconds: float) -> None:
    return None


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def execute(
    bundle: Bundle,
    item: DecodedItem,
    budget: float,
    in_hand: dict[str, FloatVector],
    start: float,
    *,
    reserve_ms: float = 0.0,
    runtime: StrategyRuntime | None = None,
    on_extraction: Callable[[str, float], None] = _noop,
    on_inference: Callable[[str, float], None] = _noop,
) -> Execution:
    """Run one request's plan.

    ``start`` is the ``perf_counter()`` the budget counts from (work already done, such as
    the cache read, lies between it and now). Features are planned within what is left of
    ``budget - reserve_ms``; once the measured time passes ``budget`` the session's fallback
    answers from the features in hand (``stopped_early``). ``runtime`` is the strategy
    (the bundle's default when None). Every extraction's time is recorded in the bundle's
    cost calibrator.

    With ``cost_basis == "declared"`` (e.g. tabular sensors with costs in their own unit) a
    request spends the declared cost of each feature it acquires (cached ones are free);
    there is no reserve and nothing to calibrate.
    """
    features: dict[str, FloatVector] = dict(in_hand)
    extracted: dict[str, FloatVector] = {}
    extraction_ms: dict[str, float] = {}
    measured = bundle.manifest.cost_basis == "measured"
    declared = 0.0
    per_feature = bundle.costs.profiled_at(item.size) if not measured else {}
    plan_budget = max(budget - reserve_ms, 0.0) if measured else budget

    def spent_now() -> float:
        return _ms_since(start) if measured else declared

    runtime = bundle.runtime if runtime is None else runtime
    session = runtime.begin(item.size, max(plan_budget - spent_now(), 0.0), frozenset(features))
    stopped_early = False
    step: Step
    while True:
        spent = spent_now()
        obs = Observation(size=item.size, budget=plan_budget, spent=spent, features=features)
        if spent > budget:
            stopped_early = True
            step = session.fallback(obs)
            break
        step = session.step(obs)
        if not isinstance(step, Acquire):
            break
        extractor = bundle.extractors[step.feature]
        t0 = time.perf_counter()
        try:
            vector = np.ascontiguousarray(extractor.extract(item.data), dtype=np.float32)
        except (ValueError, TypeError, ArithmeticError, IndexError) as exc:
            raise ExtractionFailed(step.feature, str(exc)) from exc
        elapsed = time.perf_counter() - t0
        if vector.shape != (extractor.dims,) or not np.all(np.isfinite(vector)):
            raise ExtractionFailed(
                step.feature,
                f"returned shape {vector.shape} or non-finite values; expected "
                f"({extractor.dims},) finite float32",
            )
        on_extraction(step.feature, elapsed)
        if measured:
            bundle.calibrator.record(step.feature, item.size, elapsed * 1000.0)
        else:
            declared += per_feature[step.feature]
        extraction_ms[step.feature] = elapsed * 1000.0
        features[step.feature] = vector
        extracted[step.feature] = vector
    assert isinstance(step, Answer)
    t0 = time.perf_counter()
    probabilities = runtime.predict(step, features)
    finished = time.perf_counter()
    on_inference(bundle.name, finished - t0)
    return Execution(
        answer=step.model,
        probabilities=probabilities,
        planned=session.planned,
        stopped_early=stopped_early,
        extracted=extracted,
        extraction_ms=extraction_ms,
        inference_ms=(finished - t0) * 1000.0,
        spent=(finished - start) * 1000.0 if measured else declared,
        path=session.path(),
        expected_accuracy=session.expected_accuracy,
        report=session.report(),
    )
