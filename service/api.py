"""HTTP routes: translate HTTP to handler calls, and errors to JSON, in one place."""

from __future__ import annotations

import email.message
import logging
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
import numpy as np
from fastapi import BackgroundTasks, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import errors
from service.bundle import (
    AnyStrategy,
    DagStrategy,
    GatingStrategy,
    Manifest,
    PolyDomStrategy,
)
from service.cache import FeatureCache, make_cache
from service.handler import Limits, PredictHandler
from service.metrics import UNKNOWN_MODEL, Metrics
from service.registry import CalibrationSettings, Registry, load_registry
from service.schemas import ErrorResponse, PredictRequest, PredictResponse, Readiness
from service.settings import Settings

log = logging.getLogger("budgetserve.api")

STATUS: dict[type[errors.BudgetServeError], int] = {
    errors.InvalidRequest: 422,
    errors.InvalidItem: 422,
    errors.SizeMismatch: 422,
    errors.ItemTooLarge: 413,
    errors.PayloadTooLarge: 413,
    errors.ModelNotFound: 404,
    errors.StrategyNotFound: 404,
    errors.ModelNotReady: 503,
    errors.ServiceNotReady: 503,
    errors.Overloaded: 503,
    errors.BodyTimeout: 408,
    errors.ExtractionFailed: 422,
    errors.UnsupportedMediaType: 415,
}

# Documented in the OpenAPI schema for the routes that return them (every error body is an
# ErrorResponse, including FastAPI's own validation errors: see _validation_error).
_ERROR_DOCS = {
    404: "unknown model or strategy",
    408: "the request body did not arrive in full within BUDGETSERVE_BODY_TIMEOUT_S",
    413: "request body or image too large",
    415: "request body is not JSON (send Content-Type: application/json)",
    422: "malformed JSON, a bad or missing field, or an item the model cannot read",
    503: (
        "the model failed to load, the service is still starting, or this process is "
        "overloaded (then with Retry-After)"
    ),
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_DOCS[s]} for s in statuses}


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule for reading a body as JSON: ``application/json`` or ``*/*+json``."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _unreadable_body(cause: BaseException | None) -> str:
    """Why a JSON body could not be read, for the cases Python's parser reports by raising
    something other than a JSON syntax error."""
    if isinstance(cause, RecursionError):
        return ("request body nests JSON arrays or objects too deeply for the parser "
                "(a request needs at most a few levels)")
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 JSON: {cause.reason} at byte {cause.start}"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"request body holds an integer with more than {sys.get_int_max_str_digits()} "
                "digits; send numbers that fit a double")
    return "request body is not valid UTF-8 JSON that this API can read"

PREDICT_PATH = "/predict"


def _status(exc: errors.BudgetServeError) -> int:
    return next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)


def _error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **details: Any
) -> JSONResponse:
    body = ErrorResponse.model_validate(
        {"error": {"type": code, "message": message, "details": details}}
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _headers(exc: errors.BudgetServeError) -> dict[str, str] | None:
    if isinstance(exc, errors.Overloaded):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, errors.BodyTimeout):
        return {"Connection": "close"}
    return None


class BodyLimit:
    """Reject request bodies over ``limit`` bytes with 413, whether declared or streamed,
    and bodies that have not arrived in full ``timeout_s`` after the headers with 408 (the
    connection is then closed)."""

    def __init__(
        self, app: ASGIApp, limit: int, metrics: Metrics, timeout_s: float = math.inf
    ) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send, errors.PayloadTooLarge(self.limit))
            return
        # Read the body here (at most ``limit`` bytes), then replay it to the app: a body
        # streamed without Content-Length is cut off as soon as it passes the limit.
        chunks: list[bytes] = []
        seen = 0
        deadline = anyio.current_time() + self.timeout_s
        while True:
            message: Message | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
            if message is None:
                await self._reject(scope, receive, send, errors.BodyTimeout(self.timeout_s))
                return
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._reject(scope, receive, send, errors.PayloadTooLarge(self.limit))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, exc: errors.BudgetServeError
    ) -> None:
        if scope.get("path") == PREDICT_PATH:
            self.metrics.requests.labels(model=UNKNOWN_MODEL, status=exc.code).inc()
        response = _error(_status(exc), exc.code, exc.message, _headers(exc), **exc.details)
        await response(scope, receive, send)


def create_app(
    settings: Settings | None = None,
    *,
    registry: Registry | None = None,
    cache: FeatureCache | None = None,
) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    state: dict[str, Any] = {"ready": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
        state["registry"] = reg
        state["cache"] = feature_cache
        state["handler"] = PredictHandler(
            reg, feature_cache, metrics, settings.overhead_reserve_ms,
            threads=settings.extraction_threads,
            limits=Limits(
                max_budget_ms=settings.max_budget_ms,
                max_queued=settings.max_queued,
                max_queued_bytes=settings.max_queued_bytes,
            ),
        )
        state["ready"] = bool(reg.bundles)
        try:
            yield
        finally:
            state["ready"] = False
            await feature_cache.close()

    app = FastAPI(title="budgetserve", version="0.1.0", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.core = state

    def _count(request: Request, status: str) -> None:
        if request.url.path == PREDICT_PATH:
            label = getattr(request.state, "model_label", UNKNOWN_MODEL)
            metrics.requests.labels(model=label, status=status).inc()

    @app.exception_handler(errors.BudgetServeError)
    async def _domain_error(request: Request, exc: errors.BudgetServeError) -> JSONResponse:
        _count(request, exc.code)
        return _error(_status(exc), exc.code, exc.message, _headers(exc), **exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.method == "POST" and not _is_json(request.headers.get("content-type")):
            # FastAPI reads any other body as bytes, which fails validation as "not a dict".
            media = errors.UnsupportedMediaType(request.headers.get("content-type"))
            _count(request, media.code)
            return _error(415, media.code, media.message, **media.details)
        _count(request, "invalid_request")
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                reason = (err.get("ctx") or {}).get("error", "invalid JSON")
                offset = err.get("loc", ("body", None))[-1]
                message = f"request body is not valid JSON: {reason} (at character {offset})"
                return _error(422, "invalid_request", message)
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append({"field": loc or "body", "message": err.get("msg", "invalid")})
        summary = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
        return _error(422, "invalid_request", f"invalid request: {summary}", problems=problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and request.method == "POST":
            # FastAPI's "error parsing the body": not UTF-8, or JSON it cannot represent.
            _count(request, "invalid_request")
            return _error(422, "invalid_request", _unreadable_body(exc.__cause__))
        _count(request, "http_error")
        response = _error(exc.status_code, "http_error", str(exc.detail))
        response.headers.update(exc.headers or {})  # 405's Allow, for one
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        _count(request, "internal_error")
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, "internal_error", f"internal error: {type(exc).__name__}")

    def _registry() -> Registry:
        reg: Registry | None = state.get("registry")
        if reg is None:
            raise errors.ServiceNotReady()
        return reg

    @app.post(
        PREDICT_PATH,
        response_model=PredictResponse,
        responses=_errors(404, 408, 413, 415, 422, 503),
    )
    async def predict(
        body: PredictRequest, request: Request, background: BackgroundTasks
    ) -> PredictResponse:
        handler: PredictHandler | None = state.get("handler")
        if handler is None:
            raise errors.ServiceNotReady()
        label = body.model if body.model in _registry().bundles else UNKNOWN_MODEL
        request.state.model_label = label
        with metrics.request_latency.labels(model=label).time():
            response, writes = await handler.predict(
                body.model, body.item, body.size, body.budget, body.strategy
            )
        metrics.requests.labels(model=label, status="ok").inc()
        background.add_task(handler.write_back, writes)
        return response

    @app.get("/models", responses=_errors(503))
    async def list_models() -> dict[str, Any]:
        """Loaded bundles, and the bundle folders that failed to load: ``name`` is the
        manifest's name when it parsed (else the folder's), ``error`` the reason."""
        reg = _registry()
        return {
            "models": [_summary(b.manifest) for b in reg.bundles.values()],
            "failed": [
                {"name": f.name, "folder": f.folder, "error": f.reason}
                for f in sorted(reg.failures, key=lambda f: (f.name, f.folder))
            ],
        }

    @app.get("/models/{name}", responses=_errors(404, 422, 503))
    async def get_model(name: str) -> dict[str, Any]:
        bundle = _registry().get(name)
        m = bundle.manifest
        detail = _summary(m)
        detail["extractors"] = [
            {"name": e.name, "version": e.version, "dims": e.dims,
             "cost": e.cost.model_dump()}
            for e in m.extractors
        ]
        detail["models"] = [
            {"id": s.id, "features": s.features, "accuracy": s.accuracy} for s in m.models
        ]
        detail["strategies"] = [_strategy_summary(s) for s in m.strategies]
        detail["provenance"] = m.provenance.model_dump()
        return detail

    @app.get("/models/{name}/costs", responses=_errors(404, 422, 503))
    async def get_costs(name: str) -> dict[str, Any]:
        """Profiled vs live-calibrated cost curve of every extractor."""
        bundle = _registry().get(name)
        lo, hi = _size_domain(bundle.manifest)
        sizes = sorted({int(v) for v in np.geomspace(max(lo, 1.0), hi, 7)})
        return {
            "model": name,
            "unit": bundle.manifest.cost_unit,
            "calibrated": bundle.costs.calibrated,
            **bundle.calibrator.snapshot(sizes),
        }

    @app.get("/models/{name}/skyline", responses=_errors(404, 422, 503))
    async def get_skyline(
        name: str,
        size: Annotated[int, Query(gt=0, le=1 << 26, description="item size n")],
        strategy: Annotated[str | None, Query(max_length=64)] = None,
    ) -> dict[str, Any]:
        """What each budget buys at ``size``: (cost, accuracy, features), cost-sorted; ``model``
        is a model id, or an operating point id for strategies that choose between points
        (gating: its cost is the expected cost, its features those of the gate and f1)."""
        bundle = _registry().get(name)
        runtime = bundle.strategy(strategy)
        return {
            "model": name,
            "strategy": runtime.name,
            "size": size,
            "unit": bundle.manifest.cost_unit,
            "calibrated": bundle.costs.calibrated,
            "skyline": [
                {"cost": cost, "accuracy": acc, "model": model,
                 "features": runtime.skyline_features(model)}
                for cost, acc, model in runtime.skyline(size)
            ],
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "no bundle loaded (yet)"}},
    )
    async def readyz() -> JSONResponse:
        reg: Registry | None = state.get("registry")
        # ``is not None``, never truthiness: an empty in-process cache has len() 0.
        feature_cache: FeatureCache | None = state.get("cache")
        cache_ok = feature_cache is not None and await feature_cache.ping()
        body = {
            "ready": bool(state["ready"]),
            "models": sorted(reg.bundles) if reg is not None else [],
            "failed": sorted({f.name for f in reg.failures}) if reg is not None else [],
            "cache": {"backend": feature_cache.backend if feature_cache is not None else None,
                      "reachable": cache_ok},
        }
        # A down cache does not make the service unready: requests succeed uncached.
        return JSONResponse(body, status_code=200 if state["ready"] else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }},
    )
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(
        BodyLimit, limit=settings.max_body_bytes, metrics=metrics,
        timeout_s=settings.body_timeout_s,
    )
    return app


def _summary(m: Manifest) -> dict[str, Any]:
    return {
        "name": m.name,
        "version": m.version,
        "task": m.task,
        "classes": m.classes,
        "strategies": [s.name for s in m.strategies],
        "default_strategy": m.default_strategy,
        "cost_unit": m.cost_unit,
        "item": m.item.model_dump(),
        "n_models": len(m.models),
    }


def _strategy_summary(s: AnyStrategy) -> dict[str, Any]:
    if isinstance(s, DagStrategy):
        return {
            "name": s.name,
            "kind": s.kind,
            "anytime": True,
            "groups": s.groups,
            "policies": [
                {"cost_scale": p.cost_scale, "mean_cost": p.mean_cost, "error": p.error,
                 "states": len(p.states)}
                for p in s.policies
            ],
        }
    if isinstance(s, GatingStrategy):
        return {
            "name": s.name,
            "kind": s.kind,
            "anytime": True,
            "points": [
                {"id": p.id, "method": p.method, "p_full": p.p_full,
                 "regularisation": p.regularisation, "gated": p.gate_file is not None,
                 "gate_features": p.gate_features, "low_model": p.low_model,
                 "high_model": p.high_model, "mean_cost": p.mean_cost,
                 "fraction_full": p.fraction_full, "accuracy": p.accuracy}
                for p in s.points
            ],
        }
    if isinstance(s, PolyDomStrategy):
        return {
            "name": s.name,
            "kind": s.kind,
            "anytime": s.anytime,
            "epsilon": s.epsilon,
            "delta": s.delta,
            "size_domain": s.size_domain,
            "candidates": s.candidates,
            "index_ranges": len(s.index.breakpoints),
            "stats": s.stats,
        }
    return {
        "name": s.name,
        "kind": s.kind,
        "anytime": True,
        "reference_size": s.reference_size,
        "sequences": [{"lambdas": q.lambdas, "features": q.features} for q in s.sequences],
    }


def _size_domain(m: Manifest) -> tuple[float, float]:
    for s in m.strategies:
        if isinstance(s, PolyDomStrategy):
            return s.size_domain
    sizes = [n for e in m.extractors for n in e.cost.profiled_sizes]
    return (float(min(sizes)), float(max(sizes))) if sizes else (64.0, 65536.0)
