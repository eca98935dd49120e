"""A small Python client of the budgetserve API, with typed results.

Standard library and pydantic only (no FastAPI, ONNX Runtime or HTTP library needed)::

    from service.client import Client, image_item

    client = Client("http://127.0.0.1:8000")
    answer = client.predict("digits", image_item(png_bytes), budget=5.0)
    answer.prediction, answer.cost.spent          # a PredictResponse
    batch = client.predict_batch("digits", [image_item(p) for p in pngs], total_budget=20.0)
    batch.cost.spent, [r.prediction for r in batch.results]
    [m.name for m in client.models().models]

Requests that fail to connect, or whose connection drops before an answer, are retried
(``retries`` times, with exponential back-off); an HTTP error answer never is: it raises
:class:`ServiceError` with the service's status, error type, message and details.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from service.schemas import BatchPredictResponse, PredictResponse

__all__ = [
    "BatchPredictResponse",
    "Client",
    "ModelInfo",
    "ModelList",
    "PredictResponse",
    "ServiceError",
    "image_item",
    "tabular_item",
]

M = TypeVar("M", bound=BaseModel)


class ServiceError(Exception):
    """The service answered with an error status (never retried)."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        details: dict[str, Any],
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{status} {type_}: {message}")
        self.status = status
        self.type = type_
        self.message = message
        self.details = details
        self.request_id = request_id  # the service's x-request-id: the key to its log line


class ModelInfo(BaseModel):
    """One loaded bundle, as ``GET /models`` lists it."""

    model_config = ConfigDict(extra="allow")

    name: str
    version: str
    classes: list[str]
    strategies: list[str]
    default_strategy: str
    cost_unit: str
    item: dict[str, Any]


class FailedModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    folder: str
    error: str


class ModelList(BaseModel):
    models: list[ModelInfo]
    failed: list[FailedModel] = Field(default_factory=list)


def image_item(png: bytes, item_id: str | None = None) -> dict[str, Any]:
    """An image item from PNG bytes."""
    item: dict[str, Any] = {"png_base64": base64.b64encode(png).decode()}
    if item_id is not None:
        item["id"] = item_id
    return item


def tabular_item(values: Mapping[str, float], item_id: str | None = None) -> dict[str, Any]:
    """A tabular item from the column values in hand."""
    item: dict[str, Any] = {"values": dict(values)}
    if item_id is not None:
        item["id"] = item_id
    return item


# Failures before any answer arrived: connecting failed, or the connection dropped.
_CONNECTION_ERRORS = (ConnectionError, http.client.RemoteDisconnected, socket.gaierror)


class Client:
    """``base_url``: where the service listens. ``timeout``: seconds per attempt.
    ``retries``: further attempts after a connection error, waiting ``backoff_s`` × 2^k."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
    ) -> None:
        if retries < 0 or backoff_s < 0 or timeout <= 0:
            raise ValueError(
                f"retries={retries}, backoff_s={backoff_s}, timeout={timeout}: retries and "
                "backoff_s must be >= 0 and timeout > 0"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s

    def predict(
        self,
        model: str,
        item: Mapping[str, Any],
        budget: float,
        *,
        strategy: str | None = None,
        size: int | None = None,
        version: str | None = None,
        accounting: str | None = None,
        request_id: str | None = None,
    ) -> PredictResponse:
        """One item under ``budget`` (in the model's cost unit). ``version``: one of the
        model's loaded versions (None: the newest); ``accounting``: ``"deadline"`` or
        ``"work"`` (None: the service's default); ``request_id``: sent as ``x-request-id``
        (the service's log line and trace carry it)."""
        body: dict[str, Any] = {"model": model, "item": dict(item), "budget": budget}
        optional = {
            "strategy": strategy,
            "size": size,
            "version": version,
            "accounting": accounting,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return self._call("POST", "/predict", PredictResponse, body, request_id)

    def predict_batch(
        self,
        model: str,
        items: Sequence[Mapping[str, Any]],
        *,
        budget: float | None = None,
        total_budget: float | None = None,
        strategy: str | None = None,
        version: str | None = None,
        request_id: str | None = None,
    ) -> BatchPredictResponse:
        """Several items: each with ``budget``, or all under ``total_budget`` (planned across
        the items by the service). Send exactly one of the two."""
        if (budget is None) == (total_budget is None):
            raise ValueError("pass exactly one of budget (each item's) and total_budget")
        body: dict[str, Any] = {"model": model, "items": [dict(i) for i in items]}
        if budget is not None:
            body["budget"] = budget
        else:
            body["total_budget"] = total_budget
        if strategy is not None:
            body["strategy"] = strategy
        if version is not None:
            body["version"] = version
        return self._call("POST", "/predict", BatchPredictResponse, body, request_id)

    def models(self) -> ModelList:
        """The loaded bundles, and those that failed to load."""
        return self._call("GET", "/models", ModelList)

    def model(self, name: str) -> dict[str, Any]:
        """One bundle's details (extractors, models, strategies, provenance)."""
        detail: dict[str, Any] = self._request("GET", f"/models/{_quote(name)}", None)
        return detail

    def ready(self) -> bool:
        """Whether the service is ready (at least one bundle loaded)."""
        try:
            return bool(self._request("GET", "/readyz", None)["ready"])
        except ServiceError as exc:
            if exc.status == 503:
                return False
            raise

    def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        body: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> M:
        return model.model_validate(self._request(method, path, body, request_id))

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, request_id: str | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if request_id is not None:
            headers["x-request-id"] = request_id
        attempt = 0
        while True:
            request = urllib.request.Request(
                self.base_url + path, data=data, method=method, headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                raise _service_error(exc) from None
            except (urllib.error.URLError, *_CONNECTION_ERRORS) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                if not isinstance(reason, _CONNECTION_ERRORS) or attempt >= self.retries:
                    raise
                time.sleep(self.backoff_s * 2**attempt)
                attempt += 1


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _service_error(exc: urllib.error.HTTPError) -> ServiceError:
    raw = exc.read()
    rid = exc.headers.get("x-request-id") if exc.headers is not None else None
    try:
        error = json.loads(raw)["error"]
        if isinstance(error, str):  # the Open Inference Protocol's shape
            return ServiceError(exc.code, "error", error, {}, rid)
        details = error.get("details", {})
        return ServiceError(exc.code, error["type"], error["message"], details, rid)
    except (ValueError, KeyError, TypeError):
        text = raw[:200].decode(errors="replace")
        return ServiceError(exc.code, "http_error", text, {}, rid)
