"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``).

Served beside the HTTP API when ``BUDGETSERVE_GRPC_PORT`` is set, in the same process and
event loop (``grpc.aio``), on the same registry, predict handler, metrics and deadline
accounting as ``POST /v2/models/{name}/infer`` (``service.http.v2``). ``inference.proto`` is
the protocol's definition (Triton's messages, which KServe's are a subset of);
``inference_pb2`` is generated from it by ``make grpc-stubs`` and shipped, so that serving
needs ``grpcio`` and ``protobuf`` only.
"""

from service.grpc_api.server import SERVICE, GrpcServer, start_grpc

__all__ = ["SERVICE", "GrpcServer", "start_grpc"]
