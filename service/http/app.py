"""The app factory: typed state, the lifespan that loads the bundles, the route list."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.allocator import keep_freed_memory
from service.cache import FeatureCache, make_cache
from service.handler import Limits, PredictHandler
from service.http import admin, health, models, predict, v2
from service.http.docs import install_docs
from service.http.errors import PREDICT_PATH, documented, install_handlers
from service.http.middleware import RECEIVED_KEY, Admission, BodyLimit
from service.http.predict import PredictEndpoint
from service.http.requestlog import RequestLog
from service.http.schemas import Readiness
from service.http.state import AppState
from service.inference import limit_blas_threads
from service.loop_lag import LOOP_LAG
from service.management import ModelManager, snapshot
from service.metrics import Metrics
from service.registry import CalibrationSettings, Registry, blank_item, load_registry
from service.schemas import BatchPredictResponse, PredictResponse
from service.server import CONNECTION, ConnectionClock, extraction_threads
from service.settings import Settings

log = logging.getLogger("budgetserve.api")


@dataclass(frozen=True)
class Route:
    """One route: ``options`` are ``FastAPI.add_api_route``'s (``response_model`` only where
    the return annotation is not the schema; ``responses``: the documented errors)."""

    method: str
    path: str
    endpoint: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)


# Every route of the API, in the order the OpenAPI schema lists them.
ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        PREDICT_PATH,
        predict.predict,
        {
            "response_model": PredictResponse | BatchPredictResponse,
            "responses": documented(404, 408, 413, 415, 422, 503),
        },
    ),
    Route("GET", "/models", models.list_models, {"responses": documented(503)}),
    Route("GET", "/models/{name}", models.get_model, {"responses": documented(404, 422, 503)}),
    Route(
        "GET", "/models/{name}/costs", models.get_costs, {"responses": documented(404, 422, 503)}
    ),
    Route(
        "GET",
        "/models/{name}/skyline",
        models.get_skyline,
        {"responses": documented(404, 422, 503)},
    ),
    Route("POST", "/-/reload", admin.reload_all, {"responses": documented(401, 403, 503)}),
    Route(
        "POST",
        "/models/{name}/reload",
        admin.reload_model,
        {"responses": documented(401, 403, 404, 422, 503)},
    ),
    Route(
        "DELETE",
        "/models/{name}",
        admin.unload_model,
        {"responses": documented(401, 403, 404, 422, 503)},
    ),
    Route("GET", "/healthz", health.healthz),
    Route(
        "GET",
        "/readyz",
        health.readyz,
        {
            "response_model": Readiness,
            "responses": {503: {"model": Readiness, "description": "no bundle loaded (yet)"}},
        },
    ),
    Route(
        "GET",
        "/metrics",
        health.prometheus,
        {
            "response_class": PlainTextResponse,
            "responses": {
                200: {
                    "description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        },
    ),
)

# The Open Inference Protocol (KServe v2 / Triton REST) routes.
ROUTES += tuple(
    Route(method, path, endpoint, options) for method, path, endpoint, options in v2.ROUTES
)


# FastAPI >= 0.16x traces, measures and logs through OpenTelemetry by itself whenever the
# process has a global provider; budgetserve's own tracing (BUDGETSERVE_TRACING) replaces
# it, so that tracing is off unless asked for, and on without duplicate request spans.
_NATIVE_TELEMETRY_OFF: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


class BudgetServeApp(FastAPI):
    """FastAPI, with two duties before its stack: each HTTP request's receipt, from its
    connection's clock when ``service.server`` serves it (else now), and ``POST /predict``,
    served by the lean endpoint (``service.http.predict``; every other route, and
    ``/predict`` under a prefix, by FastAPI)."""

    predict_endpoint: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        clock = CONNECTION.get()
        scope[RECEIVED_KEY] = clock.request_began() if clock is not None else time.perf_counter()
        if clock is not None:
            send = _timed(send, clock)
            if clock.last_request:  # the server is stopping: close after
                send = _closing(send)
        try:
            endpoint = self.predict_endpoint
            if endpoint is not None and scope["path"] == PREDICT_PATH and scope["method"] == "POST":
                await endpoint(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        finally:
            if clock is not None:
                clock.response_done()


def _timed(send: Send, clock: ConnectionClock) -> Send:
    """``send``, telling ``clock`` when a response's head is about to go (to be written with
    its body: ``service.server.CoalescingTransport``) and when its last bytes are handed over."""

    async def timed(message: Message) -> None:
        if message["type"] == "http.response.start":
            clock.response_starts()
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            clock.response_sent()

    return timed


def _closing(send: Send) -> Send:
    """``send``, with ``Connection: close`` on the response (uvicorn then closes after it)."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing


def create_app(
    settings: Settings | None = None,
    *,
    registry: Registry | None = None,
    cache: FeatureCache | None = None,
    tracer_provider: Any = None,
) -> BudgetServeApp:
    """The budgetserve app. ``registry`` and ``cache`` replace the ones ``settings`` would
    load and connect to (tests; embedding); ``tracer_provider`` (an OpenTelemetry one) the
    provider ``BUDGETSERVE_TRACING`` would use (``service.tracing``)."""
    settings = settings or Settings()
    state = AppState(settings=settings, metrics=Metrics())
    tracer, stop_tracing = None, None
    if settings.tracing:  # imports OpenTelemetry only then
        from service.tracing import make_tracer

        tracer, stop_tracing = make_tracer(tracer_provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(state, registry, cache)
        grpc_server = None
        if settings.grpc_port is not None:  # gRPC beside HTTP, on this loop (issue 29)
            from service.grpc_api import start_grpc

            grpc_server = await start_grpc(state)
        watcher = None
        if state.manager is not None and settings.watch_interval_s > 0:
            watcher = asyncio.create_task(state.manager.watch(settings.watch_interval_s))
        try:
            yield
        finally:
            state.ready = False
            LOOP_LAG.stop()
            if grpc_server is not None:
                await grpc_server.stop()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if stop_tracing is not None:
                stop_tracing()
            if state.cache is not None:
                await state.cache.close()
            if state.handler is not None:
                state.handler.close()

    app = BudgetServeApp(
        title="budgetserve",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,  # FastAPI's ReDoc page loads its script from a CDN: /docs is offline
        **_NATIVE_TELEMETRY_OFF,
    )
    app.state.core = state
    install_docs(app)  # Swagger UI at /docs, from packaged files (service.http.docs)
    install_handlers(app)
    for route in ROUTES:
        app.add_api_route(route.path, route.endpoint, methods=[route.method], **route.options)
    admission = Admission(
        state.metrics,
        max_delay_s=settings.max_queue_delay_ms / 1000.0 or math.inf,
        max_in_flight=settings.max_in_flight,
    )
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        metrics=state.metrics,
        timeout_s=settings.body_timeout_s,
        admission=admission,
    )
    endpoint: ASGIApp = PredictEndpoint(
        state, admission, settings.max_body_bytes, settings.body_timeout_s
    )
    if tracer is not None:
        from service.tracing import TracingMiddleware

        app.add_middleware(TracingMiddleware, tracer=tracer)
        endpoint = TracingMiddleware(endpoint, tracer=tracer)
    app.add_middleware(RequestLog)  # outermost: every response carries the request id
    app.predict_endpoint = endpoint
    return app


async def _start(state: AppState, registry: Registry | None, cache: FeatureCache | None) -> None:
    """Load the bundles and connect the cache (or take the ones given), then serve."""
    settings, metrics = state.settings, state.metrics
    limit_blas_threads()
    keep_freed_memory(settings.allocator_keep_mb)
    calibration = CalibrationSettings(
        enabled=settings.calibration,
        window=settings.calibration_window,
        min_samples=settings.calibration_min_samples,
    )
    # Taken before loading, so that the watcher sees a change made while the bundles load.
    seen = snapshot(settings.models_dir) if settings.watch_interval_s > 0 else {}
    reg = (
        registry
        if registry is not None
        else load_registry(
            settings.models_dir,
            settings.max_pixels,
            calibration,
            settings.sensor_sources,
            settings.max_manifest_bytes,
        )
    )
    feature_cache = (
        cache
        if cache is not None
        else make_cache(
            settings.redis_url,
            max_bytes=settings.cache_max_bytes,
            ttl_s=settings.cache_ttl_s,
            timeout_ms=settings.redis_timeout_ms,
            retry_s=settings.redis_retry_s,
            failures=settings.redis_failures,
            on_trip=metrics.circuit_trips.inc,
            on_failure=metrics.cache_failure,
        )
    )
    metrics.models_loaded.set(len(reg.bundles))
    state.registry = reg
    state.cache = feature_cache
    state.handler = PredictHandler(
        reg,
        feature_cache,
        metrics,
        settings.overhead_reserve_ms,
        threads=extraction_threads(settings.extraction_threads, settings.workers),
        limits=Limits(
            max_budget_ms=settings.max_budget_ms,
            max_queued=settings.max_queued,
            max_queued_bytes=settings.max_queued_bytes,
            max_wait_s=settings.max_wait_ms / 1000.0,
        ),
        default_accounting=settings.accounting,
        inline_ms=settings.inline_ms,
        contention_weight=settings.contention_weight,
    )
    LOOP_LAG.start(asyncio.get_running_loop())
    await measure_floor(state.handler, reg)
    state.ready = bool(reg.bundles)

    def changed() -> None:
        metrics.models_loaded.set(len(reg.bundles))
        state.ready = bool(reg.bundles)

    state.manager = ModelManager(
        reg,
        settings.models_dir,
        settings.max_pixels,
        calibration,
        settings.sensor_sources,
        on_change=changed,
        max_manifest_bytes=settings.max_manifest_bytes,
    )
    state.manager.remember(seen)


#: Answers the start-up measurement of the floor takes (``measure_floor``), after a few
#: that warm the path up and are not counted, and their budget (ms).
FLOOR_SAMPLES, FLOOR_WARM_UP, FLOOR_BUDGET_MS = 32, 8, 5.0


async def measure_floor(handler: PredictHandler, registry: Registry) -> None:
    """Measure the service's own cost on this machine before the first request: answer
    ``FLOOR_SAMPLES`` requests for a blank item of the first bundle with measured costs (an
    image bundle's if there is one, else a word's or a sentence's: ``blank_item``) at
    ``FLOOR_BUDGET_MS``, which buys features as client requests do (decoding, planning,
    extraction on the worker threads, inference, encoding; no cache read), so
    ``GET /models/{name}`` shows a measured floor from the start and the first requests plan
    with a reserve measured on answers like theirs (without these samples, a server of
    structured bundles alone took its reserve from its first live answers, where one cold
    answer was the p95 and priced every budget under it out; measured at a budget that
    bought nothing, the reserve was 0.06-0.07 ms where live answers' is 0.3-0.5, and a fresh
    server's first ten requests ran over their 1-5 ms budgets 7-8 times out of ten, 2-4
    after). The samples are the floor's only; no metric or log line counts them, and the
    calibration forgets the extractions they timed. Live answers then keep the floor
    current."""
    measured = [
        (name, bundle.manifest.item.kind, item)
        for name, bundle in registry.bundles.items()
        if bundle.manifest.cost_basis == "measured"
        and (item := blank_item(bundle.manifest)) is not None
    ]
    measured.sort(key=lambda found: found[1] != "image")
    for name, _kind, item in measured[:1]:
        try:
            for k in range(FLOOR_WARM_UP + FLOOR_SAMPLES):
                received = time.perf_counter()
                response, _ = await handler.predict(
                    name,
                    {**item, "id": f"floor-{k}"},
                    None,
                    FLOOR_BUDGET_MS,
                    received=received,
                    observe=False,
                )
                handler.encode(response)
                if k >= FLOOR_WARM_UP:
                    handler.answered(response, time.perf_counter())
        except Exception:  # the floor is then measured from the first answers instead
            log.warning("could not measure the floor at start-up on %r", name, exc_info=True)
        # The extractions timed here were a cold process's on a blank item: live requests
        # calibrate from their own (as after the structured bundles' warm-up, load_registry).
        registry.bundles[name].forget_timings()
