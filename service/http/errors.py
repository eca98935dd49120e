"""Errors to HTTP, once: the status table of the taxonomy (``service.errors``), the error
body every error response carries, and the app's exception handlers."""

from __future__ import annotations

import difflib
import email.message
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from service import errors
from service.http.schemas import ErrorResponse
from service.http.state import AppState
from service.metrics import UNKNOWN_MODEL

log = logging.getLogger("budgetserve.api")

PREDICT_PATH = "/predict"

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
    errors.VersionNotFound: 404,
    errors.AdminUnauthorized: 401,
    errors.AdminDisabled: 403,
}

# Documented in the OpenAPI schema for the routes that return them (every error body is an
# ErrorResponse, including FastAPI's own validation errors: see _validation_error).
_ERROR_DOCS = {
    401: "missing or wrong admin token (Authorization: Bearer <BUDGETSERVE_ADMIN_TOKEN>)",
    403: "model management is disabled: BUDGETSERVE_ADMIN_TOKEN is not set",
    404: "unknown model, version or strategy",
    408: "the request body did not arrive in full within BUDGETSERVE_BODY_TIMEOUT_S",
    413: "request body or image too large",
    415: "request body is not JSON (send Content-Type: application/json)",
    422: "malformed JSON, a bad or missing field, or an item the model cannot read",
    503: (
        "the model failed to load, the service is still starting, or this process is "
        "overloaded (then with Retry-After)"
    ),
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that may answer with these error statuses."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DOCS[s]} for s in statuses}


def status_of(exc: errors.BudgetServeError) -> int:
    return next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)


def headers_of(exc: errors.BudgetServeError) -> dict[str, str] | None:
    if isinstance(exc, errors.Overloaded):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, errors.BodyTimeout):
        return {"Connection": "close"}
    return None


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **details: Any
) -> JSONResponse:
    body = ErrorResponse.model_validate(
        {"error": {"type": code, "message": message, "details": details}}
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_body(code: str, message: str, **details: Any) -> bytes:
    """The JSON of an ``ErrorResponse`` (what :func:`error_response` sends), as bytes."""
    body = ErrorResponse.model_validate(
        {"error": {"type": code, "message": message, "details": details}}
    )
    return body.__pydantic_serializer__.to_json(body)


def domain_response(exc: errors.BudgetServeError) -> JSONResponse:
    """The response of an error of the taxonomy: its status, code, message and details."""
    return error_response(status_of(exc), exc.code, exc.message, headers_of(exc), **exc.details)


def is_json(content_type: str | None) -> bool:
    """FastAPI's rule for reading a body as JSON: ``application/json`` or ``*/*+json``."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


TOO_DEEP = (
    "request body nests JSON arrays or objects too deeply for the parser "
    "(a request needs at most a few levels)"
)


def huge_integer() -> str:
    return (
        f"request body holds an integer with more than {sys.get_int_max_str_digits()} "
        "digits; send numbers that fit a double"
    )


def _unreadable_body(cause: BaseException | None) -> str:
    """Why a JSON body could not be read, for the cases Python's parser reports by raising
    something other than a JSON syntax error."""
    if isinstance(cause, RecursionError):
        return TOO_DEEP
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 JSON: {cause.reason} at byte {cause.start}"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return huge_integer()
    return "request body is not valid UTF-8 JSON that this API can read"


def _count(request: Request, status: str) -> None:
    """Count a predict request's outcome (other routes are not counted); note it for the
    request's log line."""
    summary = getattr(request.state, "summary", None)
    if isinstance(summary, dict):
        summary["outcome"] = status
    if request.url.path == PREDICT_PATH:
        label = getattr(request.state, "model_label", UNKNOWN_MODEL)
        state: AppState = request.app.state.core
        state.metrics.requests.labels(model=label, status=status).inc()


async def _domain_error(request: Request, exc: errors.BudgetServeError) -> JSONResponse:
    _count(request, exc.code)
    return domain_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    if request.method == "POST" and not is_json(request.headers.get("content-type")):
        # FastAPI reads any other body as bytes, which fails validation as "not a dict".
        media = errors.UnsupportedMediaType(request.headers.get("content-type"))
        _count(request, media.code)
        return error_response(415, media.code, media.message, **media.details)
    _count(request, "invalid_request")
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            offset = err.get("loc", ("body", None))[-1]
            message = f"request body is not valid JSON: {reason} (at character {offset})"
            return error_response(422, "invalid_request", message)
    message, problems = validation_problems(exc.errors())
    return error_response(422, "invalid_request", message, problems=problems)


def validation_problems(
    problems: Sequence[Mapping[str, Any]],
) -> tuple[str, list[dict[str, str]]]:
    """A request's validation errors (pydantic's) as one message and a list of
    ``{"field", "message"}`` (field names without the body's own prefix)."""
    missing = [
        str(err["loc"][-1]) for err in problems if err.get("type") == "missing" and err.get("loc")
    ]
    listed = []
    for err in problems:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        message = str(err.get("msg", "invalid"))
        value = err.get("input")
        if err.get("type") == "extra_forbidden" and err.get("loc"):
            # a misspelt field: name the missing one it was probably meant to be
            close = difflib.get_close_matches(str(err["loc"][-1]), missing, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        elif isinstance(value, int | float | bool) or (isinstance(value, str) and len(value) <= 40):
            message += f" (got {value!r})"  # what was sent, beside what is required
        listed.append({"field": loc or "body", "message": message})
    summary = "; ".join(f"{p['field']}: {p['message']}" for p in listed)
    return f"invalid request: {summary}", listed


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and request.method == "POST":
        # FastAPI's "error parsing the body": not UTF-8, or JSON it cannot represent.
        _count(request, "invalid_request")
        return error_response(422, "invalid_request", _unreadable_body(exc.__cause__))
    _count(request, "http_error")
    message = str(exc.detail)
    allowed: set[str] = set()
    if exc.status_code == 405:
        # Starlette names the methods of the first route matching the path only; a path
        # served by several routes (GET and DELETE /models/{name}) allows all of theirs.
        allowed = {
            method
            for route in request.app.router.routes
            if isinstance(route, BaseRoute) and route.matches(request.scope)[0] is not Match.NONE
            for method in getattr(route, "methods", None) or ()
        }
        if allowed:
            message = (
                f"{request.method} is not allowed on {request.url.path}: it takes "
                f"{', '.join(sorted(allowed))}"
            )
    elif exc.status_code == 404 and message == "Not Found":
        message = (
            f"no such endpoint: {request.method} {request.url.path} (the API is listed at "
            "GET /docs and GET /openapi.json)"
        )
    response = error_response(exc.status_code, "http_error", message)
    response.headers.update(exc.headers or {})  # 405's Allow, for one
    if allowed:
        response.headers["Allow"] = ", ".join(sorted(allowed))
    return response


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    _count(request, "internal_error")
    log.exception("unexpected error on %s", request.url.path)
    return error_response(500, "internal_error", f"internal error: {type(exc).__name__}")


def _protocol_shape(handler: Any) -> Any:
    """``handler``, answering under ``/v2`` in the Open Inference Protocol's error shape,
    ``{"error": "<message>"}`` (its clients read nothing else), with the same status."""

    async def handle(request: Request, exc: Any) -> JSONResponse:
        response: JSONResponse = await handler(request, exc)
        path = request.url.path
        if path != "/v2" and not path.startswith("/v2/"):
            return response
        error = ErrorResponse.model_validate_json(bytes(response.body)).error
        reshaped = JSONResponse({"error": error.message}, status_code=response.status_code)
        for key, value in response.headers.items():
            if key not in ("content-length", "content-type"):
                reshaped.headers[key] = value
        return reshaped

    return handle


def install_handlers(app: FastAPI) -> None:
    """Answer every error with an ``ErrorResponse`` body (under ``/v2``: the protocol's),
    counting /predict's outcomes."""
    app.exception_handler(errors.BudgetServeError)(_protocol_shape(_domain_error))
    app.exception_handler(RequestValidationError)(_protocol_shape(_validation_error))
    app.exception_handler(StarletteHTTPException)(_protocol_shape(_http_error))
    app.exception_handler(Exception)(_protocol_shape(_unexpected))
