"""The Open Inference Protocol (KServe v2 / Triton) REST routes.

``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}[/versions/{v}]``,
``/v2/models/{name}[/versions/{v}]/ready`` and ``POST /v2/models/{name}[/versions/{v}]/infer``.
How a budgetserve request maps onto the protocol (docs/open-inference-protocol.md has the same
table):

* **Budget and strategy**: request ``parameters``: ``budget`` (each item's) or
  ``total_budget`` (the batch's, planned across its items as ``POST /predict`` does), in the
  model's cost unit, ``strategy`` (optional) and ``accounting`` (optional, ``deadline`` or
  ``work``, as in ``POST /predict``; a single item's deadline counts from the receipt);
  with ``budget``, ``budget_mode`` and ``max_cost`` (each item's, as in ``POST /predict``);
  ``tolerance`` (each item's, as in ``POST /predict``).
* **Items**: the first dimension of the inputs is the batch. Image models take ``IMAGE`` as
  ``BYTES`` ``[B]`` (each element a PNG: base64 text in JSON, raw bytes as binary data) or as
  ``FP32``/``FP64`` ``[B, H, W]`` / ``[H, W]`` gray levels in [0, 1] (``UINT8``: 0..255),
  encoded losslessly to a 16-bit PNG (8-bit for UINT8). Tabular models take one input per
  column (named as the column, shape ``[B]`` or ``[B, 1]``, any numeric datatype), or
  ``VALUES`` ``[B, C]`` with ``parameters.columns`` naming the C columns (comma-separated;
  default: all of the model's columns in order; a NaN, possible in binary data, is a value
  not sent). Models of other item kinds (OCR words, parser sentences) take ``ITEM`` ``BYTES
  [B]``, each element the item as a JSON document (what ``POST /predict`` takes as
  ``item``). Optional ``ID`` ``BYTES`` ``[B]``: the items' ids.
* **Outputs**: ``PREDICTION`` ``BYTES [B]``, ``PROBABILITIES`` ``FP32 [B, K]`` (columns in
  the order of ``CLASSES`` ``BYTES [K]``), ``EXPECTED_ACCURACY`` ``FP32 [B]``,
  ``COST_SPENT`` and ``COST_BUDGET`` ``FP32 [B]`` (in the unit of the response's
  ``parameters.cost_unit``), and ``RESPONSE`` ``BYTES [B]``: each item's full
  ``POST /predict`` answer as JSON (the cost report, features, strategy decisions). The
  response ``parameters`` hold ``cost_unit``, ``spent`` (all items) and the budget sent.
  Outputs are always JSON (``binary_data`` output requests are answered in JSON, which
  every protocol client reads); binary *input* data (``Inference-Header-Content-Length``)
  is read.
* **Errors**: ``{"error": "..."}``: 400 for a request the protocol cannot read (bad JSON,
  shapes, datatypes, missing budget), 404 unknown model or version, and the statuses of
  ``POST /predict`` otherwise (422 an item the model cannot read, 413, 503).

Versions: every version loaded side by side (``models/<name>/<version>/``) is listed, the
newest answers by default; :func:`resolve` is the one place that maps (name, version) to a
loaded bundle.

The module stays whole (over 450 lines): it is the protocol's one mapping, routes and the
tensor conversions both ways, each of which reads the others' datatype and shape rules.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import anyio.to_thread
import numpy as np
import numpy.typing as npt
from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from PIL import Image
from pydantic import BaseModel, ValidationError

from service import errors
from service.batch import predict_batch
from service.http.admin import AuthHeader
from service.http.admin import _manager as admin_manager
from service.http.errors import documented, status_of
from service.http.middleware import received_at
from service.http.state import AppState, app_state
from service.http.v2_schemas import (
    DATATYPES,
    InferenceRequest,
    InferenceResponse,
    Live,
    MetadataTensor,
    ModelMetadata,
    ModelReady,
    Ready,
    RequestInput,
    ResponseOutput,
    ServerMetadata,
    V2Error,
    inline_schema,
)
from service.metrics import UNKNOWN_MODEL
from service.registry import Bundle, Registry, bundle_folders
from service.schemas import PredictResponse

State = Annotated[AppState, Depends(app_state)]
Credentials = HTTPAuthorizationCredentials | None

SERVER_NAME = "budgetserve"
SERVER_VERSION = "0.1.0"
HEADER_LENGTH = "inference-header-content-length"
#: The protocol extensions served (Triton's names), over REST and gRPC.
EXTENSIONS = (
    "binary_tensor_data",
    "parameters",
    "model_repository",
    "model_configuration",
    "statistics",
)

OUTPUTS = (
    "PREDICTION",
    "PROBABILITIES",
    "CLASSES",
    "EXPECTED_ACCURACY",
    "COST_SPENT",
    "COST_BUDGET",
    "RESPONSE",
)

_NUMPY: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype of a numeric protocol datatype."""
    return np.dtype(_NUMPY[datatype])


class ProtocolError(errors.BudgetServeError):
    """An inference request the protocol cannot read: 400."""

    code = "bad_request"


def resolve(registry: Registry, name: str, version: str | None) -> Bundle:
    """The loaded bundle serving ``name`` at ``version`` (None: the newest one).

    Raises ``ModelNotFound`` / ``ModelNotReady`` / ``VersionNotFound`` (as ``Registry.get``)."""
    return registry.get(name, version)


def protocol_status(exc: errors.BudgetServeError) -> int:
    """The HTTP status of ``exc`` under the protocol (``service.grpc_api`` maps it on to a
    gRPC code): 400 a request it cannot read, else the app's own."""
    if isinstance(exc, ProtocolError):
        return 400
    if isinstance(exc, errors.VersionNotFound):
        return 404
    return status_of(exc)


def v2_error(exc: errors.BudgetServeError) -> JSONResponse:
    status = protocol_status(exc)
    headers = (
        {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, errors.Overloaded) else None
    )
    return JSONResponse({"error": exc.message}, status_code=status, headers=headers)


# --- health and metadata ------------------------------------------------------------------


async def server_metadata() -> ServerMetadata:
    return ServerMetadata(name=SERVER_NAME, version=SERVER_VERSION, extensions=list(EXTENSIONS))


async def live() -> Live:
    return Live(live=True)


async def ready(state: State) -> JSONResponse:
    return JSONResponse(
        Ready(ready=state.ready).model_dump(), status_code=200 if state.ready else 400
    )


async def model_metadata(name: str, state: State) -> JSONResponse:
    return await version_metadata(name, None, state)


async def version_metadata(name: str, version: str | None, state: State) -> JSONResponse:
    try:
        meta = metadata_of(state.loaded_registry(), name, version)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse(meta.model_dump(exclude_none=True))


async def model_ready(name: str, state: State) -> JSONResponse:
    return await version_ready(name, None, state)


async def version_ready(name: str, version: str | None, state: State) -> JSONResponse:
    try:
        resolve(state.loaded_registry(), name, version)
    except errors.ModelNotReady:
        return JSONResponse(ModelReady(name=name, ready=False).model_dump(), status_code=400)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse(ModelReady(name=name, ready=True).model_dump())


def _metadata(bundle: Bundle, versions: list[str]) -> ModelMetadata:
    m = bundle.manifest
    if m.item.kind == "tabular":
        inputs = [MetadataTensor(name=c, datatype="FP32", shape=[-1]) for c in m.item.columns]
        inputs.append(
            MetadataTensor(name="VALUES", datatype="FP32", shape=[-1, len(m.item.columns)])
        )
    elif m.item.kind == "image":
        inputs = [MetadataTensor(name="IMAGE", datatype="BYTES", shape=[-1])]
    else:
        inputs = [MetadataTensor(name="ITEM", datatype="BYTES", shape=[-1])]
    inputs.append(MetadataTensor(name="ID", datatype="BYTES", shape=[-1]))
    k = len(m.classes)
    outputs = [
        MetadataTensor(name="PREDICTION", datatype="BYTES", shape=[-1]),
        MetadataTensor(name="PROBABILITIES", datatype="FP32", shape=[-1, k]),
        MetadataTensor(name="CLASSES", datatype="BYTES", shape=[k]),
        MetadataTensor(name="EXPECTED_ACCURACY", datatype="FP32", shape=[-1]),
        MetadataTensor(name="COST_SPENT", datatype="FP32", shape=[-1]),
        MetadataTensor(name="COST_BUDGET", datatype="FP32", shape=[-1]),
        MetadataTensor(name="RESPONSE", datatype="BYTES", shape=[-1]),
    ]
    return ModelMetadata(
        name=m.name,
        versions=versions,
        platform="budgetserve",
        inputs=inputs,
        outputs=outputs,
        parameters={
            "cost_unit": m.cost_unit,
            "item_kind": m.item.kind,
            "default_strategy": m.default_strategy,
            "strategies": ",".join(s.name for s in m.strategies),
        },
    )


def metadata_of(registry: Registry, name: str, version: str | None) -> ModelMetadata:
    """The protocol's model metadata of ``name`` at ``version`` (None: the newest)."""
    bundle = resolve(registry, name, version)
    versions = list(registry.versions.get(name) or [bundle.manifest.version])
    return _metadata(bundle, versions)


# --- model configuration and statistics (Triton's extensions) -------------------------------


def config_of(registry: Registry, name: str, version: str | None) -> dict[str, Any]:
    """Triton's model configuration (``model_config.proto``'s JSON form) of ``name``: the
    protocol's inputs and outputs (as ``GET /v2/models/{name}`` gives them), every loaded
    version served (``version_policy.all``), no server-side batching (``max_batch_size`` 0:
    the first dimension of each input is the batch, planned by budgetserve), and the
    bundle's cost unit, strategies and version label in ``parameters``."""
    bundle = resolve(registry, name, version)
    meta = _metadata(bundle, [])
    m = bundle.manifest

    def data_type(datatype: str) -> str:
        return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"

    parameters = {k: str(v) for k, v in (meta.parameters or {}).items()}
    parameters["version"] = version if version is not None else version_label(bundle)
    parameters["manifest_version"] = m.version
    return {
        "name": m.name,
        "platform": "budgetserve",
        "backend": "budgetserve",
        "version_policy": {"all": {}},
        "max_batch_size": 0,
        "input": [
            {
                "name": t.name,
                "data_type": data_type(t.datatype),
                "dims": t.shape,
                **(
                    {"optional": True}
                    if t.name in ("ID", "VALUES") or m.item.kind == "tabular"
                    else {}
                ),
            }
            for t in meta.inputs
        ],
        "output": [
            {"name": t.name, "data_type": data_type(t.datatype), "dims": t.shape}
            for t in meta.outputs
        ],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }


def _duration(count: float | None, seconds: float | None) -> dict[str, int]:
    return {"count": int(count or 0), "ns": int((seconds or 0.0) * 1e9)}


def statistics_of(state: AppState, name: str | None, version: str | None) -> dict[str, Any]:
    """Triton's inference statistics of ``name`` (None: every loaded model) from this
    process's Prometheus metrics, which ``POST /predict`` and both protocols update: success
    and fail are requests answered and refused (``fail.ns`` 0: refusals are not timed
    apart; ``success.ns`` is the wall time of every request, ``request_duration_seconds``),
    ``compute_infer`` the model inferences, ``cache_hit``/``cache_miss`` 0 (the feature
    cache is per feature, not per request: ``budgetserve_cache_requests_total``);
    ``inference_count`` the items answered and ``execution_count`` the requests. Metrics are
    per model, not per version: each entry names the version that serves by default."""
    registry = state.loaded_registry()
    if name is None:
        names = sorted(registry.bundles)
    else:
        resolve(registry, name, version)
        names = [name]
    sample = state.metrics.registry.get_sample_value
    out = []
    for n in names:
        ok = sample("budgetserve_requests_total", {"model": n, "status": "ok"}) or 0.0
        every = sum(
            s.value
            for metric in state.metrics.requests.collect()
            for s in metric.samples
            if s.name.endswith("_total") and s.labels.get("model") == n
        )
        items = sample("budgetserve_budget_utilisation_ratio_count", {"model": n})
        out.append(
            {
                "name": n,
                "version": version or version_label(registry.bundles[n]),
                "last_inference": 0,
                "inference_count": int(items or 0),
                "execution_count": int(ok),
                "inference_stats": {
                    "success": _duration(
                        ok, sample("budgetserve_request_duration_seconds_sum", {"model": n})
                    ),
                    "fail": _duration(every - ok, 0.0),
                    "queue": _duration(0, 0.0),
                    "compute_input": _duration(0, 0.0),
                    "compute_infer": _duration(
                        sample("budgetserve_inference_seconds_count", {"model": n}),
                        sample("budgetserve_inference_seconds_sum", {"model": n}),
                    ),
                    "compute_output": _duration(0, 0.0),
                    "cache_hit": _duration(0, 0.0),
                    "cache_miss": _duration(0, 0.0),
                },
            }
        )
    return {"model_stats": out}


async def model_config(name: str, state: State) -> JSONResponse:
    return await version_config(name, None, state)


async def version_config(name: str, version: str | None, state: State) -> JSONResponse:
    try:
        return JSONResponse(config_of(state.loaded_registry(), name, version))
    except errors.BudgetServeError as exc:
        return v2_error(exc)


async def all_stats(state: State) -> JSONResponse:
    return await version_stats(None, None, state)


async def model_stats(name: str, state: State) -> JSONResponse:
    return await version_stats(name, None, state)


async def version_stats(name: str | None, version: str | None, state: State) -> JSONResponse:
    try:
        return JSONResponse(statistics_of(state, name, version))
    except errors.BudgetServeError as exc:
        return v2_error(exc)


# --- the model repository extension ---------------------------------------------------------


def repository_index(state: AppState, ready_only: bool) -> list[dict[str, str]]:
    """Every model of the repository (``BUDGETSERVE_MODELS_DIR``): each loaded version
    ``READY``; each folder that failed to load, or that holds bundles not loaded (never, or
    unloaded), ``UNAVAILABLE`` with the reason. ``ready_only``: the ready ones only."""
    registry = state.loaded_registry()
    index: list[dict[str, str]] = []
    for name in sorted(registry.bundles):
        for label in registry.versions.get(name) or [registry.bundles[name].manifest.version]:
            index.append({"name": name, "version": label, "state": "READY", "reason": ""})
    if ready_only:
        return index
    listed = set(registry.bundles)
    for failure in sorted(registry.failures, key=lambda f: (f.name, f.folder)):
        _, _, label = failure.folder.partition("/")
        index.append(
            {
                "name": failure.name,
                "version": label,
                "state": "UNAVAILABLE",
                "reason": failure.reason,
            }
        )
        listed.add(failure.name)
    for folder in bundle_folders(state.settings.models_dir):
        if folder not in listed and folder not in registry.owners.values():
            index.append(
                {"name": folder, "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
            )
    return index


async def repository_load(state: AppState, name: str, credentials: Credentials) -> None:
    """Load (or load again) the folder serving ``name``: ``POST /models/{name}/reload``. A
    failure is a protocol error naming the reason (the previous version, if any, still
    serves)."""
    manager = admin_manager(state, credentials)
    report = await manager.reload(name)
    if not (report.loaded or report.failed or report.unloaded):
        raise errors.ModelNotFound(name, sorted(manager.registry.bundles))
    if report.failed:
        reasons = "; ".join(f"{f['folder']}: {f['error']}" for f in report.failed)
        raise ProtocolError(f"failed to load {name!r}: {reasons}")


async def repository_unload(state: AppState, name: str, credentials: Credentials) -> None:
    """Stop serving ``name``: ``DELETE /models/{name}``."""
    manager = admin_manager(state, credentials)
    if not await manager.unload(name):
        raise errors.ModelNotFound(name, sorted(manager.registry.bundles))


class IndexRequest(BaseModel):
    ready: bool = False


async def repository_index_route(state: State, request: Request) -> JSONResponse:
    try:
        raw = await request.body()
        try:
            body = IndexRequest.model_validate_json(raw) if raw.strip() else IndexRequest()
        except ValidationError as exc:
            raise ProtocolError(
                f"invalid repository index request: {exc.errors()[0]['msg']}"
            ) from None
        index = await anyio.to_thread.run_sync(repository_index, state, body.ready)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse(index)


async def repository_load_route(
    name: str, state: State, authorization: AuthHeader = None
) -> JSONResponse:
    try:
        await repository_load(state, name, authorization)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse({"name": name, "load": True})


async def repository_unload_route(
    name: str, state: State, authorization: AuthHeader = None
) -> JSONResponse:
    try:
        await repository_unload(state, name, authorization)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse({"name": name, "unload": True})


# --- inference ------------------------------------------------------------------------------


async def infer(name: str, request: Request, state: State) -> JSONResponse:
    return await version_infer(name, None, request, state)


async def version_infer(
    name: str, version: str | None, request: Request, state: State
) -> JSONResponse:
    # The request's log line and span (service.http.requestlog), as /predict writes them.
    summary: dict[str, Any] = {"model": name, "version": version}
    request.state.summary = summary

    async def read() -> tuple[InferenceRequest, list[bytes | None]]:
        return parse_request(await request.body(), request.headers.get(HEADER_LENGTH))

    try:
        body = await observed_infer(state, name, version, read, received_at(request.scope), summary)
    except errors.BudgetServeError as exc:
        return v2_error(exc)
    return JSONResponse(body.model_dump(exclude_none=True))


Reader = Callable[[], Awaitable[tuple[InferenceRequest, list[bytes | None]]]]


async def observed_infer(
    state: AppState,
    name: str,
    version: str | None,
    read: Reader,
    received: float | None,
    summary: dict[str, Any],
) -> InferenceResponse:
    """One inference request of either transport (REST here, gRPC in
    ``service.grpc_api``), timed and counted in the same metrics as ``POST /predict``;
    ``read`` gives the request and each input's binary data. Raises the taxonomy's errors,
    counted (and noted in ``summary``) by their code."""
    registry = state.loaded_registry()
    label = name if name in registry.bundles else UNKNOWN_MODEL
    metrics = state.metrics
    try:
        with metrics.child(metrics.request_latency, model=label).time():
            req, binary = await read()
            body = await run_infer(state, name, version, req, binary, received, summary)
    except errors.BudgetServeError as exc:
        metrics.child(metrics.requests, model=label, status=exc.code).inc()
        summary["outcome"] = exc.code
        raise
    metrics.child(metrics.requests, model=label, status="ok").inc()
    return body


async def run_infer(
    state: AppState,
    name: str,
    version: str | None,
    req: InferenceRequest,
    binary: list[bytes | None],
    received: float | None,
    summary: dict[str, Any],
) -> InferenceResponse:
    """Answer a parsed inference request through the predict handler (one item: its
    deadline counts from ``received``; several: planned as ``POST /predict``'s batches)."""
    registry = state.loaded_registry()
    bundle = resolve(registry, name, version)
    handler = state.loaded_handler()
    params = req.parameters or {}
    budget = _number(params, "budget")
    total = _number(params, "total_budget")
    if (budget is None) == (total is None):
        raise ProtocolError(
            "send exactly one of parameters.budget (each item's budget) and "
            f"parameters.total_budget (the batch's), in the model's cost unit "
            f"({bundle.manifest.cost_unit})"
        )
    strategy = params.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise ProtocolError(f"parameters.strategy must be a string, got {strategy!r}")
    accounting = params.get("accounting")
    if accounting is not None and not isinstance(accounting, str):
        raise ProtocolError(f"parameters.accounting must be a string, got {accounting!r}")
    budget_mode = params.get("budget_mode")
    if budget_mode is not None and not isinstance(budget_mode, str):
        raise ProtocolError(f"parameters.budget_mode must be a string, got {budget_mode!r}")
    max_cost = _number(params, "max_cost")
    tolerance = params.get("tolerance")
    if tolerance is not None and (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not 0 <= tolerance <= 1
    ):
        raise ProtocolError(f"parameters.tolerance must be a number in [0, 1], got {tolerance!r}")
    summary.update(strategy=strategy, budget=budget, total_budget=total)
    wanted = _requested(req)
    items = to_items(bundle, req.inputs, binary)
    if budget is not None and len(items) == 1:
        response, writes = await handler.predict(
            name,
            items[0],
            None,
            budget,
            strategy,
            version=version,
            accounting=accounting,
            tolerance=tolerance,
            budget_mode=budget_mode,
            max_cost=max_cost,
            received=received,
        )
        await handler.write_back(writes)
        results = [response]
        summary.update(
            strategy=response.strategy,
            model_version=response.model_version,
            cached=response.cost.cached,
            extracted=response.cost.extracted,
            deadline_exceeded=response.deadline_exceeded,
        )
    else:
        outcome = await predict_batch(
            handler,
            name,
            items,
            strategy,
            budget=budget,
            total_budget=total,
            version=version,
            tolerance=tolerance,
            budget_mode=budget_mode,
            max_cost=max_cost,
        )
        results = outcome.responses
        summary["items"] = len(results)
    summary.update(
        spent=sum(r.cost.spent for r in results), unit=results[0].cost.unit, outcome="ok"
    )
    answered = version if version is not None else version_label(bundle)
    return _response(bundle, answered, req, results, wanted, budget, total)


def version_label(bundle: Bundle) -> str:
    """The version label (the version folder's name; the manifest's version in the flat
    layout) under which ``bundle`` serves."""
    return bundle.label or bundle.manifest.version


def _number(params: dict[str, Any], key: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"parameters.{key} must be a finite number, got {value!r}")
    if value <= 0:
        raise ProtocolError(f"parameters.{key} must be > 0, got {value!r}")
    return float(value)


def _requested(req: InferenceRequest) -> list[str]:
    if not req.outputs:
        return list(OUTPUTS)
    names = [o.name for o in req.outputs]
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown:
        raise ProtocolError(
            f"unknown output(s) {', '.join(map(repr, unknown))}; "
            f"this model has {', '.join(OUTPUTS)}"
        )
    return names


def parse_request(
    raw: bytes, header_length: str | None
) -> tuple[InferenceRequest, list[bytes | None]]:
    """The request's JSON part, validated, and each input's binary data (None: in JSON)."""
    if header_length is None:
        head, rest = raw, b""
    else:
        if not header_length.isdigit() or not 0 < int(header_length) <= len(raw):
            raise ProtocolError(
                f"Inference-Header-Content-Length is {header_length!r}; it must be the byte "
                f"length of the JSON part, between 1 and the body's {len(raw)} bytes"
            )
        head, rest = raw[: int(header_length)], raw[int(header_length) :]
    try:
        doc = json.loads(head)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the inference request is not valid JSON: {exc}") from None
    try:
        req = InferenceRequest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise ProtocolError(f"invalid inference request: {problems}") from None
    binary: list[bytes | None] = []
    offset = 0
    for inp in req.inputs:
        size = (inp.parameters or {}).get("binary_data_size")
        if size is None:
            if inp.data is None:
                raise ProtocolError(f"input {inp.name!r} has neither data nor binary_data_size")
            binary.append(None)
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ProtocolError(f"input {inp.name!r}: binary_data_size must be an integer >= 0")
        if offset + size > len(rest):
            raise ProtocolError(
                f"input {inp.name!r} declares {size} bytes of binary data; only "
                f"{len(rest) - offset} follow the JSON part"
            )
        binary.append(rest[offset : offset + size])
        offset += size
    if offset != len(rest):
        raise ProtocolError(
            f"{len(rest) - offset} bytes follow the inputs' binary data; send exactly the "
            "binary_data_size of each input"
        )
    return req, binary


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        out: list[Any] = []
        for d in data:
            out.extend(_flatten(d))
        return out
    return [data]


def tensor(inp: RequestInput, binary: bytes | None) -> npt.NDArray[Any]:
    """The input's elements as an array of its shape (``BYTES``: an object array of bytes)."""
    if inp.datatype not in DATATYPES:
        raise ProtocolError(
            f"input {inp.name!r} has datatype {inp.datatype!r}; use one of {', '.join(DATATYPES)}"
        )
    if any(d < 0 for d in inp.shape):
        raise ProtocolError(f"input {inp.name!r} has shape {inp.shape}; dimensions must be >= 0")
    count = math.prod(inp.shape)
    if inp.datatype == "BYTES":
        elements = _bytes_elements(inp, binary)
        array: npt.NDArray[Any] = np.empty(len(elements), dtype=object)
        array[:] = elements
    elif binary is not None:
        dtype = np.dtype(_NUMPY[inp.datatype])
        if len(binary) != count * dtype.itemsize:
            raise ProtocolError(
                f"input {inp.name!r}: {len(binary)} bytes of binary data for shape {inp.shape} "
                f"of {inp.datatype} ({count * dtype.itemsize} expected)"
            )
        array = np.frombuffer(binary, dtype=dtype)
    else:
        flat = _flatten(inp.data)
        if any(isinstance(v, str) or v is None for v in flat):
            raise ProtocolError(f"input {inp.name!r} ({inp.datatype}) holds non-numbers")
        try:
            array = np.asarray(flat, dtype=np.dtype(_NUMPY[inp.datatype]))
        except (ValueError, TypeError, OverflowError):
            raise ProtocolError(f"input {inp.name!r}: data does not fit {inp.datatype}") from None
    if array.size != count:
        raise ProtocolError(
            f"input {inp.name!r} has {array.size} elements; its shape {inp.shape} needs {count}"
        )
    return array.reshape(inp.shape)


def _bytes_elements(inp: RequestInput, binary: bytes | None) -> list[bytes]:
    if binary is None:
        flat = _flatten(inp.data)
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"input {inp.name!r} (BYTES) must hold strings in JSON")
        return [v.encode() for v in flat]
    out: list[bytes] = []
    offset = 0
    while offset < len(binary):
        if offset + 4 > len(binary):
            raise ProtocolError(f"input {inp.name!r}: truncated BYTES element length")
        length = int.from_bytes(binary[offset : offset + 4], "little")
        offset += 4
        if offset + length > len(binary):
            raise ProtocolError(f"input {inp.name!r}: truncated BYTES element")
        out.append(binary[offset : offset + length])
        offset += length
    return out


def to_items(
    bundle: Bundle, inputs: list[RequestInput], binary: list[bytes | None]
) -> list[dict[str, Any]]:
    """The ``POST /predict`` items the inputs describe (see the module)."""
    tensors = {}
    for inp, data in zip(inputs, binary, strict=True):
        if inp.name in tensors:
            raise ProtocolError(f"input {inp.name!r} is sent twice")
        tensors[inp.name] = (inp, tensor(inp, data))
    ids = tensors.pop("ID", None)
    if ids is not None and ids[0].datatype != "BYTES":
        raise ProtocolError(f"ID must be BYTES (the items' ids), got {ids[0].datatype}")
    kind = bundle.manifest.item.kind
    if kind == "tabular":
        # Ids alone are items too (their sensors acquired by id), as POST /predict takes them.
        items = _tabular_items(bundle, tensors, None if ids is None else ids[1].size)
    elif kind == "image":
        items = _image_items(tensors, binary_png=_binary_png(inputs, binary))
    else:
        items = _json_items(kind, tensors)
    if ids is not None:
        id_values = ids[1].reshape(-1)
        if id_values.size != len(items):
            raise ProtocolError(f"ID has {id_values.size} elements for {len(items)} items")
        for item, raw_id in zip(items, id_values.tolist(), strict=True):
            item["id"] = raw_id.decode("utf-8", errors="replace")
    if not items:
        raise ProtocolError("the inputs hold no item (batch dimension 0)")
    return items


def _json_items(
    kind: str, tensors: dict[str, tuple[RequestInput, npt.NDArray[Any]]]
) -> list[dict[str, Any]]:
    """Items of other kinds (``letters``, ``tokens``...): one BYTES input ``ITEM`` whose
    elements are the items as ``POST /predict`` takes them, each a JSON document."""
    found = tensors.pop("ITEM", None)
    if found is None or tensors:
        raise ProtocolError(
            f"this model takes {kind!r} items: send them as one BYTES input 'ITEM', each "
            f"element an item as POST /predict takes it, in JSON; got inputs "
            f"{', '.join(map(repr, ['ITEM'] * (found is not None) + sorted(tensors))) or 'none'}"
        )
    inp, values = found
    if inp.datatype != "BYTES":
        raise ProtocolError(f"ITEM must be BYTES (JSON documents), got {inp.datatype}")
    items: list[dict[str, Any]] = []
    for i, raw in enumerate(values.reshape(-1).tolist()):
        try:
            item = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"ITEM[{i}] is not a JSON document: {exc}") from None
        if not isinstance(item, dict):
            raise ProtocolError(
                f"ITEM[{i}] must be a JSON object (an item as POST /predict takes it), "
                f"got {type(item).__name__}"
            )
        items.append(item)
    return items


def _binary_png(inputs: list[RequestInput], binary: list[bytes | None]) -> bool:
    return any(i.name == "IMAGE" and b is not None for i, b in zip(inputs, binary, strict=True))


def _image_items(
    tensors: dict[str, tuple[RequestInput, npt.NDArray[Any]]], binary_png: bool
) -> list[dict[str, Any]]:
    unknown = sorted(set(tensors) - {"IMAGE"})
    if "IMAGE" not in tensors or unknown:
        raise ProtocolError(
            "an image model takes the input IMAGE (and optional ID); "
            f"got {sorted(tensors) or 'none'}"
        )
    inp, array = tensors["IMAGE"]
    if inp.datatype == "BYTES":
        if array.ndim not in (1, 2) or (array.ndim == 2 and array.shape[1] != 1):
            raise ProtocolError(f"IMAGE as BYTES has shape {inp.shape}; send [B] or [B, 1]")
        pngs = array.reshape(-1).tolist()
        if binary_png:
            return [{"png_base64": base64.b64encode(p).decode()} for p in pngs]
        return [{"png_base64": p.decode()} for p in pngs]
    if inp.datatype not in ("FP32", "FP64", "UINT8"):
        raise ProtocolError(
            f"IMAGE has datatype {inp.datatype}; send BYTES (PNG), FP32/FP64 in [0, 1] or UINT8"
        )
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ProtocolError(
            f"IMAGE as {inp.datatype} has shape {inp.shape}; send [B, H, W] or [H, W]"
        )
    return [{"png_base64": _png(image)} for image in array]


def _png(image: npt.NDArray[Any]) -> str:
    """A gray image as a PNG: UINT8 as 8-bit, floats in [0, 1] as 16-bit (I;16)."""
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ProtocolError(f"IMAGE holds an empty {image.shape[0]}x{image.shape[1]} image")
    if image.dtype == np.uint8:
        img = Image.fromarray(np.ascontiguousarray(image))  # 2-D uint8: mode L
    else:
        values = image.astype(np.float64)
        if not np.all(np.isfinite(values)) or values.min() < 0.0 or values.max() > 1.0:
            raise ProtocolError("IMAGE as floats must hold finite values in [0, 1]")
        levels = np.rint(values * 65535.0).astype("<u2")
        img = Image.frombytes("I;16", (levels.shape[1], levels.shape[0]), levels.tobytes())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _tabular_items(
    bundle: Bundle,
    tensors: dict[str, tuple[RequestInput, npt.NDArray[Any]]],
    n_ids: int | None = None,
) -> list[dict[str, Any]]:
    columns = list(bundle.manifest.item.columns)
    rows: list[dict[str, float]] | None = None
    if "VALUES" in tensors:
        inp, array = tensors.pop("VALUES")
        named = (inp.parameters or {}).get("columns")
        names = columns if named is None else [c.strip() for c in str(named).split(",")]
        twice = sorted({c for c in names if names.count(c) > 1})
        if twice:
            raise ProtocolError(
                f"VALUES parameters.columns names {', '.join(map(repr, twice))} more than once; "
                "name each column once"
            )
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2 or array.shape[1] != len(names):
            raise ProtocolError(
                f"VALUES has shape {inp.shape}; send [B, {len(names)}] for the columns "
                f"{', '.join(names)}"
            )
        if inp.datatype == "BYTES":
            raise ProtocolError("VALUES must be numeric (FP32, FP64 or an integer type)")
        floats = array.astype(np.float64)
        rows = [
            {c: float(v) for c, v in zip(names, row, strict=True) if not math.isnan(v)}
            for row in floats
        ]
    per_column = {}
    for name, (inp, array) in tensors.items():
        if inp.datatype == "BYTES":
            raise ProtocolError(f"input {name!r} must be numeric, got BYTES")
        if array.ndim == 2 and array.shape[1] == 1:
            array = array[:, 0]
        if array.ndim != 1:
            raise ProtocolError(f"input {name!r} has shape {inp.shape}; send [B] or [B, 1]")
        per_column[name] = array.astype(np.float64)
    sizes = {len(a) for a in per_column.values()} | ({len(rows)} if rows is not None else set())
    if len(sizes) > 1:
        raise ProtocolError(f"the inputs disagree on the batch size: {sorted(sizes)}")
    if not sizes and n_ids:
        sizes = {n_ids}  # only ids: every value is acquired by id
    if not sizes:
        raise ProtocolError(
            f"a tabular model takes one input per column ({', '.join(columns)}) or VALUES "
            "(and optional ID); got none"
        )
    batch = sizes.pop()
    rows = rows if rows is not None else [{} for _ in range(batch)]
    for name, values in per_column.items():
        for row, v in zip(rows, values.tolist(), strict=True):
            if name in row:
                raise ProtocolError(f"column {name!r} is sent both in VALUES and as an input")
            if not math.isnan(v):
                row[name] = v
    # Unknown column names are refused by the item decoder, naming them (422).
    return [{"values": row} for row in rows]


def _response(
    bundle: Bundle,
    answered: str,
    req: InferenceRequest,
    results: list[PredictResponse],
    wanted: list[str],
    budget: float | None,
    total: float | None,
) -> InferenceResponse:
    classes = bundle.manifest.classes
    b = len(results)

    def output(name: str) -> ResponseOutput:
        if name == "PREDICTION":
            return ResponseOutput(
                name=name, shape=[b], datatype="BYTES", data=[r.prediction for r in results]
            )
        if name == "PROBABILITIES":
            data = [float(r.probabilities[c]) for r in results for c in classes]
            return ResponseOutput(name=name, shape=[b, len(classes)], datatype="FP32", data=data)
        if name == "CLASSES":
            return ResponseOutput(
                name=name, shape=[len(classes)], datatype="BYTES", data=list(classes)
            )
        if name == "EXPECTED_ACCURACY":
            return ResponseOutput(
                name=name, shape=[b], datatype="FP32", data=[r.expected_accuracy for r in results]
            )
        if name == "COST_SPENT":
            return ResponseOutput(
                name=name, shape=[b], datatype="FP32", data=[r.cost.spent for r in results]
            )
        if name == "COST_BUDGET":
            return ResponseOutput(
                name=name, shape=[b], datatype="FP32", data=[r.cost.budget for r in results]
            )
        return ResponseOutput(
            name=name, shape=[b], datatype="BYTES", data=[r.model_dump_json() for r in results]
        )

    params: dict[str, bool | int | float | str] = {
        "cost_unit": bundle.manifest.cost_unit,
        "spent": sum(r.cost.spent for r in results),
        "strategy": results[0].strategy,
    }
    if budget is not None:
        params["budget"] = budget
    if total is not None:
        params["total_budget"] = total
    return InferenceResponse(
        model_name=bundle.manifest.name,
        model_version=answered,
        id=req.id,
        parameters=params,
        outputs=[output(n) for n in wanted],
    )


INFER_BODY = {
    "required": True,
    "content": {"application/json": {"schema": inline_schema(InferenceRequest)}},
    "description": "an inference request (JSON; binary tensor data may follow the JSON part, "
    "whose length is then in the Inference-Header-Content-Length header)",
}

_ERRORS = {
    400: "the protocol cannot read the request (bad JSON, shapes, datatypes, parameters), "
    "or a model failed to load",
    401: "missing or wrong admin token (Authorization: Bearer <BUDGETSERVE_ADMIN_TOKEN>)",
    403: "model management is disabled: BUDGETSERVE_ADMIN_TOKEN is not set",
    404: "unknown model or version",
    413: "request body or image too large",
    422: "an item the model cannot read",
    503: "the model failed to load, or the service is overloaded",
}


def v2_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The protocol's error bodies for ``statuses``, and the app's for a 422 of FastAPI's
    own parameter validation (which the v2 routes, taking only string path parameters, do
    not reach; documented so that the schema has no undocumented error body)."""
    responses: dict[int | str, dict[str, Any]] = {
        s: {"model": V2Error, "description": _ERRORS[s]} for s in statuses
    }
    if 422 not in statuses:
        responses.update(documented(422))
    return responses


_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"
_READY_DOC = {"model": ModelReady, "description": "the model failed to load"}
_INFER = {
    "response_model": InferenceResponse,
    "openapi_extra": {"requestBody": INFER_BODY},
    "responses": v2_errors(400, 404, 413, 422, 503),
}

#: (method, path, endpoint, add_api_route options) of every v2 route, in schema order.
ROUTES: tuple[tuple[str, str, Any, dict[str, Any]], ...] = (
    ("GET", "/v2", server_metadata, {}),
    ("GET", "/v2/health/live", live, {}),
    (
        "GET",
        "/v2/health/ready",
        ready,
        {
            "response_model": Ready,
            "responses": {400: {"model": Ready, "description": "no model loaded"}},
        },
    ),
    ("GET", "/v2/models/stats", all_stats, {"responses": v2_errors(503)}),
    (
        "GET",
        _MODEL,
        model_metadata,
        {"response_model": ModelMetadata, "responses": v2_errors(404, 503)},
    ),
    (
        "GET",
        _VERSION,
        version_metadata,
        {"response_model": ModelMetadata, "responses": v2_errors(404, 503)},
    ),
    (
        "GET",
        _MODEL + "/ready",
        model_ready,
        {"response_model": ModelReady, "responses": {400: _READY_DOC, **v2_errors(404, 503)}},
    ),
    (
        "GET",
        _VERSION + "/ready",
        version_ready,
        {"response_model": ModelReady, "responses": {400: _READY_DOC, **v2_errors(404, 503)}},
    ),
    ("POST", _MODEL + "/infer", infer, _INFER),
    ("POST", _VERSION + "/infer", version_infer, _INFER),
    ("GET", _MODEL + "/config", model_config, {"responses": v2_errors(404, 503)}),
    ("GET", _VERSION + "/config", version_config, {"responses": v2_errors(404, 503)}),
    ("GET", _MODEL + "/stats", model_stats, {"responses": v2_errors(404, 503)}),
    ("GET", _VERSION + "/stats", version_stats, {"responses": v2_errors(404, 503)}),
    (
        "POST",
        "/v2/repository/index",
        repository_index_route,
        {"responses": v2_errors(400, 503)},
    ),
    (
        "POST",
        "/v2/repository/models/{name}/load",
        repository_load_route,
        {"responses": v2_errors(400, 401, 403, 404, 503)},
    ),
    (
        "POST",
        "/v2/repository/models/{name}/unload",
        repository_unload_route,
        {"responses": v2_errors(401, 403, 404, 503)},
    ),
)
