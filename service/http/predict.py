"""``POST /predict``."""

from __future__ import annotations

from typing import Annotated

from fastapi import BackgroundTasks, Depends, Request

from service.http.schemas import PredictRequest
from service.http.state import AppState, app_state
from service.metrics import UNKNOWN_MODEL
from service.schemas import PredictResponse


async def predict(
    body: PredictRequest,
    request: Request,
    background: BackgroundTasks,
    state: Annotated[AppState, Depends(app_state)],
) -> PredictResponse:
    handler = state.loaded_handler()
    label = body.model if body.model in state.loaded_registry().bundles else UNKNOWN_MODEL
    request.state.model_label = label
    # The request's log line (service.http.requestlog); an error handler adds its outcome.
    summary = request.state.summary = {
        "model": body.model,
        "version": body.version,
        "strategy": body.strategy,
        "budget": body.budget,
    }
    metrics = state.metrics
    with metrics.request_latency.labels(model=label).time():
        response, writes = await handler.predict(
            body.model, body.item, body.size, body.budget, body.strategy, version=body.version
        )
    metrics.requests.labels(model=label, status="ok").inc()
    summary.update(
        strategy=response.strategy,
        model_version=response.model_version,
        spent=response.cost.spent,
        unit=response.cost.unit,
        cached=response.cost.cached,
        extracted=response.cost.extracted,
        deadline_exceeded=response.deadline_exceeded,
        outcome="ok",
    )
    background.add_task(handler.write_back, writes)
    return response
