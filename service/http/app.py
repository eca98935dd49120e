"""The app factory: typed state, the lifespan that loads the bundles, the route list."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from service.cache import FeatureCache, make_cache
from service.handler import Limits, PredictHandler
from service.http import health, models, predict
from service.http.errors import PREDICT_PATH, documented, install_handlers
from service.http.middleware import BodyLimit
from service.http.schemas import Readiness
from service.http.state import AppState
from service.metrics import Metrics
from service.registry import CalibrationSettings, Registry, load_registry
from service.schemas import PredictResponse
from service.settings import Settings


@dataclass(frozen=True)
class Route:
    """One route: ``options`` are ``FastAPI.add_api_route``'s (``response_model`` only where
    the return annotation is not the schema; ``responses``: the documented errors)."""

    method: str
    path: str
    endpoint: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)


# Every route of the API, in the order the OpenAPI schema lists them.
ROUTES = (
    Route(
        "POST",
        PREDICT_PATH,
        predict.predict,
        {"response_model": PredictResponse, "responses": documented(404, 408, 413, 415, 422, 503)},
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


def create_app(
    settings: Settings | None = None,
    *,
    registry: Registry | None = None,
    cache: FeatureCache | None = None,
) -> FastAPI:
    """The budgetserve app. ``registry`` and ``cache`` replace the ones ``settings`` would
    load and connect to (tests; embedding)."""
    settings = settings or Settings()
    state = AppState(settings=settings, metrics=Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(state, registry, cache)
        try:
            yield
        finally:
            state.ready = False
            if state.cache is not None:
                await state.cache.close()

    app = FastAPI(title="budgetserve", version="0.1.0", lifespan=lifespan)
    app.state.core = state
    install_handlers(app)
    for route in ROUTES:
        app.add_api_route(route.path, route.endpoint, methods=[route.method], **route.options)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        metrics=state.metrics,
        timeout_s=settings.body_timeout_s,
    )
    return app


async def _start(state: AppState, registry: Registry | None, cache: FeatureCache | None) -> None:
    """Load the bundles and connect the cache (or take the ones given), then serve."""
    settings, metrics = state.settings, state.metrics
    reg = (
        registry
        if registry is not None
        else load_registry(
            settings.models_dir,
            settings.max_pixels,
            CalibrationSettings(
                enabled=settings.calibration,
                window=settings.calibration_window,
                min_samples=settings.calibration_min_samples,
            ),
            settings.sensor_sources,
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
        threads=settings.extraction_threads,
        limits=Limits(
            max_budget_ms=settings.max_budget_ms,
            max_queued=settings.max_queued,
            max_queued_bytes=settings.max_queued_bytes,
        ),
        default_accounting=settings.accounting,
    )
    state.ready = bool(reg.bundles)
