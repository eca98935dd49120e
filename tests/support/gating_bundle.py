"""A small gating bundle (paper 001's format) built in the tests through real code: sklearn
models exported and checked by ``training.export.sklearn``, a linear gate as a real ONNX graph, the
tabular ``sensor`` extractors of ``training.bundles.dag``, written atomically by the staging
context of ``training.bundles.digits``.

The problem: a cheap sensor ``g`` says whether the label is the sign of the cheap sensor
``a`` (g > 0) or of the expensive sensor ``b`` (g < 0); ``c`` is expensive noise. f1 reads
``a``; f0 (a depth-3 tree) reads everything; the gate's score is ``0.1 - g``, so a point
with threshold t sends the items with g < 0.1 - t to f0 (an all-zero row, as the strategy
contract tests feed, goes to f0 at t = 0 and stays with f1 at t = 1).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.linear_model import LogisticRegression
from sklearn.tree import DecisionTreeClassifier

from service.bundle import (
    GatePoint,
    GatingStrategy,
    Manifest,
    ModelSpec,
    model_id_for,
    write_manifest,
)
from training.bundles.writer import provenance, staging
from training.data.tabular import sensor_extractors, tabular_item
from training.export.sklearn import export_classifier, verify_export

SENSORS = {"a": ["a1"], "g": ["g1"], "b": ["b1"], "c": ["c1"]}
COSTS = {"a": 1.0, "g": 1.0, "b": 2.0, "c": 2.0}
COLUMNS = ["a1", "g1", "b1", "c1"]
LOW_FEATURES = ["a"]
HIGH_FEATURES = ["a", "g", "b", "c"]
LOW = model_id_for(LOW_FEATURES)
HIGH = model_id_for(HIGH_FEATURES)
GATE_WEIGHT, GATE_BIAS = -1.0, 0.1
GATE_FILE = "gate_g.onnx"
# (point id, method, gated, threshold, low model, high model)
POINTS = [
    ("low", "greedymiser", False, 0.0, LOW, HIGH),
    ("gate-1", "adapt-lin", True, 1.0, LOW, HIGH),
    ("gate-0", "adapt-lin", True, 0.0, LOW, HIGH),
    ("full", "f0", False, 0.0, HIGH, HIGH),
]


def make_gating_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows over ``COLUMNS`` and their labels ('no' / 'yes'), 3 % of them flipped."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(COLUMNS)))
    label = np.where(x[:, 1] > 0, x[:, 0] > 0, x[:, 2] > 0) ^ (rng.random(n) < 0.03)
    return x, np.where(label, "yes", "no")


def columns_of(features: list[str]) -> list[int]:
    return [COLUMNS.index(c) for f in features for c in SENSORS[f]]


def linear_gate(weights: list[float], bias: float, outputs: int = 1) -> bytes:
    """ONNX: ``features`` (N x len(weights)) -> ``score`` (N x outputs) = features·w + b."""
    w = np.tile(np.asarray(weights, dtype=np.float32).reshape(-1, 1), (1, outputs))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["score"]),
        ],
        "gate",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, len(weights)])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, [None, outputs])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.full(outputs, bias, dtype=np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def gate_scores(x: np.ndarray) -> np.ndarray:
    """The gate's score, computed offline (float32, as the ONNX graph)."""
    g = x[:, COLUMNS.index("g1")].astype(np.float32)
    return np.float32(GATE_WEIGHT) * g + np.float32(GATE_BIAS)


@dataclass
class GatingFixture:
    path: Path
    estimators: dict[str, Any] = field(default_factory=dict)  # model id -> fitted sklearn


def build_gating_bundle(out_dir: Path, rows: int = 3000, seed: int = 0) -> GatingFixture:
    x, y = make_gating_data(rows, seed)
    n_train = 2 * rows // 3
    x_tr, y_tr, x_te, y_te = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    low_cols, high_cols = columns_of(LOW_FEATURES), columns_of(HIGH_FEATURES)
    estimators: dict[str, Any] = {
        LOW: LogisticRegression().fit(x_tr[:, low_cols], y_tr),
        HIGH: DecisionTreeClassifier(max_depth=3, random_state=0).fit(x_tr[:, high_cols], y_tr),
    }
    classes = [str(c) for c in estimators[LOW].classes_]
    predicted = {
        m: estimators[m].predict(x_te[:, columns_of(f)])
        for m, f in ((LOW, LOW_FEATURES), (HIGH, HIGH_FEATURES))
    }
    frequencies = np.asarray([np.mean(y_tr == c) for c in classes])
    models = [
        ModelSpec(
            id="prior",
            features=[],
            prior=frequencies.tolist(),
            input_dims=0,
            accuracy=float(np.mean(y_te == classes[int(np.argmax(frequencies))])),
        )
    ]
    with staging(out_dir) as tmp:
        for model_id, features in ((LOW, LOW_FEATURES), (HIGH, HIGH_FEATURES)):
            cols = columns_of(features)
            onnx_bytes = export_classifier(estimators[model_id], len(cols))
            verify_export(
                onnx_bytes,
                estimators[model_id],
                x_te[:, cols].astype(np.float32),
                model_id=model_id,
            )
            file = f"model_{model_id.replace('+', '__')}.onnx"
            (tmp / file).write_bytes(onnx_bytes)
            models.append(
                ModelSpec(
                    id=model_id,
                    features=features,
                    file=file,
                    input_dims=len(cols),
                    accuracy=float(np.mean(predicted[model_id] == y_te)),
                )
            )
        (tmp / GATE_FILE).write_bytes(linear_gate([GATE_WEIGHT], GATE_BIAS))
        score = gate_scores(x_te)
        points = []
        for point_id, method, gated, threshold, low, high in POINTS:
            routed = score > threshold if gated else np.zeros(len(y_te), dtype=bool)
            answer = np.where(routed, predicted[high], predicted[low])
            first = (
                {"g", *LOW_FEATURES}
                if gated
                else set(LOW_FEATURES if low == LOW else HIGH_FEATURES)
            )
            first_cost = sum(COSTS[f] for f in first)
            extra_cost = sum(COSTS[f] for f in HIGH_FEATURES if f not in first)
            points.append(
                GatePoint(
                    id=point_id,
                    method=method,
                    p_full=float(np.mean(routed)),
                    regularisation=0.0,
                    gate_file=GATE_FILE if gated else None,
                    gate_features=["g"] if gated else [],
                    gate_input_dims=1 if gated else 0,
                    threshold=threshold,
                    low_model=low,
                    high_model=high,
                    mean_cost=first_cost + float(np.mean(routed)) * extra_cost,
                    fraction_full=float(np.mean(routed)),
                    accuracy=float(np.mean(answer == y_te)),
                )
            )
        manifest = Manifest(
            name=out_dir.name,
            version="test",
            classes=classes,
            cost_unit="units",
            cost_basis="declared",
            item=tabular_item(SENSORS),
            extractors=sensor_extractors(SENSORS, COSTS, "units"),
            models=models,
            strategies=[
                GatingStrategy(name="gating", points=points),
                GatingStrategy(name="gate-0", points=[p for p in points if p.id == "gate-0"]),
            ],
            default_strategy="gating",
            provenance=provenance(
                "sha256:" + hashlib.sha256(x.tobytes()).hexdigest(), {"rows": rows, "seed": seed}
            ),
        )
        write_manifest(tmp, manifest)
    return GatingFixture(out_dir, estimators)
