"""The plan → extract → infer loop of one request, shared by the HTTP handler and by
offline evaluation (``budgetserve-train evaluate``), so both measure the same thing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.items import DecodedItem
from service.registry import Bundle
from service.strategies.base import Acquire, Answer, FloatVector, Observation, Step


class ExtractorFailed(RuntimeError):
    """An extractor returned something other than its declared finite float32 vector."""


@dataclass
class Execution:
    answer: str
    probabilities: FloatVector
    planned: float
    deadline_exceeded: bool
    extracted: dict[str, FloatVector]
    extraction_ms: dict[str, float]
    inference_ms: float
    spent_ms: float


def _noop(name: str, seconds: float) -> None:
    return None


def execute(
    bundle: Bundle,
    item: DecodedItem,
    budget: float,
    in_hand: dict[str, FloatVector],
    start: float,
    *,
    reserve_ms: float = 0.0,
    on_extraction: Callable[[str, float], None] = _noop,
    on_inference: Callable[[str, float], None] = _noop,
) -> Execution:
    """Run one request's plan. ``start`` is the ``perf_counter()`` the budget counts from;
    features are planned within ``budget - reserve_ms``; once the measured time passes
    ``budget`` the session's fallback answers (``deadline_exceeded``)."""
    features: dict[str, FloatVector] = dict(in_hand)
    extracted: dict[str, FloatVector] = {}
    extraction_ms: dict[str, float] = {}
    plan_budget = max(budget - reserve_ms, 0.0)
    session = bundle.runtime.begin(item.size, plan_budget, frozenset(features))
    deadline_exceeded = False
    step: Step
    while True:
        spent = (time.perf_counter() - start) * 1000.0
        obs = Observation(size=item.size, budget=plan_budget, spent=spent, features=features)
        if spent > budget:
            deadline_exceeded = True
            step = session.fallback(obs)
            break
        step = session.step(obs)
        if not isinstance(step, Acquire):
            break
        extractor = bundle.extractors[step.feature]
        t0 = time.perf_counter()
        vector = np.ascontiguousarray(extractor.extract(item.data), dtype=np.float32)
        elapsed = time.perf_counter() - t0
        if vector.shape != (extractor.dims,) or not np.all(np.isfinite(vector)):
            raise ExtractorFailed(
                f"extractor {step.feature!r} returned shape {vector.shape} (or non-finite "
                f"values); expected ({extractor.dims},) finite float32"
            )
        on_extraction(step.feature, elapsed)
        extraction_ms[step.feature] = elapsed * 1000.0
        features[step.feature] = vector
        extracted[step.feature] = vector
    assert isinstance(step, Answer)
    t0 = time.perf_counter()
    probabilities = bundle.models[step.model].predict_proba(features)
    finished = time.perf_counter()
    inference = finished - t0
    on_inference(bundle.name, inference)
    return Execution(
        answer=step.model,
        probabilities=probabilities,
        planned=session.planned,
        deadline_exceeded=deadline_exceeded,
        extracted=extracted,
        extraction_ms=extraction_ms,
        inference_ms=inference * 1000.0,
        spent_ms=(finished - start) * 1000.0,
    )
