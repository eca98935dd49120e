"""Linear classifiers read out of their ONNX graph and scored with numpy.

The training package exports scikit-learn's logistic regressions (a ``StandardScaler`` then
``LogisticRegression``) as a chain of three ONNX-ML operators: ``Scaler``,
``LinearClassifier`` (softmax) and ``Normalizer`` (L1). ONNX Runtime scores one row of that
in ~7 µs in a tight loop, but 35-40 µs in the request path, where decoding and extraction
have just evicted its state from the caches; numpy's few small operations on the same
weights took 15-17 µs there (in-process, 128 px digits, 2026-11-28). Every request pays it
inside the reserve for the work after planning, so a model whose graph is exactly such a
chain is scored by :class:`LinearModel`, once :func:`agrees` has found it giving ONNX
Runtime's probabilities on probe rows at load (else ONNX Runtime keeps it, as it keeps every
other graph).

The ONNX file is read with a protobuf schema of the few fields needed, numbered as in
``onnx.proto`` and built at import (``onnx`` is the training extra's package, not the
service's; protobuf is the service's for gRPC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from service.types import FloatVector

FloatArray = npt.NDArray[np.float32]

#: The most a probe row's probability may differ from ONNX Runtime's: the tolerance the
#: builders hold an exported model to against the fitted one (``training.export.sklearn``).
#: Both add the same float32 products in another order; over the 660 inputs of the digits
#: bundle's largest model, a random row whose two top classes nearly tie differed by 5.5e-5.
AGREEMENT_ATOL = 1e-4

_ML = "ai.onnx.ml"
_CHAINS = (
    ("Scaler", "LinearClassifier", "Normalizer"),
    ("Scaler", "LinearClassifier"),
    ("LinearClassifier", "Normalizer"),
    ("LinearClassifier",),
)


def _model_class() -> Any:
    """``ModelProto`` with only the fields read here (unknown ones are skipped)."""
    field = descriptor_pb2.FieldDescriptorProto
    package = "budgetserve.onnx_subset"
    file = descriptor_pb2.FileDescriptorProto(
        name="budgetserve_onnx_subset.proto", package=package, syntax="proto2"
    )

    def message(name: str, *fields: tuple[str, int, int, bool, str | None]) -> None:
        proto = file.message_type.add(name=name)
        for field_name, number, kind, repeated, type_name in fields:
            entry = proto.field.add(
                name=field_name,
                number=number,
                type=kind,
                label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL,
            )
            if type_name is not None:
                entry.type_name = f".{package}.{type_name}"

    text, message_type = field.TYPE_STRING, field.TYPE_MESSAGE
    message(
        "AttributeProto",
        ("name", 1, text, False, None),
        ("s", 4, field.TYPE_BYTES, False, None),
        ("floats", 7, field.TYPE_FLOAT, True, None),
        ("ints", 8, field.TYPE_INT64, True, None),
    )
    message(
        "NodeProto",
        ("input", 1, text, True, None),
        ("output", 2, text, True, None),
        ("op_type", 4, text, False, None),
        ("attribute", 5, message_type, True, "AttributeProto"),
        ("domain", 7, text, False, None),
    )
    message("GraphProto", ("node", 1, message_type, True, "NodeProto"))
    message("ModelProto", ("graph", 7, message_type, False, "GraphProto"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.ModelProto"))


_MODEL = _model_class()


@dataclass(frozen=True)
class LinearModel:
    """``softmax(((x - offset) * scale) @ weights + intercepts)``, L1-normalised: the
    ``Scaler`` (when present), the ``LinearClassifier`` and the ``Normalizer`` (when
    present) of the graph, as float32 numpy arrays."""

    weights: FloatArray  # (features, classes): LinearClassifier's coefficients, transposed
    intercepts: FloatArray
    offset: FloatArray | None = None
    scale: FloatArray | None = None
    l1: bool = False

    @property
    def input_dims(self) -> int:
        return int(self.weights.shape[0])

    def predict_proba(self, x: FloatVector) -> FloatVector:
        """Class probabilities of one row ``x`` (float32, ``input_dims`` values). Values
        that overflow give non-finite probabilities, as ONNX Runtime's do, without numpy's
        warnings (the caller refuses such an answer: ``service.execution``)."""
        with np.errstate(all="ignore"):
            if self.offset is not None and self.scale is not None:
                x = (x - self.offset) * self.scale
            scores = x @ self.weights + self.intercepts
            scores = np.exp(scores - scores.max())
            scores /= scores.sum()
            if self.l1:
                scores /= np.abs(scores).sum()
        result: FloatVector = scores.astype(np.float32, copy=False)
        return result


def read_linear(data: bytes, input_name: str, output_name: str) -> LinearModel | None:
    """The linear model of an ONNX file whose graph is a chain of ``Scaler``,
    ``LinearClassifier`` with softmax and ``Normalizer`` (L1) from ``input_name`` to
    ``output_name`` (the first and last optional), else None."""
    try:
        graph = _MODEL.FromString(data).graph
    except (DecodeError, ValueError):
        return None
    nodes = list(graph.node)
    if tuple(n.op_type for n in nodes) not in _CHAINS or any(n.domain != _ML for n in nodes):
        return None
    found: dict[str, Any] = {}
    current = input_name
    for node in nodes:
        if not node.input or node.input[0] != current:
            return None
        attributes = {a.name: a for a in node.attribute}
        if node.op_type == "Scaler":
            if "offset" not in attributes or "scale" not in attributes:
                return None
            found["offset"] = np.asarray(attributes["offset"].floats, np.float32)
            found["scale"] = np.asarray(attributes["scale"].floats, np.float32)
            current = node.output[0]
        elif node.op_type == "LinearClassifier":
            post = attributes.get("post_transform")
            if post is None or post.s != b"SOFTMAX" or len(node.output) < 2:
                return None
            if "intercepts" not in attributes or "coefficients" not in attributes:
                return None
            intercepts = np.asarray(attributes["intercepts"].floats, np.float32)
            coefficients = np.asarray(attributes["coefficients"].floats, np.float32)
            classes = intercepts.size
            if classes < 2 or coefficients.size % classes:
                return None
            found["weights"] = np.ascontiguousarray(coefficients.reshape(classes, -1).T)
            found["intercepts"] = intercepts
            current = node.output[1]  # (label, probabilities)
        else:  # Normalizer
            norm = attributes.get("norm")
            if norm is None or norm.s != b"L1":
                return None
            found["l1"] = True
            current = node.output[0]
    if current != output_name:
        return None
    dims = found["weights"].shape[0]
    for name in ("offset", "scale"):
        if name in found and found[name].size not in (1, dims):
            return None
    return LinearModel(**found)


def agrees(
    model: LinearModel, session: ort.InferenceSession, input_name: str, output_name: str
) -> bool:
    """Whether ``model`` gives ``session``'s probabilities (within :data:`AGREEMENT_ATOL`)
    on probe rows: zeros, and standard normal rows at three scales."""
    rng = np.random.default_rng(0)
    dims = model.input_dims
    rows = np.concatenate(
        [np.zeros((1, dims))] + [s * rng.standard_normal((8, dims)) for s in (0.1, 1.0, 10.0)]
    ).astype(np.float32)
    try:
        expected = np.asarray(session.run([output_name], {input_name: rows})[0], np.float64)
    except Exception:  # onnxruntime raises its own untyped errors
        return False
    got = np.stack([model.predict_proba(row) for row in rows]).astype(np.float64)
    return got.shape == expected.shape and bool(np.all(np.abs(got - expected) <= AGREEMENT_ATOL))
