"""Linear scorers of the structured strategies → ONNX, checked against the fitted model.

Emission scorers (one per template: x -> x @ W_k + u_k, what the template adds to every
label's score) and policy scorers (standardise, then x @ W + b) are the same graph:
``scores = ((features - mean) / scale) @ W + b``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from training.export.sklearn import ExportMismatch

F64 = npt.NDArray[np.float64]

_OPSET = [helper.make_opsetid("", 17)]
ATOL = 1e-3


def linear_onnx(weight: F64, bias: F64, mean: F64 | None = None, scale: F64 | None = None) -> bytes:
    """ONNX bytes: input ``features`` (N, d) -> output ``scores`` (N, c)."""
    d, c = weight.shape
    inits = [
        numpy_helper.from_array(np.asarray(weight, dtype=np.float32), "W"),
        numpy_helper.from_array(np.asarray(bias, dtype=np.float32).reshape(1, c), "b"),
    ]
    nodes = []
    inp = "features"
    if mean is not None and scale is not None:
        inits += [
            numpy_helper.from_array(np.asarray(mean, dtype=np.float32).reshape(1, d), "mean"),
            numpy_helper.from_array(np.asarray(scale, dtype=np.float32).reshape(1, d), "scale"),
        ]
        nodes += [
            helper.make_node("Sub", [inp, "mean"], ["centred"]),
            helper.make_node("Div", ["centred", "scale"], ["z"]),
        ]
        inp = "z"
    nodes += [
        helper.make_node("MatMul", [inp, "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        "linear_scorer",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, d])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, c])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=_OPSET)
    model.ir_version = 8
    return bytes(model.SerializeToString())


def verify_linear(
    model: bytes, expected: F64, x: npt.NDArray[np.float32], *, what: str, atol: float = ATOL
) -> float:
    """Max |ONNX − fitted| scores on rows ``x``; :class:`ExportMismatch` above ``atol``
    (relative to the scores' scale)."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    got = np.asarray(session.run(None, {"features": x.astype(np.float32)})[0], dtype=np.float64)
    if got.shape != expected.shape:
        raise ExportMismatch(f"{what}: ONNX output shape {got.shape}, fitted {expected.shape}")
    err = float(np.max(np.abs(got - expected) / np.maximum(1.0, np.abs(expected))))
    if not err <= atol:
        raise ExportMismatch(
            f"{what}: ONNX scores differ from the fitted model by {err:.3g} (> {atol}) on "
            "held-out rows; the bundle was not written"
        )
    return err
