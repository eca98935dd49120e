"""A fitted DAG (:mod:`training.dag`) as ONNX: one classifier per state (the classifier bank)
and one policy per state (its filter tree as a chain of linear decisions), each checked against
the fitted model on rows before it is written (:class:`DagExportMismatch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.bundle import DagNode, DagPolicy, DagState, ModelSpec, model_id_for
from training.dag import DagClassifier
from training.export.sklearn import export_classifier, onnx_probabilities, verify_export


class DagExportMismatch(RuntimeError):
    """An exported policy decides differently from the fitted one: nothing is written."""


def export_bank(
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
            out.append(
                ModelSpec(
                    id=model_id,
                    features=[],
                    accuracy=1.0 - model.oof_error_[state],
                    prior=[float(p) for p in prior / prior.sum()],
                    input_dims=0,
                )
            )
            continue
        cols = model.state_columns(state)
        onnx_bytes = export_classifier(fitted, len(cols))
        verify_export(onnx_bytes, fitted, x_check[:, cols].astype(np.float32), model_id=model_id)
        file = f"state_{model_id.replace('+', '__')}.onnx"
        (folder / file).write_bytes(onnx_bytes)
        out.append(
            ModelSpec(
                id=model_id,
                features=features,
                accuracy=1.0 - float(model.oof_error_[state]),
                file=file,
                input_dims=len(cols),
            )
        )
    return out


def export_policy(
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

        def child(
            i: int, nodes: list[dict[str, Any]] = nodes, index_of: dict[int, int] = index_of
        ) -> int:
            node = nodes[i]
            return -int(node["action"]) - 1 if "action" in node else index_of[i]

        tree = []
        for i in internal:
            node = nodes[i]
            if node["constant"]:
                tree.append(
                    DagNode(
                        left=child(node["left"]),
                        right=child(node["right"]),
                        constant=float(node["bias"]) > 0,
                    )
                )
                continue
            w = np.zeros(width)
            for j, c in enumerate(cols):
                w[global_of_column[c]] = float(node["weights"][j])
            weights.append(w)
            biases.append(float(node["bias"]))
            tree.append(
                DagNode(
                    left=child(node["left"]), right=child(node["right"]), logit=len(weights) - 1
                )
            )
        states.append(
            DagState(
                groups=state,
                model=model_id_for(model.state_sensors(state)),
                transitions=[nxt for _, nxt, _ in model.transitions(state)],
                tree=tree,
            )
        )
    if not weights:  # every decision is constant: one unused logit keeps the graph valid
        weights.append(np.zeros(width))
        biases.append(0.0)
    matrix = np.stack(weights, axis=1).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
        ],
        "dag_policy",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, matrix.shape[1]])],
        [
            numpy_helper.from_array(matrix, "W"),
            numpy_helper.from_array(np.asarray(biases, dtype=np.float32), "b"),
        ],
    )
    onx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    (folder / file).write_bytes(onx.SerializeToString())
    return DagPolicy(cost_scale=0.0, mean_cost=0.0, error=0.0, file=file, states=states)


def verify_policy(
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
            i
            for i, (action, margin) in enumerate(walked)
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
