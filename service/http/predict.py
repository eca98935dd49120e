"""``POST /predict``: one item (``PredictRequest``) or a batch (``BatchPredictRequest``).

The route is read more than any other, and every microsecond it costs is taken from the
client's budget, so it is served twice over the same code:

- :class:`PredictEndpoint`, a plain ASGI endpoint that ``BudgetServeApp`` calls for
  ``POST /predict`` before FastAPI's middleware, routing, dependency injection and
  response validation: it reads the body once (bounded: ``read_body``), sheds load
  (``Admission``), parses and validates the JSON in one pass (pydantic-core, from bytes),
  answers through :func:`answer`, encodes the response once, writes it, then logs one line
  and stores the new features in the cache.
- :func:`predict`, the FastAPI route, which documents the operation in the OpenAPI schema
  (from its typed signature) and serves it wherever the lean endpoint does not (the app
  mounted under a prefix): the same parsing rules (FastAPI's), the same :func:`answer`.

Errors are the taxonomy's (``service.errors``), mapped to statuses once in
``service.http.errors``; a malformed body is the 422 that FastAPI's validation handler gives.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import BackgroundTasks, Request, Response
from pydantic import Discriminator, Tag, TypeAdapter, ValidationError
from starlette.types import Receive, Scope, Send

from service import errors
from service.batch import predict_batch
from service.http.errors import (
    PREDICT_PATH,
    TOO_DEEP,
    error_body,
    headers_of,
    huge_integer,
    is_json,
    status_of,
    validation_problems,
)
from service.http.middleware import Admission, read_body, received_at
from service.http.requestlog import HEADER, accept_id, log_request, request_id
from service.http.schemas import BatchPredictRequest, PredictRequest
from service.http.state import AppState
from service.metrics import UNKNOWN_MODEL
from service.schemas import BatchCost, BatchPredictResponse

log = logging.getLogger("budgetserve.api")


def _shape(body: Any) -> str:
    """A body with ``items`` is a batch; anything else is read as a single request. (The
    single request's tag is "body", which the error handler leaves out of field names, so
    its validation messages read as they did before batches existed.)"""
    return "batch" if isinstance(body, dict) and "items" in body else "body"


PredictBody = Annotated[
    Annotated[PredictRequest, Tag("body")] | Annotated[BatchPredictRequest, Tag("batch")],
    Discriminator(_shape),
]
PREDICT_BODY: TypeAdapter[PredictRequest | BatchPredictRequest] = TypeAdapter(PredictBody)

_JSON = b"application/json"
_WHERE = re.compile(r"^(?P<reason>.*?) at line (?P<line>\d+) column (?P<column>\d+)$")


async def answer(
    state: AppState, body: PredictRequest | BatchPredictRequest, scope: Scope
) -> tuple[bytes, Mapping[str, bytes]]:
    """The JSON of the answer to a parsed ``/predict`` body, and the features to write back
    to the cache once it is sent. Notes the request's log line in ``scope["state"]``."""
    handler = state.loaded_handler()
    label = body.model if body.model in state.loaded_registry().bundles else UNKNOWN_MODEL
    scope_state = scope.setdefault("state", {})
    scope_state["model_label"] = label
    # The request's log line (service.http.requestlog); an error adds its outcome.
    summary: dict[str, Any] = {
        "model": body.model,
        "version": body.version,
        "strategy": body.strategy,
        "budget": body.budget,
    }
    scope_state["summary"] = summary
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
                tolerance=body.tolerance,
                budget_mode=body.budget_mode,
                max_cost=body.max_cost,
            )
        metrics.child(metrics.requests, model=label, status="ok").inc()
        first = outcome.responses[0]
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
        summary.update(
            total_budget=body.total_budget,
            items=len(batch.results),
            spent=batch.cost.spent,
            unit=batch.cost.unit,
            outcome="ok",
        )
        return batch.__pydantic_serializer__.to_json(batch), {}
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
            budget_mode=body.budget_mode,
            max_cost=body.max_cost,
            received=received_at(scope),
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
        below_floor=response.below_floor,
        outcome="ok",
    )
    scope_state["response"] = response
    return handler.encode(response), writes


async def predict(body: PredictBody, request: Request, background: BackgroundTasks) -> Response:
    """The body is a ``service.schemas.PredictResponse`` or, for a batch, a
    ``BatchPredictResponse`` (the route's ``response_model``, which documents them),
    serialized once by pydantic-core: returned as a model, FastAPI would validate it again,
    turn it into plain objects and encode those with ``json``. (``POST /predict`` at the
    app's root is served by :class:`PredictEndpoint`: see the module.)"""
    state: AppState = request.app.state.core
    payload, writes = await answer(state, body, request.scope)
    if writes:
        background.add_task(state.loaded_handler().write_back, writes)
    return Response(payload, media_type="application/json")


class PredictEndpoint:
    """``POST /predict`` as a plain ASGI endpoint (see the module). ``body_limit`` and
    ``body_timeout_s`` bound the body as ``BodyLimit`` does for the other routes."""

    def __init__(
        self, state: AppState, admission: Admission, body_limit: int, body_timeout_s: float
    ) -> None:
        self.state = state
        self.admission = admission
        self.body_limit = body_limit
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        received = received_at(scope) or started
        late_s = started - received
        rid = ""
        content_type = b""
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"x-request-id":
                rid = accept_id(value)
        rid = rid or accept_id(None)
        scope_state = scope.setdefault("state", {})
        scope_state["request_id"] = rid
        token = request_id.set(rid)
        status = 500
        overloaded = False
        writes: Mapping[str, bytes] = {}
        try:
            try:
                status, payload, headers, writes = await self._answer(
                    scope, receive, content_type, late_s
                )
            except errors.BudgetServeError as exc:
                status, payload, headers = self._refusal(scope_state, exc)
                overloaded = isinstance(exc, errors.Overloaded)
            except Exception as exc:  # the one 500: a bug, logged with its traceback
                log.exception("unexpected error on %s", PREDICT_PATH)
                self._count(scope_state, "internal_error")
                status = 500
                payload = error_body("internal_error", f"internal error: {type(exc).__name__}")
                headers = []
            if status == 0:  # the client went away before its body arrived: nothing to send
                status = 499  # (in the log line: nginx's "client closed request")
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", _JSON),
                        (b"content-length", str(len(payload)).encode()),
                        (HEADER.encode(), rid.encode()),
                        *headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            answered = scope_state.get("response")
            if answered is not None and self.state.handler is not None:
                self.state.handler.answered(answered, time.perf_counter(), seen=started)
        finally:
            log_request(
                scope, rid, status, started, scope_state.get("summary"), overloaded=overloaded
            )
            request_id.reset(token)
        if writes:  # after the response: its client does not wait for the cache
            handler = self.state.handler
            if handler is not None:
                await handler.write_back(writes)

    async def _answer(
        self, scope: Scope, receive: Receive, content_type: bytes, late_s: float
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]], Mapping[str, bytes]]:
        body = await read_body(scope, receive, self.body_limit, self.body_timeout_s)
        if body is None:
            return 0, b"", [], {}
        if content_type != _JSON and not is_json(content_type.decode("latin-1") or None):
            raise errors.UnsupportedMediaType(content_type.decode("latin-1") or None)
        refused = self.admission.shed(late_s)
        if refused is not None:
            raise refused
        self.admission.in_flight += 1
        try:
            try:
                parsed = PREDICT_BODY.validate_json(body)
            except ValidationError as exc:
                raise _invalid(exc, body) from None
            payload, writes = await answer(self.state, parsed, scope)
        finally:
            self.admission.in_flight -= 1
        return 200, payload, [], writes

    def _refusal(
        self, scope_state: dict[str, Any], exc: errors.BudgetServeError
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        self._count(scope_state, exc.code)
        headers = [(k.lower().encode(), v.encode()) for k, v in (headers_of(exc) or {}).items()]
        return status_of(exc), error_body(exc.code, exc.message, **exc.details), headers

    def _count(self, scope_state: dict[str, Any], status: str) -> None:
        summary = scope_state.get("summary")
        if isinstance(summary, dict):
            summary["outcome"] = status
        label = scope_state.get("model_label", UNKNOWN_MODEL)
        self.state.metrics.requests.labels(model=label, status=status).inc()


def _invalid(exc: ValidationError, body: bytes) -> errors.InvalidRequest:
    """A body that is not JSON, or not a valid request, as FastAPI's validation handler
    words it (``service.http.errors``)."""
    if not body.strip():
        return errors.InvalidRequest(
            'request body is empty: send a JSON object, e.g. {"model": "digits", "item": '
            '{"png_base64": "..."}, "budget": 5}'
        )
    problems = exc.errors(include_url=False)
    syntax = next((p for p in problems if p.get("type") == "json_invalid"), None)
    if syntax is None:
        message, listed = validation_problems(problems)
        return errors.InvalidRequest(message, problems=listed)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as cause:
        return errors.InvalidRequest(
            f"request body is not valid UTF-8 JSON: {cause.reason} at byte {cause.start}"
        )
    reason = str((syntax.get("ctx") or {}).get("error", "invalid JSON"))
    if reason.startswith("recursion limit exceeded"):
        return errors.InvalidRequest(TOO_DEEP)
    if reason.startswith("number out of range"):  # jiter's limit: Python's int digits
        return errors.InvalidRequest(huge_integer())
    where = _WHERE.match(reason)
    if where is None:
        return errors.InvalidRequest(f"request body is not valid JSON: {reason}")
    line, column = int(where["line"]), int(where["column"])
    offset = sum(len(row) + 1 for row in text.split("\n")[: line - 1]) + column
    return errors.InvalidRequest(
        f"request body is not valid JSON: {where['reason']} (at character {offset})"
    )
