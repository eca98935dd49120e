"""``POST /predict``."""

from __future__ import annotations

from typing import Annotated

from fastapi import BackgroundTasks, Depends, Request, Response

from service.http.middleware import received_at
from service.http.schemas import PredictRequest
from service.http.state import AppState, app_state
from service.metrics import UNKNOWN_MODEL


async def predict(
    body: PredictRequest,
    request: Request,
    background: BackgroundTasks,
    state: Annotated[AppState, Depends(app_state)],
) -> Response:
    """The body is a ``service.schemas.PredictResponse`` (the route's ``response_model``,
    which documents it), serialized once by pydantic-core: returned as the model, FastAPI
    would validate it again, turn it into plain objects and encode those with ``json``."""
    handler = state.loaded_handler()
    label = body.model if body.model in state.loaded_registry().bundles else UNKNOWN_MODEL
    request.state.model_label = label
    metrics = state.metrics
    with metrics.child(metrics.request_latency, model=label).time():
        response, writes = await handler.predict(
            body.model,
            body.item,
            body.size,
            body.budget,
            body.strategy,
            accounting=body.accounting,
            received=received_at(request.scope),
        )
    metrics.child(metrics.requests, model=label, status="ok").inc()
    background.add_task(handler.write_back, writes)
    return Response(response.model_dump_json(), media_type="application/json")
