"""The predict handler: plan, extract lazily, infer, account. Knows nothing of HTTP."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from service.cache import CacheBypassed, CacheUnavailable, FeatureCache, feature_key
from service.errors import InvalidRequest, SizeMismatch
from service.execution import Execution, execute
from service.items import DecodedItem
from service.metrics import Metrics
from service.registry import Bundle, Registry
from service.schemas import CostReport, PredictResponse
from service.types import FloatVector

log = logging.getLogger("budgetserve.handler")

# A Redis read may use at most this share of the request's budget.
CACHE_READ_SHARE = 0.2


class PredictHandler:
    """Answers predictions. CPU-bound work (decoding large items, extraction, inference)
    runs in worker threads, at most ``threads`` requests at once; a request's wait for a
    thread is reported as ``cost.queued`` and not charged to its budget."""

    def __init__(
        self,
        registry: Registry,
        cache: FeatureCache,
        metrics: Metrics,
        reserve_ms: float,
        threads: int = 0,
    ) -> None:
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        self.reserve_ms = reserve_ms
        self.limiter = anyio.CapacityLimiter(threads or os.cpu_count() or 1)

    async def predict(
        self,
        model: str,
        item: Any,
        size: int | None,
        budget: float,
        strategy: str | None = None,
    ) -> tuple[PredictResponse, dict[str, bytes]]:
        """Answer one request; also returns the features to write back to the cache."""
        if not (isinstance(budget, float | int) and math.isfinite(budget) and budget > 0):
            raise InvalidRequest(f"'budget' must be a finite number > 0, got {budget!r}")
        bundle = self.registry.get(model)
        runtime = bundle.strategy(strategy)
        if bundle.decoder.heavy(item):
            decoded = await anyio.to_thread.run_sync(
                bundle.decoder.decode, item, limiter=self.limiter
            )
        else:
            decoded = bundle.decoder.decode(item)
        if size is not None and size != decoded.size:
            raise SizeMismatch(size, decoded.size)

        # ``spent`` counts work, not waiting: the cache read, then the plan / extract /
        # infer loop timed inside the worker thread from the moment it starts.
        read_start = time.perf_counter()
        in_hand = await self._read_cache(bundle, decoded, budget)
        cache_s = time.perf_counter() - read_start

        def work() -> tuple[float, Execution]:
            started = time.perf_counter()
            return started, execute(
                bundle,
                decoded,
                budget,
                in_hand,
                started - cache_s,
                reserve_ms=self.reserve_ms,
                runtime=runtime,
                on_extraction=self._observe_extraction,
                on_inference=self._observe_inference,
            )

        queued_at = time.perf_counter()
        started, run = await anyio.to_thread.run_sync(work, limiter=self.limiter)
        response = self._response(
            bundle, runtime.name, budget, run, sorted(in_hand), started - queued_at
        )
        self._observe(response)
        writes = {
            feature_key(decoded.key, bundle.tags[name]): vec.tobytes()
            for name, vec in run.extracted.items()
        }
        return response, writes

    async def write_back(self, writes: Mapping[str, bytes]) -> None:
        """Store freshly computed features; a failing cache is counted, never raised."""
        if not writes:
            return
        try:
            await self.cache.put_many(writes)
        except CacheBypassed:
            self.metrics.cache.labels(result="bypass").inc()
        except CacheUnavailable as exc:
            self.metrics.cache.labels(result="write_error").inc()
            log.warning("feature cache write failed: %s", exc)

    async def _read_cache(
        self, bundle: Bundle, item: DecodedItem, budget: float
    ) -> dict[str, FloatVector]:
        names = list(bundle.extractors)
        keys = [feature_key(item.key, bundle.tags[n]) for n in names]
        # A read may take a share of a budget in milliseconds; budgets in other units get the
        # cache's own timeout.
        timeout = (
            CACHE_READ_SHARE * budget / 1e3
            if bundle.manifest.cost_basis == "measured"
            else None
        )
        try:
            values = await self.cache.get_many(keys, timeout_s=timeout)
        except CacheBypassed:
            self.metrics.cache.labels(result="bypass").inc()
            return {}
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

    @staticmethod
    def _response(
        bundle: Bundle,
        strategy: str,
        budget: float,
        run: Execution,
        cached: list[str],
        queued_s: float,
    ) -> PredictResponse:
        manifest = bundle.manifest
        labels = manifest.classes
        probs = run.probabilities
        answer = manifest.model(run.answer)
        return PredictResponse(
            model=manifest.name,
            prediction=labels[int(np.argmax(probs))],
            probabilities={c: float(p) for c, p in zip(labels, probs.tolist(), strict=True)},
            features=list(answer.features),
            expected_accuracy=(
                answer.accuracy if run.expected_accuracy is None else run.expected_accuracy
            ),
            strategy=strategy,
            model_version=manifest.version,
            answered_by=run.answer,
            path=run.path,
            decision=run.report,
            deadline_exceeded=run.over_budget(budget),
            cost=CostReport(
                unit=manifest.cost_unit,
                budget=float(budget),
                planned=run.planned,
                spent=run.spent,
                extraction=sum(run.extraction_ms.values()),
                inference=run.inference_ms,
                queued=queued_s * 1000.0,
                cached=cached,
                extracted=list(run.extracted),
            ),
        )

    def _observe_extraction(self, name: str, seconds: float) -> None:
        self.metrics.extraction.labels(extractor=name).observe(seconds)

    def _observe_inference(self, bundle: str, seconds: float) -> None:
        self.metrics.inference.labels(model=bundle).observe(seconds)

    def _observe(self, response: PredictResponse) -> None:
        m = self.metrics
        m.spent.labels(model=response.model).observe(response.cost.spent)
        m.budget.labels(model=response.model).observe(response.cost.budget)
        utilisation = response.cost.spent / response.cost.budget
        m.utilisation.labels(model=response.model).observe(utilisation)
        if response.deadline_exceeded:
            m.budget_exceeded.labels(model=response.model).inc()
