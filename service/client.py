"""A Python client of every budgetserve route, sync (:class:`Client`) and async
(:class:`AsyncClient`), with typed results.

Needs the ``client`` extra (``pip install 'budgetserve[client]'``: httpx and tenacity; no
FastAPI, ONNX Runtime or NumPy)::

    from service.client import Client, image_item

    with Client("http://127.0.0.1:8000", admin_token="s3cret") as client:
        answer = client.predict("digits", image_item(png_bytes), budget=5.0)
        answer.prediction, answer.cost.spent                       # a PredictResponse
        batch = client.predict_batch("digits", items, total_budget=20.0)
        client.skyline("digits", size=128 * 128)["skyline"]        # what each budget buys
        client.reload("digits")                                    # admin routes: the token
        client.v2_infer("digits", [{"name": "IMAGE", ...}], parameters={"budget": 5})

    async with AsyncClient("http://127.0.0.1:8000") as client:
        answer = await client.predict("digits", image_item(png_bytes), budget=5.0)

Routes: ``POST /predict`` (one item or a batch), ``GET /models[/{name}[/costs|/skyline]]``,
the admin routes (``POST /-/reload``, ``POST /models/{name}/reload``, ``DELETE
/models/{name}``), ``/healthz``, ``/readyz``, ``/metrics``, and the Open Inference Protocol's
REST routes (``/v2``: health, metadata, infer, config, statistics, the model repository).

Retries (tenacity): a request whose connection fails or drops before an answer, and a 503
that carries ``Retry-After`` (the service is overloaded: it refused the request before doing
any of its work), are sent again, up to ``retries`` more times, waiting ``Retry-After`` (at
most ``max_wait_s``) or else ``backoff_s`` × 2^k. Any other error answer is never retried: it
raises :class:`ServiceError` with the service's status, error type, message and details.
Predictions have no side effects, so sending one twice is safe.

The module stays whole (over 450 lines): :class:`Client` and :class:`AsyncClient` mirror
each other route by route over the shared request builders and error mapping (``_predict``,
``_error``, ``_Base``);
side by side, a route added to one is seen missing from the other.
"""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
)

from service.schemas import BatchPredictResponse, PredictResponse

__all__ = [
    "AsyncClient",
    "BatchPredictResponse",
    "Client",
    "ModelInfo",
    "ModelList",
    "PredictResponse",
    "ServiceError",
    "image_item",
    "tabular_item",
]

T = TypeVar("T")


class ServiceError(Exception):
    """The service answered with an error status."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        details: dict[str, Any],
        request_id: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{status} {type_}: {message}")
        self.status = status
        self.type = type_
        self.message = message
        self.details = details
        self.request_id = request_id  # the service's x-request-id: the key to its log line
        self.retry_after_s = retry_after_s  # a 503's Retry-After (overloaded), else None


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


# --- requests, built once for both clients ---------------------------------------------------


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    body: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    admin: bool = False
    request_id: str | None = None


def _json(response: httpx.Response) -> Any:
    return response.json()


def _model(cls: type[T]) -> Callable[[httpx.Response], T]:
    def parse(response: httpx.Response) -> T:
        return cls.model_validate_json(response.content)  # type: ignore[attr-defined,no-any-return]

    return parse


def _text(response: httpx.Response) -> str:
    return response.text


def _ok(response: httpx.Response) -> bool:
    return response.is_success


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _v2_model(name: str, version: str | None) -> str:
    path = f"/v2/models/{_q(name)}"
    return path if version is None else f"{path}/versions/{_q(version)}"


def _predict(
    model: str,
    item: Mapping[str, Any],
    budget: float,
    strategy: str | None,
    size: int | None,
    version: str | None,
    accounting: str | None,
    request_id: str | None,
) -> Call[PredictResponse]:
    body: dict[str, Any] = {"model": model, "item": dict(item), "budget": budget}
    optional = {"strategy": strategy, "size": size, "version": version, "accounting": accounting}
    body.update({k: v for k, v in optional.items() if v is not None})
    return Call("POST", "/predict", _model(PredictResponse), body, request_id=request_id)


def _predict_batch(
    model: str,
    items: Sequence[Mapping[str, Any]],
    budget: float | None,
    total_budget: float | None,
    strategy: str | None,
    version: str | None,
    request_id: str | None,
) -> Call[BatchPredictResponse]:
    if (budget is None) == (total_budget is None):
        raise ValueError("pass exactly one of budget (each item's) and total_budget")
    body: dict[str, Any] = {"model": model, "items": [dict(i) for i in items]}
    optional = {
        "budget": budget,
        "total_budget": total_budget,
        "strategy": strategy,
        "version": version,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return Call("POST", "/predict", _model(BatchPredictResponse), body, request_id=request_id)


def _v2_infer(
    model: str,
    inputs: Sequence[Mapping[str, Any]],
    parameters: Mapping[str, Any],
    outputs: Sequence[str] | None,
    version: str | None,
    request_id: str | None,
) -> Call[dict[str, Any]]:
    body: dict[str, Any] = {"inputs": [dict(i) for i in inputs], "parameters": dict(parameters)}
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    path = _v2_model(model, version) + "/infer"
    return Call("POST", path, _json, body, request_id=request_id)


def _error(response: httpx.Response) -> ServiceError:
    """The service's error answer (its own shape, or the protocol's ``{"error": str}``)."""
    rid = response.headers.get("x-request-id")
    retry_after: float | None = None
    raw_retry = response.headers.get("retry-after")
    if raw_retry is not None:
        try:
            retry_after = max(0.0, float(raw_retry))
        except ValueError:
            retry_after = None  # an HTTP date: not what this service sends
    try:
        error = response.json()["error"]
        if isinstance(error, str):
            return ServiceError(response.status_code, "error", error, {}, rid, retry_after)
        details = error.get("details", {})
        return ServiceError(
            response.status_code, error["type"], error["message"], details, rid, retry_after
        )
    except (ValueError, KeyError, TypeError):
        text = response.content[:200].decode(errors="replace")
        return ServiceError(response.status_code, "http_error", text, {}, rid, retry_after)


#: Failures before any answer arrived: connecting failed, or the connection dropped.
_TRANSPORT = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ServiceError):
        return exc.status == 503 and exc.retry_after_s is not None
    return isinstance(exc, _TRANSPORT)


class _Base:
    """What both clients share: settings, headers, the retry policy and the routes' calls."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        retries: int,
        backoff_s: float,
        max_wait_s: float,
        admin_token: str | None,
    ) -> None:
        if retries < 0 or backoff_s < 0 or timeout <= 0 or max_wait_s < 0:
            raise ValueError(
                f"retries={retries}, backoff_s={backoff_s}, timeout={timeout}, "
                f"max_wait_s={max_wait_s}: retries, backoff_s and max_wait_s must be >= 0 "
                "and timeout > 0"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_wait_s = max_wait_s
        self.admin_token = admin_token

    def _wait(self, state: RetryCallState) -> float:
        """Retry-After when the service gave one (at most max_wait_s), else exponential."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, ServiceError) and exc.retry_after_s is not None:
            return min(exc.retry_after_s, self.max_wait_s)
        return float(self.backoff_s * 2 ** (state.attempt_number - 1))

    def _policy(self) -> dict[str, Any]:
        return {
            "stop": stop_after_attempt(self.retries + 1),
            "wait": self._wait,
            "retry": retry_if_exception(_retryable),
            "reraise": True,
        }

    def _headers(self, call: Call[Any]) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if call.request_id is not None:
            headers["x-request-id"] = call.request_id
        if call.admin and self.admin_token is not None:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        return headers


class Client(_Base):
    """The sync client. ``base_url``: where the service listens; ``timeout``: seconds per
    attempt; ``retries``: further attempts (see the module); ``admin_token``: for the admin
    and repository routes. A context manager (closes its connection pool)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_wait_s: float = 30.0,
        admin_token: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout=timeout,
            retries=retries,
            backoff_s=backoff_s,
            max_wait_s=max_wait_s,
            admin_token=admin_token,
        )
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, transport=transport, trust_env=False
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: Call[T], check: bool = True) -> T:
        response = None
        for attempt in Retrying(**self._policy()):
            with attempt:
                response = self._http.request(
                    call.method,
                    call.path,
                    json=call.body,
                    params=call.params or None,
                    headers=self._headers(call),
                )
                if check and response.is_error:
                    raise _error(response)
        assert response is not None
        return call.parse(response)

    # /predict
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
        ``"work"`` (None: the service's default); ``request_id``: sent as ``x-request-id``."""
        return self._send(
            _predict(model, item, budget, strategy, size, version, accounting, request_id)
        )

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
        return self._send(
            _predict_batch(model, items, budget, total_budget, strategy, version, request_id)
        )

    # /models
    def models(self) -> ModelList:
        """The loaded bundles, and those that failed to load."""
        return self._send(Call("GET", "/models", _model(ModelList)))

    def model(self, name: str) -> dict[str, Any]:
        """One bundle's details (extractors, models, strategies, provenance)."""
        return self._send(Call("GET", f"/models/{_q(name)}", _json))

    def costs(self, name: str) -> dict[str, Any]:
        """Profiled and live-calibrated cost curves of every extractor of ``name``."""
        return self._send(Call("GET", f"/models/{_q(name)}/costs", _json))

    def skyline(self, name: str, size: int, strategy: str | None = None) -> dict[str, Any]:
        """What each budget buys at item size ``size`` (cost, accuracy, features)."""
        params: dict[str, Any] = {"size": size}
        if strategy is not None:
            params["strategy"] = strategy
        return self._send(Call("GET", f"/models/{_q(name)}/skyline", _json, params=params))

    # admin (Authorization: Bearer admin_token)
    def reload(self, name: str | None = None) -> dict[str, Any]:
        """Load ``name``'s folder again (None: every folder); what loaded, failed, unloaded."""
        path = "/-/reload" if name is None else f"/models/{_q(name)}/reload"
        return self._send(Call("POST", path, _json, admin=True))

    def unload(self, name: str) -> dict[str, Any]:
        """Stop serving ``name`` (every version) until its folder is loaded again."""
        return self._send(Call("DELETE", f"/models/{_q(name)}", _json, admin=True))

    # health and metrics
    def healthy(self) -> bool:
        """Whether the process answers (``/healthz``)."""
        return self._send(Call("GET", "/healthz", _ok), check=False)

    def ready(self) -> bool:
        """Whether the service is ready (at least one bundle loaded; ``/readyz``)."""
        return self._send(Call("GET", "/readyz", _ok), check=False)

    def metrics(self) -> str:
        """The Prometheus text exposition."""
        return self._send(Call("GET", "/metrics", _text))

    # the Open Inference Protocol (REST)
    def v2_server_metadata(self) -> dict[str, Any]:
        return self._send(Call("GET", "/v2", _json))

    def v2_live(self) -> bool:
        return self._send(Call("GET", "/v2/health/live", _ok), check=False)

    def v2_ready(self) -> bool:
        return self._send(Call("GET", "/v2/health/ready", _ok), check=False)

    def v2_model_ready(self, name: str, version: str | None = None) -> bool:
        return self._send(Call("GET", _v2_model(name, version) + "/ready", _ok), check=False)

    def v2_model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        return self._send(Call("GET", _v2_model(name, version), _json))

    def v2_model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return self._send(Call("GET", _v2_model(name, version) + "/config", _json))

    def v2_statistics(self, name: str | None = None) -> dict[str, Any]:
        path = "/v2/models/stats" if name is None else _v2_model(name, None) + "/stats"
        return self._send(Call("GET", path, _json))

    def v2_infer(
        self,
        model: str,
        inputs: Sequence[Mapping[str, Any]],
        parameters: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        version: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """An inference request: ``inputs`` as the protocol's JSON tensors, ``parameters``
        with ``budget`` or ``total_budget`` (docs/open-inference-protocol.md)."""
        return self._send(_v2_infer(model, inputs, parameters, outputs, version, request_id))

    def v2_repository_index(self, ready: bool = False) -> list[dict[str, Any]]:
        return self._send(Call("POST", "/v2/repository/index", _json, {"ready": ready}))

    def v2_load(self, name: str) -> dict[str, Any]:
        path = f"/v2/repository/models/{_q(name)}/load"
        return self._send(Call("POST", path, _json, admin=True))

    def v2_unload(self, name: str) -> dict[str, Any]:
        path = f"/v2/repository/models/{_q(name)}/unload"
        return self._send(Call("POST", path, _json, admin=True))


class AsyncClient(_Base):
    """The async client (asyncio or trio, through httpx): the same routes, arguments and
    retries as :class:`Client`, each a coroutine."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_wait_s: float = 30.0,
        admin_token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout=timeout,
            retries=retries,
            backoff_s=backoff_s,
            max_wait_s=max_wait_s,
            admin_token=admin_token,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, transport=transport, trust_env=False
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call[T], check: bool = True) -> T:
        response = None
        async for attempt in AsyncRetrying(**self._policy()):
            with attempt:
                response = await self._http.request(
                    call.method,
                    call.path,
                    json=call.body,
                    params=call.params or None,
                    headers=self._headers(call),
                )
                if check and response.is_error:
                    raise _error(response)
        assert response is not None
        return call.parse(response)

    async def predict(
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
        return await self._send(
            _predict(model, item, budget, strategy, size, version, accounting, request_id)
        )

    async def predict_batch(
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
        return await self._send(
            _predict_batch(model, items, budget, total_budget, strategy, version, request_id)
        )

    async def models(self) -> ModelList:
        return await self._send(Call("GET", "/models", _model(ModelList)))

    async def model(self, name: str) -> dict[str, Any]:
        return await self._send(Call("GET", f"/models/{_q(name)}", _json))

    async def costs(self, name: str) -> dict[str, Any]:
        return await self._send(Call("GET", f"/models/{_q(name)}/costs", _json))

    async def skyline(self, name: str, size: int, strategy: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"size": size}
        if strategy is not None:
            params["strategy"] = strategy
        return await self._send(Call("GET", f"/models/{_q(name)}/skyline", _json, params=params))

    async def reload(self, name: str | None = None) -> dict[str, Any]:
        path = "/-/reload" if name is None else f"/models/{_q(name)}/reload"
        return await self._send(Call("POST", path, _json, admin=True))

    async def unload(self, name: str) -> dict[str, Any]:
        return await self._send(Call("DELETE", f"/models/{_q(name)}", _json, admin=True))

    async def healthy(self) -> bool:
        return await self._send(Call("GET", "/healthz", _ok), check=False)

    async def ready(self) -> bool:
        return await self._send(Call("GET", "/readyz", _ok), check=False)

    async def metrics(self) -> str:
        return await self._send(Call("GET", "/metrics", _text))

    async def v2_server_metadata(self) -> dict[str, Any]:
        return await self._send(Call("GET", "/v2", _json))

    async def v2_live(self) -> bool:
        return await self._send(Call("GET", "/v2/health/live", _ok), check=False)

    async def v2_ready(self) -> bool:
        return await self._send(Call("GET", "/v2/health/ready", _ok), check=False)

    async def v2_model_ready(self, name: str, version: str | None = None) -> bool:
        path = _v2_model(name, version) + "/ready"
        return await self._send(Call("GET", path, _ok), check=False)

    async def v2_model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        return await self._send(Call("GET", _v2_model(name, version), _json))

    async def v2_model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return await self._send(Call("GET", _v2_model(name, version) + "/config", _json))

    async def v2_statistics(self, name: str | None = None) -> dict[str, Any]:
        path = "/v2/models/stats" if name is None else _v2_model(name, None) + "/stats"
        return await self._send(Call("GET", path, _json))

    async def v2_infer(
        self,
        model: str,
        inputs: Sequence[Mapping[str, Any]],
        parameters: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        version: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(_v2_infer(model, inputs, parameters, outputs, version, request_id))

    async def v2_repository_index(self, ready: bool = False) -> list[dict[str, Any]]:
        return await self._send(Call("POST", "/v2/repository/index", _json, {"ready": ready}))

    async def v2_load(self, name: str) -> dict[str, Any]:
        path = f"/v2/repository/models/{_q(name)}/load"
        return await self._send(Call("POST", path, _json, admin=True))

    async def v2_unload(self, name: str) -> dict[str, Any]:
        path = f"/v2/repository/models/{_q(name)}/unload"
        return await self._send(Call("POST", path, _json, admin=True))
