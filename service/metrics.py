"""Prometheus metrics (``budgetserve_*``). One registry per app; label sets stay small:
bundle names and extractor names come from loaded bundles only, never from raw requests."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

_LATENCY_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_COST = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
_COST_S = tuple(c / 1000.0 for c in _COST)  # the same bounds for ms costs, in seconds
#: The cost unit of bundles whose costs are measured (wall time).
MEASURED_UNIT = "ms"
_UTILISATION = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, 5.0)

UNKNOWN_MODEL = "_unknown"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[Any, ...], Any] = {}
        r = self.registry
        # process_* (CPU, memory, file descriptors) and python_* (GC, version) of this
        # process; not in the multiprocess exposition (see exposition()).
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.request_latency = Histogram(
            "budgetserve_request_duration_seconds",
            "Wall time of POST /predict, from request to response",
            ["model"],
            buckets=_LATENCY_S,
            registry=r,
        )
        self.requests = Counter(
            "budgetserve_requests_total",
            "Predict requests by outcome",
            ["model", "status"],
            registry=r,
        )
        self.extraction = Histogram(
            "budgetserve_extraction_seconds",
            "Time of one feature extraction",
            ["extractor"],
            buckets=_LATENCY_S,
            registry=r,
        )
        self.inference = Histogram(
            "budgetserve_inference_seconds",
            "Time of one model inference",
            ["model"],
            buckets=_LATENCY_S,
            registry=r,
        )
        # What a request was granted and spent, apart by unit (Prometheus' base units): a
        # bundle whose costs are measured (cost unit ms) in seconds; one whose costs are
        # declared in its own unit (units, dollars, ...) in that unit, named by ``unit``.
        self.spent_seconds = Histogram(
            "budgetserve_request_spent_seconds",
            "Cost spent per answered request of a bundle with measured costs (cost.unit ms), "
            "in seconds",
            ["model"],
            buckets=_COST_S,
            registry=r,
        )
        self.budget_seconds = Histogram(
            "budgetserve_request_budget_seconds",
            "Budget granted per answered request of a bundle with measured costs (cost.unit "
            "ms), in seconds",
            ["model"],
            buckets=_COST_S,
            registry=r,
        )
        self.spent_units = Histogram(
            "budgetserve_request_spent_units",
            "Cost spent per answered request of a bundle with declared costs, in its declared "
            "unit (the unit label)",
            ["model", "unit"],
            buckets=_COST,
            registry=r,
        )
        self.budget_units = Histogram(
            "budgetserve_request_budget_units",
            "Budget granted per answered request of a bundle with declared costs, in its "
            "declared unit (the unit label)",
            ["model", "unit"],
            buckets=_COST,
            registry=r,
        )
        self.utilisation = Histogram(
            "budgetserve_budget_utilisation_ratio",
            "Spent cost / budget per answered request (above 1: it overran)",
            ["model"],
            buckets=_UTILISATION,
            registry=r,
        )
        self.cache = Counter(
            "budgetserve_cache_requests_total",
            "Feature cache lookups and writes by result",
            ["result"],
            registry=r,
        )
        self.circuit_trips = Counter(
            "budgetserve_cache_circuit_trips_total",
            "Times the Redis circuit breaker opened (consecutive Redis failures)",
            registry=r,
        )
        self.admission = Counter(
            "budgetserve_admission_total",
            "Requests that found every extraction thread busy and were not simply queued: "
            "refused (queue_full, queue_bytes) or answered at once from what they had "
            "(answered_unqueued, wait_expired), or refused because the event loop reached them "
            "too late (queue_delay), with too many predictions in flight (in_flight) or with a "
            "deadline that could no longer be met (deadline), or run on the event loop with a "
            "plan cut to the inline size because the process is behind (inline_behind)",
            ["result"],
            registry=r,
        )
        self.budget_exceeded = Counter(
            "budgetserve_budget_exceeded_total",
            "Requests whose extraction ran past the budget (deadline_exceeded)",
            ["model"],
            registry=r,
        )
        self.sensor_unavailable = Counter(
            "budgetserve_sensor_unavailable_total",
            "Answers given from the features in hand because a sensor could not be acquired "
            "(not sent, no acquirer, store down, no entry for the id); the response names it "
            "in next_sensor",
            ["model", "sensor"],
            registry=r,
        )
        self.models_loaded = Gauge(
            "budgetserve_models_loaded",
            "Bundles loaded and ready",
            registry=r,
            multiprocess_mode="max",
        )
        for result in ("hit", "miss", "error", "write_error", "bypass", "deadline", "skipped"):
            self.cache.labels(result=result)
        for result in (
            "queue_full",
            "queue_bytes",
            "answered_unqueued",
            "wait_expired",
            "queue_delay",
            "in_flight",
            "deadline",
            "inline_behind",
        ):
            self.admission.labels(result=result)

    def child(self, metric: Any, **labels: str) -> Any:
        """``metric.labels(**labels)``, looked up once per label set and kept: prometheus'
        own ``labels`` validates and locks on every call (a fifth of a worker's samples under
        load in docs/benchmarks/service.md). Label values come from loaded bundles only, so
        the set stays small."""
        key = (id(metric), *labels.items())
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(**labels)
        return found

    def observe_cost(self, model: str, unit: str, spent: float, budget: float) -> None:
        """An answered request's spent cost and budget (in ``unit``, the bundle's), and
        their ratio."""
        if unit == MEASURED_UNIT:
            self.child(self.spent_seconds, model=model).observe(spent / 1000.0)
            self.child(self.budget_seconds, model=model).observe(budget / 1000.0)
        else:
            self.child(self.spent_units, model=model, unit=unit).observe(spent)
            self.child(self.budget_units, model=model, unit=unit).observe(budget)
        self.child(self.utilisation, model=model).observe(spent / budget)

    def cache_failure(self, kind: str) -> None:
        """A Redis call failed (error, or no answer within the Redis timeout)."""
        self.cache.labels(result="write_error" if kind == "write" else "error").inc()

    def exposition(self) -> bytes:
        """The text exposition: this process's metrics, or, when several workers run with
        ``PROMETHEUS_MULTIPROC_DIR`` set, every worker's aggregated (without process_* and
        python_*, which prometheus-client cannot aggregate across processes)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)
