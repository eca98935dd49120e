"""``POST /predict``: one item (``PredictRequest``) or a batch (``BatchPredictRequest``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import BackgroundTasks, Depends, Request, Response
from pydantic import Discriminator, Tag

from service.batch import predict_batch
from service.http.middleware import received_at
from service.http.schemas import BatchPredictRequest, PredictRequest
from service.http.state import AppState, app_state
from service.metrics import UNKNOWN_MODEL
from service.schemas import BatchCost, BatchPredictResponse


def _shape(body: Any) -> str:
    """A body with ``items`` is a batch; anything else is read as a single request. (The
    single request's tag is "body", which the error handler leaves out of field names, so
    its validation messages read as they did before batches existed.)"""
    return "batch" if isinstance(body, dict) and "items" in body else "body"


PredictBody = Annotated[
    Annotated[PredictRequest, Tag("body")] | Annotated[BatchPredictRequest, Tag("batch")],
    Discriminator(_shape),
]


async def predict(
    body: PredictBody,
    request: Request,
    background: BackgroundTasks,
    state: Annotated[AppState, Depends(app_state)],
) -> Response:
    """The body is a ``service.schemas.PredictResponse`` or, for a batch, a
    ``BatchPredictResponse`` (the route's ``response_model``, which documents them),
    serialized once by pydantic-core: returned as a model, FastAPI would validate it again,
    turn it into plain objects and encode those with ``json``."""
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
    if isinstance(body, BatchPredictRequest):
        with metrics.child(metrics.request_latency, model=label).time():
            outcome = await predict_batch(
                handler,
                body.model,
                body.items,
                body.strategy,
                budget=body.budget,
                total_budget=body.total_budget,
                version=body.version,
            )
        metrics.child(metrics.requests, model=label, status="ok").inc()
        first = outcome.responses[0]
        summary.update(
            total_budget=body.total_budget,
            items=len(outcome.responses),
            spent=sum(r.cost.spent for r in outcome.responses),
            unit=first.cost.unit,
            outcome="ok",
        )
        order = outcome.plan.order if outcome.plan else list(range(len(outcome.responses)))
        batch = BatchPredictResponse(
            model=first.model,
            results=outcome.responses,
            cost=BatchCost(
                unit=first.cost.unit,
                total_budget=body.total_budget,
                budget=body.budget,
                spent=sum(r.cost.spent for r in outcome.responses),
                order=order,
            ),
        )
        return Response(batch.model_dump_json(), media_type="application/json")
    with metrics.child(metrics.request_latency, model=label).time():
        response, writes = await handler.predict(
            body.model,
            body.item,
            body.size,
            body.budget,
            body.strategy,
            version=body.version,
            accounting=body.accounting,
            tolerance=body.tolerance,
            received=received_at(request.scope),
        )
    metrics.child(metrics.requests, model=label, status="ok").inc()
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
    return Response(response.model_dump_json(), media_type="application/json")
