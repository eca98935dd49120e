"""``inference.GRPCInferenceService`` on ``grpc.aio``: the RPCs, the tensor conversions between
the protocol's messages and ``service.http.v2``'s requests and responses, and the error
taxonomy mapped to gRPC status codes once.

Every RPC answers from the same application state as the REST routes: health, metadata,
configuration and statistics through ``service.http.v2``'s functions, ``ModelInfer``
through :func:`service.http.v2.observed_infer` (so a gRPC request is timed, counted,
admitted and charged exactly as a REST one, its deadline counting from the moment its
message reached this process), the repository RPCs through the model manager, behind the
admin token (``authorization: Bearer <token>`` metadata, as over HTTP).

Tensors: inputs arrive as ``raw_input_contents`` (Triton's clients) or as typed
``contents`` (KServe's, and Triton's with ``set_data_from_numpy(..., binary_data=False)``
over HTTP only); outputs leave as ``raw_output_contents`` (little-endian, ``BYTES`` elements
each prefixed with its 4-byte length), which both clients read. Request parameters are the
REST ones (``budget`` or ``total_budget``, ``strategy``, ``accounting``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import anyio.to_thread
import grpc
import numpy as np
from fastapi.security import HTTPAuthorizationCredentials
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import ValidationError

from service import errors
from service.grpc_api import inference_pb2 as pb
from service.http import requestlog, v2
from service.http.state import AppState
from service.http.v2_schemas import InferenceRequest, InferenceResponse
from service.server import worker_count

log = logging.getLogger("budgetserve.grpc")

#: The protocol's service name: what clients call, whatever the package of our .proto.
SERVICE = "inference.GRPCInferenceService"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}

# Which typed ``contents`` field holds each datatype's elements (FP16 travels raw only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def status_code(exc: errors.BudgetServeError) -> grpc.StatusCode:
    """The gRPC code of an error of the taxonomy (through its protocol HTTP status)."""
    return _CODES.get(v2.protocol_status(exc), grpc.StatusCode.INVALID_ARGUMENT)


S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp", bound=Message)


#: What an RPC tells its request line (``ModelInfer``: model, version, strategy, budget,
#: spent, cached, outcome), as ``request.state.summary`` does over HTTP.
_summary: ContextVar[dict[str, Any]] = ContextVar("budgetserve_grpc_summary")


def _peer(context: Any) -> tuple[str, int] | None:
    """The client's address from gRPC's peer string (``ipv4:127.0.0.1:5555``,
    ``ipv6:[::1]:5555``), as an ASGI scope's ``client``."""
    kind, _, address = str(context.peer() or "").partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _rpc(
    method: Callable[[S, Req, Any], Awaitable[Resp]],
) -> Callable[[S, Req, Any], Awaitable[Resp]]:
    """Answer an error of the taxonomy with its status code and message (``Retry-After``
    as the ``retry-after`` trailing metadata when overloaded); anything else is INTERNAL,
    logged, its type named. Every RPC writes one request line, as an HTTP request does
    (``budgetserve.request``; the health RPCs at DEBUG), its status the gRPC code's name, and
    carries an ``x-request-id`` (the client's metadata, if sensible, or a new one) in its
    records and its trailing metadata."""

    @functools.wraps(method)
    async def call(self: S, request: Req, context: Any) -> Resp:
        metadata = dict(context.invocation_metadata() or ())
        raw = metadata.get(requestlog.HEADER)
        rid = requestlog.accept_id(raw.encode() if isinstance(raw, str) else None)
        tokens = (requestlog.request_id.set(rid), _summary.set({}))
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        overloaded = False
        trailing: tuple[tuple[str, str], ...] = ((requestlog.HEADER, rid),)
        try:
            try:
                context.set_trailing_metadata(trailing)
                return await method(self, request, context)
            except errors.BudgetServeError as exc:
                status = status_code(exc)
                if isinstance(exc, errors.Overloaded):
                    overloaded = True
                    trailing += (("retry-after", str(exc.retry_after_s)),)
                await context.abort(status, exc.message, trailing)
            except asyncio.CancelledError:
                status = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                log.exception("unexpected error in %s", method.__name__)
                status = grpc.StatusCode.INTERNAL
                await context.abort(status, f"internal error: {type(exc).__name__}", trailing)
            raise AssertionError("unreachable: context.abort raises")
        finally:
            scope: dict[str, Any] = {
                "path": f"/{SERVICE}/{method.__name__}",
                "method": "grpc",
                "client": _peer(context),
            }
            requestlog.log_request(
                scope, rid, status.name, started, _summary.get(), overloaded=overloaded
            )
            _summary.reset(tokens[1])
            requestlog.request_id.reset(tokens[0])

    return call


def _credentials(context: grpc.aio.ServicerContext) -> HTTPAuthorizationCredentials | None:
    """The admin token of ``authorization: Bearer <token>`` metadata, as over HTTP."""
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())
    return None


def _parameter(value: pb.InferParameter) -> bool | int | float | str | None:
    kind = value.WhichOneof("parameter_choice")
    if kind is None:
        return None
    found: bool | int | float | str = getattr(value, kind)
    return found


def _set_parameter(target: pb.InferParameter, value: bool | int | float | str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value


def _length_prefixed(elements: list[bytes]) -> bytes:
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


def to_request(msg: pb.ModelInferRequest) -> tuple[InferenceRequest, list[bytes | None]]:
    """The REST request a ``ModelInferRequest`` carries, with each input's binary data:
    ``raw_input_contents`` as is, typed ``BYTES`` contents length-prefixed as the REST
    binary extension sends them, other typed contents as JSON data."""
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise v2.ProtocolError(
            f"{len(raw)} raw_input_contents for {len(msg.inputs)} inputs; send one per input "
            "(or none, with each input's contents)"
        )
    inputs: list[dict[str, Any]] = []
    binary: list[bytes | None] = []
    for i, tensor in enumerate(msg.inputs):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "shape": list(tensor.shape),
            "datatype": tensor.datatype,
            "parameters": {k: _parameter(v) for k, v in tensor.parameters.items()} or None,
        }
        if raw:
            binary.append(raw[i])
        elif tensor.datatype == "BYTES":
            binary.append(_length_prefixed(list(tensor.contents.bytes_contents)))
        else:
            field = _CONTENTS.get(tensor.datatype)
            if field is None:
                raise v2.ProtocolError(
                    f"input {tensor.name!r} ({tensor.datatype}) has no typed contents in the "
                    "protocol: send it in raw_input_contents"
                )
            entry["data"] = list(getattr(tensor.contents, field))
            binary.append(None)
        inputs.append(entry)
    doc: dict[str, Any] = {
        "id": msg.id or None,
        "parameters": {k: _parameter(v) for k, v in msg.parameters.items()} or None,
        "inputs": inputs,
        "outputs": [{"name": o.name} for o in msg.outputs] or None,
    }
    try:
        return InferenceRequest.model_validate(doc), binary
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors()
        )
        raise v2.ProtocolError(f"invalid inference request: {problems}") from None


def to_message(response: InferenceResponse) -> pb.ModelInferResponse:
    """A REST inference response as a ``ModelInferResponse`` with raw output contents."""
    msg = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version or "",
        id=response.id or "",
    )
    for key, value in (response.parameters or {}).items():
        _set_parameter(msg.parameters[key], value)
    for output in response.outputs:
        msg.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        if output.datatype == "BYTES":
            raw = _length_prefixed([str(v).encode() for v in output.data])
        else:
            raw = np.asarray(output.data, dtype=v2.numpy_dtype(output.datatype)).tobytes()
        msg.raw_output_contents.append(raw)
    return msg


class InferenceServicer:
    """The RPCs, each on ``state`` (one app's)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    @_rpc
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    @_rpc
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            v2.resolve(self.state.loaded_registry(), request.name, request.version or None)
        except (errors.ModelNotFound, errors.ModelNotReady, errors.VersionNotFound):
            return pb.ModelReadyResponse(ready=False)
        except errors.ServiceNotReady:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @_rpc
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=v2.SERVER_NAME, version=v2.SERVER_VERSION, extensions=list(v2.EXTENSIONS)
        )

    @_rpc
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        meta = v2.metadata_of(self.state.loaded_registry(), request.name, request.version or None)
        # gRPC's metadata has no parameters: they are in ModelConfig's.
        out = pb.ModelMetadataResponse()
        json_format.ParseDict(meta.model_dump(exclude={"parameters"}), out)
        return out

    @_rpc
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        received = time.perf_counter()
        version = request.model_version or None

        async def read() -> tuple[InferenceRequest, list[bytes | None]]:
            return to_request(request)

        summary = _summary.get()
        summary.update(model=request.model_name, version=version)
        response = await v2.observed_infer(
            self.state, request.model_name, version, read, received, summary
        )
        return to_message(response)

    @_rpc
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        config = v2.config_of(self.state.loaded_registry(), request.name, request.version or None)
        out = pb.ModelConfigResponse()
        json_format.ParseDict(config, out.config)
        return out

    @_rpc
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        stats = v2.statistics_of(self.state, request.name or None, request.version or None)
        out = pb.ModelStatisticsResponse()
        json_format.ParseDict(stats, out)
        return out

    @_rpc
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        index = await anyio.to_thread.run_sync(v2.repository_index, self.state, request.ready)
        out = pb.RepositoryIndexResponse()
        json_format.ParseDict({"models": index}, out)
        return out

    @_rpc
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        # Triton's clients send the name in field 2, KServe's in field 1 (see the .proto).
        name = request.model_name or request.repository_name
        await v2.repository_load(self.state, name, _credentials(context))
        return pb.RepositoryModelLoadResponse(model_name=name, isLoaded=True)

    @_rpc
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        name = request.model_name or request.repository_name
        await v2.repository_unload(self.state, name, _credentials(context))
        return pb.RepositoryModelUnloadResponse(model_name=name, isUnloaded=True)


def generic_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Every RPC of ``pb.DESCRIPTOR``'s service, under the protocol's service name."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class GrpcServer:
    """A started gRPC server and the port it listens on."""

    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self.server = server
        self.port = port

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new RPCs; let those in flight finish for up to ``grace_s``."""
        await self.server.stop(grace_s)


async def start_grpc(state: AppState) -> GrpcServer:
    """Serve ``state`` on ``BUDGETSERVE_HOST``:``BUDGETSERVE_GRPC_PORT`` (on the running
    event loop). With several workers each binds the port with ``SO_REUSEPORT`` and the
    kernel spreads connections across them; with one, a port in use fails the start."""
    settings = state.settings
    assert settings.grpc_port is not None
    options: list[tuple[str, Any]] = [
        ("grpc.so_reuseport", 1 if worker_count(settings.workers) > 1 else 0),
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
    ]
    server = grpc.aio.server(
        handlers=[generic_handler(InferenceServicer(state))],
        options=options,
        maximum_concurrent_rpcs=settings.max_in_flight or None,
    )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    try:
        port = server.add_insecure_port(f"{host}:{settings.grpc_port}")
    except RuntimeError as exc:
        raise OSError(
            f"cannot listen for gRPC on {host}:{settings.grpc_port} (BUDGETSERVE_GRPC_PORT): {exc}"
        ) from exc
    await server.start()
    log.info("gRPC (Open Inference Protocol) listening on %s:%d", host, port)
    return GrpcServer(server, port)
