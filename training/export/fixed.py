"""The best fixed sensor subsets (:mod:`training.fixed_subsets`) as bundle models and a
strategy's fixed points: ONNX over each subset's sensors' columns, checked against the fitted
model before anything is written."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from service.bundle import FixedPoint, ModelSpec
from service.types import FloatArray
from training.dag.learners import Float32Lgbm
from training.export.dag import lgbm_classifier_onnx
from training.export.sklearn import export_classifier, verify_export
from training.fixed_subsets import SubsetFit


def _file(model_id: str) -> str:
    return model_id.replace(":", "_").replace("+", "__") + ".onnx"


def export_fixed(
    folder: Path, fits: Sequence[SubsetFit], x_check: FloatArray, prior: str = "prior"
) -> tuple[list[ModelSpec], list[FixedPoint]]:
    """The fits as bundle models (ONNX over their sensors' columns, checked against the
    fitted model on ``x_check``) and the strategy's fixed points, with their validation
    accuracies. The empty subset is the bundle's own prior model, ``prior``."""
    models: list[ModelSpec] = []
    points: list[FixedPoint] = []
    for fit in fits:
        if fit.estimator is None:
            points.append(FixedPoint(model=prior, accuracy=fit.val_accuracy, learner="prior"))
            continue
        width = len(fit.columns)
        if isinstance(fit.estimator, Float32Lgbm):
            onnx_bytes = lgbm_classifier_onnx(fit.estimator, width)
        else:
            onnx_bytes = export_classifier(fit.estimator, width)
        verify_export(
            onnx_bytes,
            fit.estimator,
            np.asarray(x_check, dtype=np.float64)[:, fit.columns].astype(np.float32),
            model_id=fit.model_id,
        )
        file = _file(fit.model_id)
        (folder / file).write_bytes(onnx_bytes)
        models.append(
            ModelSpec(
                id=fit.model_id,
                features=list(fit.sensors),
                accuracy=fit.val_accuracy,
                file=file,
                input_dims=width,
            )
        )
        points.append(
            FixedPoint(model=fit.model_id, accuracy=fit.val_accuracy, learner=fit.learner)
        )
    return models, points
