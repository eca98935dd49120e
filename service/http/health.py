"""``GET /healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.http.state import AppState, app_state


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(state: Annotated[AppState, Depends(app_state)]) -> JSONResponse:
    reg = state.registry
    # ``is not None``, never truthiness: an empty in-process cache has len() 0.
    feature_cache = state.cache
    cache_ok = feature_cache is not None and await feature_cache.ping()
    body = {
        "ready": state.ready,
        "models": sorted(reg.bundles) if reg is not None else [],
        "failed": sorted({f.name for f in reg.failures}) if reg is not None else [],
        "cache": {
            "backend": feature_cache.backend if feature_cache is not None else None,
            "reachable": cache_ok,
        },
    }
    # A down cache does not make the service unready: requests succeed uncached.
    return JSONResponse(body, status_code=200 if state.ready else 503)


async def prometheus(state: Annotated[AppState, Depends(app_state)]) -> Response:
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
