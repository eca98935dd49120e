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
# How a measured budget is counted (``PredictHandler``): from the request's receipt, or the
# work done for it only.
ACCOUNTINGS = ("deadline", "work")

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
    is reported as ``timings_ms.queued``.

    Accounting of a measured (ms) budget, per request (``accounting``; ``default_accounting``
    when the request names none):

    - ``"deadline"``: the budget counts from the request's receipt (``received``, a
      ``perf_counter()`` taken when the app first saw the request; now when not given), so
      reading the body, decoding, the cache read and the wait for a thread are charged, and
      features are planned with what is left when work starts. A request waits for a thread
      at most until what would be left could no longer pay for the cheapest feature it lacks,
      and does not wait at all when the expected wait is longer: it answers at once from what
      it has. Under load the service thus degrades accuracy, not latency.
    - ``"work"``: only the work is charged (the cache read, then the plan / extract / infer
      loop in the worker thread); the wait is reported, not charged.

    Either way a request whose budget cannot pay for any feature it lacks (or that has every
    feature in hand) is answered on the event loop, without the hand-off to a thread."""

    def __init__(
        self,
        registry: Registry,
        cache: FeatureCache,
        metrics: Metrics,
        reserve_ms: float,
        threads: int = 0,
        limits: Limits | None = None,
        default_accounting: str = "deadline",
    ) -> None:
        if default_accounting not in ACCOUNTINGS:
            raise ValueError(
                f"default_accounting must be one of {ACCOUNTINGS}, got {default_accounting!r}"
            )
        self.default_accounting = default_accounting
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
        accounting: str | None = None,
        tolerance: float | None = None,
        received: float | None = None,
    ) -> tuple[PredictResponse, dict[str, bytes]]:
        """Answer one request (on ``version`` of ``model``, its newest if None); also
        returns the features to write back to the cache. ``accounting``: ``"deadline"`` or
        ``"work"`` (class docstring; None: the default); ``received``: the
        ``perf_counter()`` at which the request arrived (None: now); ``tolerance``: the
        strategy's per-request tolerance (tabular adaptive strategies; None: the bundle's)."""
        received = time.perf_counter() if received is None else received
        if not (isinstance(budget, float | int) and math.isfinite(budget) and budget > 0):
            raise InvalidRequest(f"'budget' must be a finite number > 0, got {budget!r}")
        accounting = self.default_accounting if accounting is None else accounting
        if accounting not in ACCOUNTINGS:
            raise InvalidRequest(
                f"'accounting' must be one of {list(ACCOUNTINGS)}, got {accounting!r}"
            )
        bundle = self.registry.get(model, version)
        runtime = bundle.strategy(strategy)
        if tolerance is not None:
            if not (isinstance(tolerance, float | int) and 0 <= tolerance <= 1):
                raise InvalidRequest(f"'tolerance' must be a number in [0, 1], got {tolerance!r}")
            try:
                runtime = runtime.with_options(tolerance=float(tolerance))
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        measured = bundle.manifest.cost_basis == "measured"
        if measured and budget > self.limits.max_budget_ms:
            raise BudgetTooLarge(float(budget), self.limits.max_budget_ms)
        # Only a budget in milliseconds can count from the receipt.
        deadline = measured and accounting == "deadline"
        decode_start = time.perf_counter()
        if bundle.decoder.heavy(item):
            decoded = await self._in_thread(lambda: bundle.decoder.decode(item))
        else:
            decoded = bundle.decoder.decode(item)
        decode_s = time.perf_counter() - decode_start
        if size is not None and size != decoded.size:
            raise SizeMismatch(size, decoded.size)
        nbytes = int(getattr(decoded.data, "nbytes", 0))

        # ``spent`` counts from ``start``: the receipt (deadline), or the cache read (work:
        # the cache read, then the plan / extract / infer loop timed inside the worker thread
        # from the moment it starts).
        given = self._given(bundle, decoded)
        read_start = time.perf_counter()
        left_ms = budget - (read_start - received) * 1e3 if deadline else float(budget)
        with tracing.span("cache.read"):
            cached = await self._read_cache(bundle, decoded, left_ms, skip=given.keys())
        cache_s = time.perf_counter() - read_start
        in_hand = {**cached, **given}

        def work() -> tuple[float, Execution]:
            started = time.perf_counter()
            return started, execute(
                bundle,
                decoded,
                budget,
                in_hand,
                received if deadline else started - cache_s,
                reserve_ms=self.reserve_ms,
                runtime=runtime,
                on_extraction=self._observe_extraction,
                on_inference=self._observe_inference,
            )

        # What the cheapest feature not in hand would cost, and how long this request may
        # wait for a thread: with no feature it could pay for, it does not wait at all.
        queued_at = time.perf_counter()
        if measured:
            missing = [c for f, c in bundle.costs.at(decoded.size).items() if f not in in_hand]
            cheapest = min(missing, default=math.inf)
            left_ms = budget - self.reserve_ms
            if deadline:
                left_ms -= (queued_at - received) * 1e3
            wait_limit: float | None = (left_ms - cheapest) / 1e3 if deadline else budget / 1e3
            inline = left_ms < cheapest  # nothing to extract: no thread needed
        else:
            wait_limit, inline = None, False
        waited = None if inline else await self._acquire(wait_limit, nbytes)
        if waited is None:
            # Answer from what is in hand, on this loop: with a budget of 0 the strategy's
            # fallback answers from the features in hand (with every feature in hand the
            # strategy answers within the real budget: it has nothing left to acquire).
            run = execute(
                bundle,
                decoded,
                budget if inline and cheapest == math.inf else 0.0,
                in_hand,
                received if deadline else time.perf_counter() - cache_s,
                runtime=runtime,
                on_inference=self._observe_inference,
            )
            queued_s = time.perf_counter() - queued_at if not inline else 0.0
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
        response.cost.accounting = "deadline" if deadline else "work"
        response.timings_ms.decode = decode_s * 1000.0
        response.timings_ms.since_received = (time.perf_counter() - received) * 1000.0
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
        self.metrics.child(self.metrics.cache, result="hit").inc(hits)
        self.metrics.child(self.metrics.cache, result="miss").inc(len(names) - hits)
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
        self.metrics.child(self.metrics.extraction, extractor=name).observe(seconds)
        tracing.extraction(name, seconds)

    def _observe_inference(self, bundle: str, seconds: float) -> None:
        self.metrics.child(self.metrics.inference, model=bundle).observe(seconds)
        tracing.record("inference", seconds, model=bundle)

    def _observe(self, response: PredictResponse) -> None:
        m = self.metrics
        m.child(m.spent, model=response.model).observe(response.cost.spent)
        m.child(m.budget, model=response.model).observe(response.cost.budget)
        utilisation = response.cost.spent / response.cost.budget
        m.child(m.utilisation, model=response.model).observe(utilisation)
        if response.deadline_exceeded:
            m.child(m.budget_exceeded, model=response.model).inc()
        for sensor in response.unavailable:
            m.sensor_unavailable.labels(model=response.model, sensor=sensor).inc()
