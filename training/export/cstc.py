"""A fitted CSTC / CSCC / Cronus tree (paper 003) as a bundle's operating point: each node's
routing as manifest arrays (its weights on its sensors' values and its bias, so the service
takes the trained branch to the last bit) and its classifier, the trained linear node as an
ONNX graph checked against the fit (:class:`CstcExportMismatch`), or a refit model the
builder exported once (:mod:`training.export.fixed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from service.bundle import CstcNode, ModelSpec
from training.cstc import CSTCClassifier
from training.cstc.estimator import ExportNode, softmax
from training.export.gating import linear_softmax_onnx
from training.fixed_subsets import SubsetFit


class CstcExportMismatch(RuntimeError):
    """An exported node disagrees with the fitted one."""


def node_inputs(
    node: ExportNode, groups: list[list[int]], d: int
) -> tuple[list[int], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """A node's input columns (its sensors' columns, sensor order), its prediction weights
    and routing weights over them."""
    W = np.zeros((d, node.b.shape[0]))
    r = np.zeros(d)
    W[list(node.columns)] = node.W
    r[list(node.columns)] = node.route_w
    cols = [c for g in node.groups for c in groups[g]]
    return cols, W[cols], r[cols]


def export_point(
    folder: Path,
    point_id: str,
    est: CSTCClassifier,
    groups: list[list[int]],
    sensor_names: list[str],
    accuracy_rows: tuple[npt.NDArray[np.float64], npt.NDArray[Any]],
    check_rows: npt.NDArray[np.float64],
    node_fits: list[SubsetFit] | None = None,
) -> tuple[list[ModelSpec], list[CstcNode]]:
    """One fitted tree's nodes: each node's classifier (the linear node, exported as ONNX,
    checked against the fitted node on ``check_rows``, its accuracy alone measured on
    ``accuracy_rows``, the validation rows: the service chooses by it; or, with
    ``node_fits``, the node's refit model, exported once by the caller: its id) and its
    routing as manifest arrays."""
    models: list[ModelSpec] = []
    nodes: list[CstcNode] = []
    for k, node in enumerate(est.export_nodes_):
        cols, _, route = node_inputs(node, groups, est.n_features_in_)
        if node_fits is not None:
            fit = node_fits[k]
            model_id = fit.model_id if fit.estimator is not None else "prior"
        else:
            model = _export_node(folder, f"{point_id}.n{k}", est, node, groups, sensor_names)
            model = _with_accuracy(model, est, node, groups, *accuracy_rows)
            models.append(model)
            _verify(folder, model, est, node, cols, check_rows)
            model_id = model.id
        nodes.append(
            CstcNode(
                model=model_id,
                features=[sensor_names[g] for g in node.groups],
                route_weights=[float(v) for v in route] if node.routes else [],
                route_bias=float(node.route_b),
                upper=node.upper,
                lower=node.lower,
            )
        )
    return models, nodes


def _export_node(
    folder: Path,
    model_id: str,
    est: CSTCClassifier,
    node: ExportNode,
    groups: list[list[int]],
    sensor_names: list[str],
) -> ModelSpec:
    kappa = est.temperature_
    features = [sensor_names[g] for g in node.groups]
    if not node.columns:
        p = softmax(kappa * node.b.reshape(1, -1))[0]
        return ModelSpec(
            id=model_id, features=[], accuracy=0.0, prior=[float(v) for v in p], input_dims=0
        )
    cols, W, _ = node_inputs(node, groups, est.n_features_in_)
    file = f"{model_id}.onnx"
    (folder / file).write_bytes(linear_softmax_onnx(kappa * W, kappa * node.b))
    return ModelSpec(id=model_id, features=features, accuracy=0.0, file=file, input_dims=len(cols))


def node_probabilities(
    est: CSTCClassifier, node: ExportNode, X: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    h = X[:, list(node.columns)] @ node.W + node.b
    return softmax(est.temperature_ * h)


def _with_accuracy(
    model: ModelSpec,
    est: CSTCClassifier,
    node: ExportNode,
    groups: list[list[int]],
    X: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
) -> ModelSpec:
    """The node's classifier alone on every row of ``X`` (what a fallback to it is worth)."""
    pred = est.classes_[np.argmax(node_probabilities(est, node, X), axis=1)]
    return model.model_copy(update={"accuracy": float(np.mean(pred == y))})


def _verify(
    folder: Path,
    model: ModelSpec,
    est: CSTCClassifier,
    node: ExportNode,
    cols: list[int],
    X: npt.NDArray[np.float64],
) -> None:
    if model.file is None:
        return
    session = ort.InferenceSession(str(folder / model.file), providers=["CPUExecutionProvider"])
    got = session.run(None, {"features": X[:, cols].astype(np.float32)})[0]
    want = node_probabilities(est, node, X)
    worst = float(np.max(np.abs(got - want))) if len(X) else 0.0
    if worst > 1e-4:
        raise CstcExportMismatch(
            f"node model {model.id!r}: ONNX probabilities differ from the fitted node's by "
            f"{worst:.2e} (> 1e-4) on held-out rows; nothing was written"
        )
