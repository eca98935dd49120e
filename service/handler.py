"""The predict handler: plan, extract lazily, infer, account. Knows nothing of HTTP."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np

from service import tracing
from service.cache import (
    CacheBypassed,
    CacheDeadline,
    CacheUnavailable,
    FeatureCache,
    feature_key,
)
from service.errors import BudgetTooLarge, InvalidRequest, Overloaded, SizeMismatch
from service.execution import Execution, execute
from service.extractors.sensor import given_vector
from service.items import DecodedItem
from service.metrics import Metrics
from service.registry import Bundle, Registry
from service.schemas import CostReport, PredictResponse, Timings
from service.types import FloatVector

log = logging.getLogger("budgetserve.handler")

# A Redis read may use at most this share of the request's budget.
CACHE_READ_SHARE = 0.2
# Retry-After of a 503 for a full queue: the queue turns over within about a budget.
RETRY_AFTER_S = 1
# Weight of the latest wait in the running estimate of the wait for a thread.
WAIT_EWMA = 0.2

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """Admission limits of one process (see ``service.settings``)."""

    max_budget_ms: float = float("inf")
    max_queued: int = 1 << 30
    max_queued_bytes: int = 1 << 62


class PredictHandler:
    """Answers predictions. CPU-bound work (decoding large items, extraction, inference)
    runs in worker threads, at most ``threads`` requests at once.

    Admission, when every thread is busy: at most ``limits.max_queued`` requests wait, and
    the decoded items of the requests admitted (waiting or working) hold at most
    ``limits.max_queued_bytes``; beyond that a request is refused with :class:`Overloaded`
    (503). A request with measured (ms) costs waits at most its budget, and not at all when
    the expected wait is longer than its budget: it then answers at once from what it has
    (cached features, or the prior), so small requests never wait behind big ones. The wait
    is reported as ``timings_ms.queued`` and not charged to the budget."""

    def __init__(
        self,
        registry: Registry,
        cache: FeatureCache,
        metrics: Metrics,
        reserve_ms: float,
        threads: int = 0,
        limits: Limits | None = None,
    ) -> None:
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        self.reserve_ms = reserve_ms
        self.limits = limits or Limits()
        self.limiter = anyio.CapacityLimiter(threads or os.cpu_count() or 1)
        self.waiting: dict[object, float] = {}  # waiting requests → when they began, in order
        self.held_bytes = 0
        self.wait_estimate_s = 0.0

    def expected_wait_s(self) -> float:
        """How long a request arriving now should expect to wait for a thread."""
        if self.limiter.available_tokens >= 1 and not self.waiting:
            return 0.0
        oldest = next(iter(self.waiting.values()), None)
        age = 0.0 if oldest is None else time.perf_counter() - oldest
        return max(age, self.wait_estimate_s)

    def _refuse(self, reason: str, **details: Any) -> Overloaded:
        self.metrics.admission.labels(result=reason).inc()
        return Overloaded(reason.replace("_", " "), RETRY_AFTER_S, **details)

    async def _acquire(self, wait_limit_s: float | None, nbytes: int) -> float | None:
        """Take a thread token for this task and hold ``nbytes`` in ``held_bytes`` (the caller
        releases both): the seconds waited, or None — nothing taken — when the request should
        not wait (its ``wait_limit_s`` is below the expected wait, or ran out)."""
        if self.limiter.available_tokens >= 1 and not self.waiting:
            await self.limiter.acquire()
            self.held_bytes += nbytes
            self.wait_estimate_s *= 1.0 - WAIT_EWMA
            return 0.0
        if wait_limit_s is not None and wait_limit_s < self.expected_wait_s():
            self.metrics.admission.labels(result="answered_unqueued").inc()
            return None
        if len(self.waiting) >= self.limits.max_queued:
            raise self._refuse("queue_full", max_queued=self.limits.max_queued)
        if self.held_bytes > 0 and self.held_bytes + nbytes > self.limits.max_queued_bytes:
            raise self._refuse("queue_bytes", max_queued_bytes=self.limits.max_queued_bytes)
        token = object()
        started = time.perf_counter()
        self.waiting[token] = started
        self.held_bytes += nbytes
        acquired = False
        try:
            with anyio.move_on_after(wait_limit_s if wait_limit_s is not None else math.inf):
                await self.limiter.acquire()
                acquired = True
        finally:
            del self.waiting[token]
            if not acquired:
                self.held_bytes -= nbytes
        waited = time.perf_counter() - started
        self.wait_estimate_s += WAIT_EWMA * (waited - self.wait_estimate_s)
        if not acquired:
            self.metrics.admission.labels(result="wait_expired").inc()
            return None
        return waited

    async def _in_thread(self, func: Callable[[], T]) -> T:
        """Run ``func`` on an extraction thread, waiting without a time limit (count-bounded)."""
        if await self._acquire(None, 0) is None:  # pragma: no cover - no limit, always granted
            raise RuntimeError("no thread granted")
        try:
            return await anyio.to_thread.run_sync(func)
        finally:
            self.limiter.release()

    async def predict(
        self,
        model: str,
        item: Any,
        size: int | None,
        budget: float,
        strategy: str | None = None,
        *,
        version: str | None = None,
    ) -> tuple[PredictResponse, dict[str, bytes]]:
        """Answer one request (on ``version`` of ``model``, its newest if None); also
        returns the features to write back to the cache."""
        if not (isinstance(budget, float | int) and math.isfinite(budget) and budget > 0):
            raise InvalidRequest(f"'budget' must be a finite number > 0, got {budget!r}")
        bundle = self.registry.get(model, version)
        runtime = bundle.strategy(strategy)
        measured = bundle.manifest.cost_basis == "measured"
        if measured and budget > self.limits.max_budget_ms:
            raise BudgetTooLarge(float(budget), self.limits.max_budget_ms)
        if bundle.decoder.heavy(item):
            decoded = await self._in_thread(lambda: bundle.decoder.decode(item))
        else:
            decoded = bundle.decoder.decode(item)
        if size is not None and size != decoded.size:
            raise SizeMismatch(size, decoded.size)
        nbytes = int(getattr(decoded.data, "nbytes", 0))

        # ``spent`` counts work, not waiting: the cache read, then the plan / extract /
        # infer loop timed inside the worker thread from the moment it starts.
        given = self._given(bundle, decoded)
        read_start = time.perf_counter()
        with tracing.span("cache.read"):
            cached = await self._read_cache(bundle, decoded, budget, skip=given.keys())
        cache_s = time.perf_counter() - read_start
        in_hand = {**cached, **given}

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

        # Measured budgets wait for a thread at most the budget itself (and not at all when
        # the queue ahead is longer); they then answer from what they have, on this loop:
        # with a budget of 0 the strategy's fallback answers from the features in hand.
        queued_at = time.perf_counter()
        waited = await self._acquire(budget / 1e3 if measured else None, nbytes)
        if waited is None:
            run = execute(
                bundle,
                decoded,
                0.0,
                in_hand,
                time.perf_counter() - cache_s,
                runtime=runtime,
                on_inference=self._observe_inference,
            )
            queued_s = time.perf_counter() - queued_at
        else:
            try:
                started, run = await anyio.to_thread.run_sync(work)
            finally:
                self.held_bytes -= nbytes
                self.limiter.release()
            queued_s = started - queued_at
        response = self._response(
            bundle, runtime.name, budget, run, sorted(cached), sorted(given), queued_s
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
        except CacheUnavailable as exc:  # counted by the cache as it failed
            log.warning("feature cache write failed: %s", exc)

    @staticmethod
    def _given(bundle: Bundle, item: DecodedItem) -> dict[str, FloatVector]:
        """The sensors whose values the request sent (tabular items): in hand, free."""
        if bundle.manifest.item.kind != "tabular":
            return {}
        given: dict[str, FloatVector] = {}
        for name, extractor in bundle.extractors.items():
            columns = getattr(extractor, "columns", None)
            if columns:
                vector = given_vector(columns, item.data)
                if vector is not None:
                    given[name] = vector
        return given

    async def _read_cache(
        self, bundle: Bundle, item: DecodedItem, budget: float, skip: Collection[str] = ()
    ) -> dict[str, FloatVector]:
        names = [n for n in bundle.extractors if n not in skip]
        if not names:
            return {}
        keys = [feature_key(item.key, bundle.tags[n]) for n in names]
        # A read may take a share of a budget in milliseconds; budgets in other units get the
        # cache's own timeout.
        timeout = (
            CACHE_READ_SHARE * budget / 1e3 if bundle.manifest.cost_basis == "measured" else None
        )
        try:
            values = await self.cache.get_many(keys, timeout_s=timeout)
        except CacheBypassed:
            self.metrics.cache.labels(result="bypass").inc()
            return {}
        except CacheDeadline as exc:
            # The request's own share of its budget ran out: not a cache failure.
            self.metrics.cache.labels(result="skipped" if exc.skipped else "deadline").inc()
            return {}
        except CacheUnavailable as exc:  # counted by the cache as it failed
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
        given: list[str],
        queued_s: float,
    ) -> PredictResponse:
        manifest = bundle.manifest
        labels = manifest.classes
        probs = run.probabilities
        if manifest.task == "parsing":
            # A tree, not a class: the heads (CoNLL-U HEAD column) as the prediction; each
            # token's head, score and template are in ``decision``.
            prediction = " ".join(str(int(h)) for h in probs.tolist())
            probabilities: dict[str, float] = {}
            features = sorted(run.extracted)
            accuracy = run.expected_accuracy or 0.0
        else:
            answer = manifest.model(run.answer)
            prediction = labels[int(np.argmax(probs))] if run.prediction is None else run.prediction
            probabilities = {c: float(p) for c, p in zip(labels, probs.tolist(), strict=True)}
            features = list(answer.features)
            accuracy = answer.accuracy if run.expected_accuracy is None else run.expected_accuracy
        return PredictResponse(
            model=manifest.name,
            prediction=prediction,
            probabilities=probabilities,
            features=features,
            expected_accuracy=accuracy,
            strategy=strategy,
            model_version=manifest.version,
            answered_by=run.answer,
            path=run.path,
            decision=run.report,
            deadline_exceeded=run.over_budget(budget),
            next_sensor=run.next_feature,
            unavailable=run.unavailable,
            cost=CostReport(
                unit=manifest.cost_unit,
                budget=float(budget),
                planned=run.planned,
                spent=run.spent,
                charged=run.charged,
                cached=cached,
                given=given,
                extracted=list(run.extracted),
            ),
            timings_ms=Timings(
                extraction=sum(run.extraction_ms.values()),
                inference=run.inference_ms,
                queued=queued_s * 1000.0,
            ),
        )

    def _observe_extraction(self, name: str, seconds: float) -> None:
        self.metrics.extraction.labels(extractor=name).observe(seconds)
        tracing.extraction(name, seconds)

    def _observe_inference(self, bundle: str, seconds: float) -> None:
        self.metrics.inference.labels(model=bundle).observe(seconds)
        tracing.record("inference", seconds, model=bundle)

    def _observe(self, response: PredictResponse) -> None:
        m = self.metrics
        m.spent.labels(model=response.model).observe(response.cost.spent)
        m.budget.labels(model=response.model).observe(response.cost.budget)
        utilisation = response.cost.spent / response.cost.budget
        m.utilisation.labels(model=response.model).observe(utilisation)
        if response.deadline_exceeded:
            m.budget_exceeded.labels(model=response.model).inc()
        for sensor in response.unavailable:
            m.sensor_unavailable.labels(model=response.model, sensor=sensor).inc()
