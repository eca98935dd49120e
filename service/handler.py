"""The predict handler: plan, extract lazily, infer, account. Knows nothing of HTTP."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import numpy as np

from service.cache import CacheUnavailable, FeatureCache, feature_key
from service.errors import InvalidRequest, SizeMismatch
from service.execution import Execution, execute
from service.items import DecodedItem
from service.metrics import Metrics
from service.registry import Bundle, Registry
from service.strategies.base import FloatVector

log = logging.getLogger("budgetserve.handler")


@dataclass
class Outcome:
    """Everything a prediction reports; the API turns it into the response body."""

    model: str
    prediction: str
    probabilities: dict[str, float]
    features: list[str]
    expected_accuracy: float
    strategy: str
    model_version: str
    answered_by: str
    deadline_exceeded: bool
    unit: str
    budget: float
    planned: float
    spent: float
    extraction: float
    inference: float
    cached: list[str]
    extracted: list[str]
    extraction_by_feature: dict[str, float] = field(default_factory=dict)


def _ms(seconds: float) -> float:
    return seconds * 1000.0


class PredictHandler:
    def __init__(
        self, registry: Registry, cache: FeatureCache, metrics: Metrics, reserve_ms: float
    ) -> None:
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        self.reserve_ms = reserve_ms

    async def predict(
        self, model: str, item: Any, size: int | None, budget: float
    ) -> tuple[Outcome, dict[str, bytes]]:
        """Answer one request; also returns the features to write back to the cache."""
        if not (isinstance(budget, float | int) and math.isfinite(budget) and budget > 0):
            raise InvalidRequest(f"'budget' must be a finite number > 0, got {budget!r}")
        bundle = self.registry.get(model)
        decoded = bundle.decoder.decode(item)
        if size is not None and size != decoded.size:
            raise SizeMismatch(size, decoded.size)

        # Budget accounting counts work, not waiting: the cache read, then the plan /
        # extract / infer loop timed inside the worker thread from the moment it starts
        # (the thread hand-off latency shows in request latency, not in ``spent``).
        read_start = time.perf_counter()
        in_hand = await self._read_cache(bundle, decoded)
        cache_s = time.perf_counter() - read_start
        cached_names = sorted(in_hand)

        def work() -> Execution:
            return execute(
                bundle, decoded, budget, in_hand, time.perf_counter() - cache_s,
                reserve_ms=self.reserve_ms,
                on_extraction=self._observe_extraction,
                on_inference=self._observe_inference,
            )

        run = await anyio.to_thread.run_sync(work)
        spent = run.spent_ms

        manifest = bundle.manifest
        labels = manifest.classes
        probs = run.probabilities
        top = int(np.argmax(probs))
        answer_spec = manifest.model(run.answer)
        extraction = sum(run.extraction_ms.values())
        outcome = Outcome(
            model=manifest.name,
            prediction=labels[top],
            probabilities={c: float(p) for c, p in zip(labels, probs.tolist(), strict=True)},
            features=list(answer_spec.features),
            expected_accuracy=answer_spec.accuracy,
            strategy=manifest.strategy.kind,
            model_version=manifest.version,
            answered_by=run.answer,
            deadline_exceeded=run.deadline_exceeded,
            unit=manifest.cost_unit,
            budget=float(budget),
            planned=run.planned,
            spent=spent,
            extraction=extraction,
            inference=run.inference_ms,
            cached=cached_names,
            extracted=list(run.extracted),
            extraction_by_feature=run.extraction_ms,
        )
        self._observe(outcome)
        writes = {
            feature_key(decoded.key, name, bundle.extractors[name].version): vec.tobytes()
            for name, vec in run.extracted.items()
        }
        return outcome, writes

    async def write_back(self, writes: Mapping[str, bytes]) -> None:
        """Store freshly computed features; a failing cache is counted, never raised."""
        if not writes:
            return
        try:
            await self.cache.put_many(writes)
        except CacheUnavailable as exc:
            self.metrics.cache.labels(result="write_error").inc()
            log.warning("feature cache write failed: %s", exc)

    async def _read_cache(self, bundle: Bundle, item: DecodedItem) -> dict[str, FloatVector]:
        names = list(bundle.extractors)
        keys = [feature_key(item.key, n, bundle.extractors[n].version) for n in names]
        try:
            values = await self.cache.get_many(keys)
        except CacheUnavailable as exc:
            self.metrics.cache.labels(result="error").inc()
            log.warning("feature cache read failed, going on uncached: %s", exc)
            return {}
        found: dict[str, FloatVector] = {}
        for name, raw in zip(names, values, strict=True):
            dims = bundle.extractors[name].dims
            if raw is not None and len(raw) == 4 * dims:
                found[name] = np.frombuffer(raw, dtype=np.float32)
        hits = len(found)
        self.metrics.cache.labels(result="hit").inc(hits)
        self.metrics.cache.labels(result="miss").inc(len(names) - hits)
        return found

    def _observe_extraction(self, name: str, seconds: float) -> None:
        self.metrics.extraction.labels(extractor=name).observe(seconds)

    def _observe_inference(self, bundle: str, seconds: float) -> None:
        self.metrics.inference.labels(model=bundle).observe(seconds)

    def _observe(self, outcome: Outcome) -> None:
        m = self.metrics
        m.spent.labels(model=outcome.model).observe(outcome.spent)
        m.utilisation.labels(model=outcome.model).observe(outcome.spent / outcome.budget)
        if outcome.deadline_exceeded:
            m.budget_exceeded.labels(model=outcome.model).inc()
