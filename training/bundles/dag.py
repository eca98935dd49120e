"""Build a DAG bundle (paper 000) from tabular data: sensors with declared costs, a sweep of
the cost trade-off, every classifier and policy exported to ONNX and checked.

The bundle's items are ``{"values": {column: number}}``; each sensor is an instance of the
built-in ``sensor`` extractor serving its columns at a declared cost (``cost_basis:
"declared"``: budgets and spent costs are in the bundle's unit, not in milliseconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.bundle import (
    DagNode,
    DagPolicy,
    DagState,
    DagStrategy,
    Manifest,
    ModelSpec,
    model_id_for,
    write_manifest,
)
from training.bundles.digits import bundle_version, provenance, staging
from training.dag import DagClassifier, sweep
from training.data.tabular import (
    TabularSpec,
    column_positions,
    fingerprint,
    read_csv,
    sensor_extractors,
    tabular_item,
)
from training.executor import INLINE, Executor
from training.export.sklearn import export_classifier, onnx_probabilities, verify_export

__all__ = ["DagBuildResult", "DagExportMismatch", "DagSpec", "build_dag_bundle", "read_csv"]


class DagExportMismatch(RuntimeError):
    """An exported policy decides differently from the fitted one: nothing is written."""


@dataclass
class DagSpec(TabularSpec):
    """What ``budgetserve-train dag`` reads besides the CSV (JSON or YAML): the tabular spec
    plus the cost trade-offs to sweep and, for many sensors, the number of groups (Alg. 2)."""

    cost_scales: list[float] = field(
        default_factory=lambda: [0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    )
    n_subsets: int | None = None

    def check(self) -> None:
        super().check()
        if not self.cost_scales or any(c < 0 for c in self.cost_scales):
            raise ValueError("cost_scales must be a non-empty list of numbers >= 0")


@dataclass
class DagBuildResult:
    manifest: Manifest
    path: Path
    points: list[dict[str, float]]
    models: list[DagClassifier] = field(default_factory=list)  # one per policy, in order


def build_dag_bundle(
    out_dir: Path,
    spec: DagSpec,
    x: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    columns: Sequence[str],
    *,
    data_fingerprint: str | None = None,
    executor: Executor = INLINE,
) -> DagBuildResult:
    """Split, sweep the cost trade-off (its tasks on ``executor``), export, verify, write
    ``out_dir`` atomically."""
    spec.check()
    position = {c: i for i, c in enumerate(columns)}
    sensors = column_positions(spec, columns)
    costs = spec.sensor_costs()
    x_train, x_val, x_test, y_train, y_val, y_test = spec.split(x, y)
    fits = sweep(x_train, y_train, x_val, y_val, spec.cost_scales, sensors=sensors,
                 costs=costs, n_subsets=spec.n_subsets, random_state=spec.seed,
                 executor=executor)
    base = fits[0][1]
    classes = [str(c) for c in base.classes_]
    sensor_names = list(spec.sensors)
    # The policy input: every sensor's columns, sensors in declaration order.
    offsets, width = {}, 0
    for name in sensor_names:
        offsets[name] = width
        width += len(spec.sensors[name])
    global_of_column = {
        position[c]: offsets[s] + j for s in sensor_names for j, c in enumerate(spec.sensors[s])
    }

    with staging(out_dir) as tmp:
        models = _export_bank(tmp, base, classes, x_test)
        policies, points = [], []
        for i, (scale, model, val_cost, val_error) in enumerate(fits):
            policy = _export_policy(tmp, f"policy_{i}.onnx", model, width, global_of_column)
            _verify_policy(tmp / policy.file, policy, model, x_val, global_of_column)
            pred, spent, _ = model.predict_with_cost(x_test)
            test_error = float(np.mean(pred != y_test))
            policies.append(policy.model_copy(update={
                "cost_scale": scale, "mean_cost": val_cost, "error": val_error,
            }))
            points.append({"cost_scale": scale, "validation_cost": val_cost,
                           "validation_error": val_error,
                           "test_cost": float(np.mean(spent)), "test_error": test_error})
        manifest = Manifest(
            name=spec.name,
            version=bundle_version(tmp),
            classes=classes,
            cost_unit=spec.unit,
            cost_basis="declared",
            item=tabular_item(spec.sensors),
            extractors=sensor_extractors(spec.sensors, costs, spec.unit),
            models=models,
            strategies=[DagStrategy(
                name="dag", groups=[list(g) for g in base.groups_], inputs=sensor_names,
                policies=policies,
            )],
            default_strategy="dag",
            provenance=provenance(
                data_fingerprint or fingerprint(x, y),
                {
                    "label": spec.label, "sensors": spec.sensors, "costs": costs,
                    "cost_scales": spec.cost_scales, "n_subsets": spec.n_subsets,
                    "seed": spec.seed,
                    "rows": {"train": len(y_train), "validation": len(y_val),
                             "test": len(y_test)},
                    "operating_points": points,
                },
            ),
        )
        write_manifest(tmp, manifest)
    return DagBuildResult(manifest, out_dir, points, [model for _, model, _, _ in fits])


def _export_bank(
    folder: Path, model: DagClassifier, classes: list[str], x_check: npt.NDArray[np.float64]
) -> list[ModelSpec]:
    """One ONNX classifier per state (the prior for the empty state), verified on rows."""
    out = []
    for state in model.states_:
        features = model.state_sensors(state)
        model_id = model_id_for(features)
        fitted = model.classifiers_[state]
        if fitted is None:
            prior = np.asarray(model.prior_, dtype=np.float64)
            out.append(ModelSpec(id=model_id, features=[], accuracy=1.0 - model.oof_error_[state],
                                 prior=[float(p) for p in prior / prior.sum()], input_dims=0))
            continue
        cols = model.state_columns(state)
        onnx_bytes = export_classifier(fitted, len(cols))
        verify_export(onnx_bytes, fitted, x_check[:, cols].astype(np.float32), model_id=model_id)
        file = f"state_{model_id.replace('+', '__')}.onnx"
        (folder / file).write_bytes(onnx_bytes)
        out.append(ModelSpec(id=model_id, features=features,
                             accuracy=1.0 - float(model.oof_error_[state]), file=file,
                             input_dims=len(cols)))
    return out


def _export_policy(
    folder: Path,
    file: str,
    model: DagClassifier,
    width: int,
    global_of_column: Mapping[int, int],
) -> DagPolicy:
    """The policy of every state as one ONNX logits model plus filter trees."""
    weights: list[npt.NDArray[np.float64]] = []
    biases: list[float] = []
    states = []
    for state in model.states_:
        nodes = model.policy_nodes(state)
        cols = model.state_columns(state)
        internal = [i for i, n in enumerate(nodes) if "action" not in n]
        index_of = {i: k for k, i in enumerate(internal)}

        def child(i: int, nodes: list[dict[str, Any]] = nodes,
                  index_of: dict[int, int] = index_of) -> int:
            node = nodes[i]
            return -int(node["action"]) - 1 if "action" in node else index_of[i]

        tree = []
        for i in internal:
            node = nodes[i]
            if node["constant"]:
                tree.append(DagNode(left=child(node["left"]), right=child(node["right"]),
                                    constant=float(node["bias"]) > 0))
                continue
            w = np.zeros(width)
            for j, c in enumerate(cols):
                w[global_of_column[c]] = float(node["weights"][j])
            weights.append(w)
            biases.append(float(node["bias"]))
            tree.append(DagNode(left=child(node["left"]), right=child(node["right"]),
                                logit=len(weights) - 1))
        states.append(DagState(
            groups=state,
            model=model_id_for(model.state_sensors(state)),
            transitions=[nxt for _, nxt, _ in model.transitions(state)],
            tree=tree,
        ))
    if not weights:  # every decision is constant: one unused logit keeps the graph valid
        weights.append(np.zeros(width))
        biases.append(0.0)
    matrix = np.stack(weights, axis=1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["xw"]),
         helper.make_node("Add", ["xw", "b"], ["logits"])],
        "dag_policy",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, matrix.shape[1]])],
        [numpy_helper.from_array(matrix, "W"),
         numpy_helper.from_array(np.asarray(biases, dtype=np.float32), "b")],
    )
    onx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    (folder / file).write_bytes(onx.SerializeToString())
    return DagPolicy(cost_scale=0.0, mean_cost=0.0, error=0.0, file=file, states=states)


def _verify_policy(
    path: Path,
    policy: DagPolicy,
    model: DagClassifier,
    x: npt.NDArray[np.float64],
    global_of_column: Mapping[int, int],
) -> None:
    """Every state's exported decision (ONNX logits + tree) equals the fitted policy's on
    ``x``, except where the fitted margin is within float32 rounding of 0."""
    inputs = np.zeros((len(x), len(global_of_column)), dtype=np.float32)
    for c, g in global_of_column.items():
        inputs[:, g] = x[:, c]
    logits = onnx_probabilities(path.read_bytes(), inputs)
    for state_spec in policy.states:
        state = state_spec.groups
        cols = model.state_columns(state)
        expected = np.asarray(model.policy_action(state, x[:, cols]))
        walked = [_walk_tree(state_spec.tree, row) for row in logits]
        bad = [
            i for i, (action, margin) in enumerate(walked)
            if action != expected[i] and margin > 1e-3
        ]
        if bad:
            raise DagExportMismatch(
                f"DAG policy {path.name}, state {state}: {len(bad)} of {len(x)} rows decide "
                "differently after export"
            )


def _walk_tree(tree: list[DagNode], logits: npt.NDArray[np.float32]) -> tuple[int, float]:
    """The action the tree takes and the smallest |logit| on the way (how close a decision
    came to flipping)."""
    if not tree:
        return 0, float("inf")
    node, closest = 0, float("inf")
    while True:
        spec = tree[node]
        if spec.logit is not None:
            value = float(logits[spec.logit])
            closest = min(closest, abs(value))
            right = value > 0
        else:
            right = bool(spec.constant)
        child = spec.right if right else spec.left
        if child < 0:
            return -child - 1, closest
        node = child
