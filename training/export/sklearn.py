"""Fitted scikit-learn classifier → ONNX, checked against the fitted model before use."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from skl2onnx import to_onnx
from skl2onnx.common.data_types import FloatTensorType

ATOL = 1e-4


class ExportMismatch(RuntimeError):
    """The ONNX model does not reproduce the fitted model: the bundle must not be written."""


def export_classifier(estimator: Any, n_features: int) -> bytes:
    """ONNX bytes of ``estimator`` (a classifier or pipeline) with one float input
    ``features`` of shape (N, n_features) and a ``probabilities`` output (no ZipMap)."""
    onx = to_onnx(
        estimator,
        initial_types=[("features", FloatTensorType([None, n_features]))],
        options={"zipmap": False},
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    return bytes(onx.SerializeToString())


def onnx_probabilities(model: bytes, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    name = "probabilities" if "probabilities" in outputs else outputs[-1]
    result = session.run([name], {session.get_inputs()[0].name: x.astype(np.float32)})[0]
    return np.asarray(result, dtype=np.float32)


def verify_export(
    model: bytes, estimator: Any, x: npt.NDArray[np.float32], *, model_id: str, atol: float = ATOL
) -> float:
    """Max |p_onnx − p_fitted| on rows ``x``; raises :class:`ExportMismatch` above ``atol``."""
    expected = np.asarray(estimator.predict_proba(x.astype(np.float32)), dtype=np.float64)
    got = onnx_probabilities(model, x).astype(np.float64)
    if got.shape != expected.shape:
        raise ExportMismatch(
            f"model {model_id!r}: ONNX output shape {got.shape}, fitted model {expected.shape}"
        )
    err = float(np.max(np.abs(got - expected))) if got.size else 0.0
    if not err <= atol:
        raise ExportMismatch(
            f"model {model_id!r}: ONNX probabilities differ from the fitted model by {err:.3g} "
            f"(> {atol}) on held-out rows; the bundle was not written"
        )
    return err
