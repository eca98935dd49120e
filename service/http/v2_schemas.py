"""Bodies of the Open Inference Protocol (KServe v2 / Triton REST) routes (``service.http.v2``).

The protocol's own shapes: an inference request is named tensors (``inputs``: name, shape,
datatype, data) with request-level ``parameters``; the response is named tensors too; an
error is ``{"error": "..."}``. Unknown fields are ignored (the protocol is extensible).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: A protocol parameter's value: the protocol allows booleans, numbers and strings only.
ParameterValue = bool | int | float | str
Parameters = dict[str, ParameterValue]

DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
)


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    shape: list[int] = Field(max_length=8, description="dimensions, row-major")
    datatype: str = Field(description=f"one of {', '.join(DATATYPES)}")
    parameters: Parameters | None = None
    data: Any = Field(
        default=None,
        description="the elements, flat or nested row-major (absent when sent as binary "
        "data: parameters.binary_data_size)",
    )


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    parameters: Parameters | None = None


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = Field(default=None, max_length=256)
    parameters: Parameters | None = Field(
        default=None,
        description="budget (each item's) or total_budget (the batch's), in the model's cost "
        "unit; strategy (optional)",
    )
    inputs: list[RequestInput] = Field(min_length=1, max_length=1024)
    outputs: list[RequestOutput] | None = Field(
        default=None, description="outputs to return (all when absent)"
    )


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: Parameters | None = None
    data: list[Any]


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: Parameters | None = None
    outputs: list[ResponseOutput]


class MetadataTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]
    parameters: Parameters | None = None


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class V2Error(BaseModel):
    error: str


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON Schema with its ``$defs`` inlined: a self-contained schema for a
    request body the endpoint reads itself (binary data follows the JSON)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved
