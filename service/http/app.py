"""The app factory: typed state, the lifespan that loads the bundles, the route list."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.cache import FeatureCache, make_cache
from service.handler import Limits, PredictHandler
from service.http import health, models, predict
from service.http.errors import install_handlers
from service.http.middleware import BodyLimit
from service.http.state import AppState
from service.metrics import Metrics
from service.registry import CalibrationSettings, Registry, load_registry
from service.settings import Settings

# The routes, in the order the OpenAPI schema lists them.
ROUTERS = (predict.router, models.router, health.router)


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
    app.state.metrics = state.metrics
    app.state.core = state
    install_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(
        BodyLimit, limit=settings.max_body_bytes, metrics=state.metrics,
        timeout_s=settings.body_timeout_s,
    )
    return app


async def _start(
    state: AppState, registry: Registry | None, cache: FeatureCache | None
) -> None:
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
        )
    )
    feature_cache = cache if cache is not None else make_cache(
        settings.redis_url,
        max_bytes=settings.cache_max_bytes,
        ttl_s=settings.cache_ttl_s,
        timeout_ms=settings.redis_timeout_ms,
        retry_s=settings.redis_retry_s,
        failures=settings.redis_failures,
        on_trip=metrics.circuit_trips.inc,
        on_failure=metrics.cache_failure,
    )
    metrics.models_loaded.set(len(reg.bundles))
    state.registry = reg
    state.cache = feature_cache
    state.handler = PredictHandler(
        reg, feature_cache, metrics, settings.overhead_reserve_ms,
        threads=settings.extraction_threads,
        limits=Limits(
            max_budget_ms=settings.max_budget_ms,
            max_queued=settings.max_queued,
            max_queued_bytes=settings.max_queued_bytes,
        ),
    )
    state.ready = bool(reg.bundles)
