"""A fitted DAG (:mod:`training.dag`) as ONNX: one classifier per state (the classifier bank)
and one policy per operating point (every state's filter-tree decisions as the outputs of one
graph), each checked against the fitted model on rows before it is written
(:class:`DagExportMismatch`).

The policy graph maps the policy input (every sensor's columns, zeros where not acquired) to
one logit per non-constant node; the runtime goes right where a logit is > 0. By learner:

* ``linear``: ``features @ W + b``;
* ``poly2``/``poly3``: ``z = (features - mean) / scale``, the monomials of ``[1, z]`` that any
  node uses (``Gather`` + ``Mul``), then ``@ W + b``;
* ``gbrt``: one ``TreeEnsembleRegressor`` holding every node's trees, each tree feeding its
  node's logit, thresholds the largest float32 <= LightGBM's (:func:`lgbm_trees`), so a float32
  input takes the fitted branch at every split.

With ``policy_inputs='features+confidence'`` the input has two more columns, the current
state's bank classifier's top probability and margin (:func:`training.dag.policies.confidence`),
which the runtime (``service/strategies/dag.py``) computes with the state's model, as it would
to answer; every state's nodes read them there (``DagPolicy.confidence_inputs``), and only the
current state's nodes are read. (The graph once embedded every state's classifier to compute
them itself: letter's 26-class bank made each policy file tens of MB.)

Bank classifiers of the ``gbrt`` learner are exported the same way (trees, then sigmoid or
softmax); the others go through skl2onnx.

The module stays whole (over 450 lines): the bank, the policy graph, the trees it embeds and
:func:`verify_policy` are one export whose check reads every part the graph writes.
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
from training.dag.learners import Float32Lgbm, lgbm_trees
from training.dag.policies import node_margin
from training.export.sklearn import export_classifier, onnx_probabilities, verify_export

_OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]


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
        if isinstance(fitted, Float32Lgbm):
            onnx_bytes = lgbm_classifier_onnx(fitted, len(cols))
        else:
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


def _tree_ensemble(
    trees: list[tuple[dict[str, Any], int, list[int]]], n_targets: int, inp: str, out: str
) -> onnx.NodeProto:
    """A ``TreeEnsembleRegressor`` summing each tree (arrays of :func:`lgbm_trees`) into its
    target; ``features`` maps a tree's feature index to the input column."""
    attrs: dict[str, list[Any]] = {
        k: []
        for k in (
            "nodes_treeids",
            "nodes_nodeids",
            "nodes_featureids",
            "nodes_values",
            "nodes_modes",
            "nodes_truenodeids",
            "nodes_falsenodeids",
            "target_treeids",
            "target_nodeids",
            "target_ids",
            "target_weights",
        )
    }
    for t, (tree, target, features) in enumerate(trees):
        for i, left in enumerate(tree["left"]):
            leaf = left < 0
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(i)
            attrs["nodes_featureids"].append(0 if leaf else features[tree["feature"][i]])
            attrs["nodes_values"].append(0.0 if leaf else float(tree["threshold"][i]))
            attrs["nodes_modes"].append("LEAF" if leaf else "BRANCH_LEQ")
            attrs["nodes_truenodeids"].append(0 if leaf else int(left))
            attrs["nodes_falsenodeids"].append(0 if leaf else int(tree["right"][i]))
            if leaf:
                attrs["target_treeids"].append(t)
                attrs["target_nodeids"].append(i)
                attrs["target_ids"].append(target)
                attrs["target_weights"].append(float(tree["value"][i]))
    extra: dict[str, Any] = {
        "n_targets": n_targets,
        "aggregate_function": "SUM",
        "post_transform": "NONE",
        "base_values": [0.0] * n_targets,
        **attrs,
    }
    return helper.make_node("TreeEnsembleRegressor", [inp], [out], domain="ai.onnx.ml", **extra)


def _check_thresholds(trees: list[dict[str, Any]]) -> None:
    """Every exported threshold is a float32 (so ONNX stores it unchanged)."""
    for tree in trees:
        thr = np.asarray(tree["threshold"], dtype=np.float64)
        if not np.array_equal(thr.astype(np.float32).astype(np.float64), thr):
            raise DagExportMismatch("a tree threshold is not a float32 value; nothing written")


def lgbm_classifier_onnx(est: Float32Lgbm, width: int) -> bytes:
    """A fitted :class:`Float32Lgbm` as ONNX: ``features`` (N, width) -> ``probabilities``."""
    trees = lgbm_trees(est)
    _check_thresholds(trees)
    n_classes = len(est.classes_)
    n_out = 1 if n_classes == 2 else n_classes
    cols = list(range(width))
    nodes = [
        _tree_ensemble(
            [(t, i % n_out, cols) for i, t in enumerate(trees)], n_out, "features", "raw"
        )
    ]
    inits = []
    if n_classes == 2:
        inits.append(numpy_helper.from_array(np.ones((1, 1), dtype=np.float32), "one"))
        nodes += [
            helper.make_node("Sigmoid", ["raw"], ["p1"]),
            helper.make_node("Sub", ["one", "p1"], ["p0"]),
            helper.make_node("Concat", ["p0", "p1"], ["probabilities"], axis=1),
        ]
    else:
        nodes.append(helper.make_node("Softmax", ["raw"], ["probabilities"], axis=1))
    graph = helper.make_graph(
        nodes,
        "dag_gbrt_classifier",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, n_classes])],
        inits,
    )
    onx = helper.make_model(graph, opset_imports=_OPSET)
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    return bytes(onx.SerializeToString())


def export_policy(
    folder: Path,
    file: str,
    model: DagClassifier,
    width: int,
    global_of_column: Mapping[int, int],
) -> DagPolicy:
    """The policy of every state as one ONNX logits model plus filter trees. With
    ``policy_inputs='features+confidence'`` the input's last two columns are the current
    state's classifier's confidence, which every state's nodes read (see the module)."""
    learner = model.policy_learner_
    uses_conf = model.policy_inputs != "features"
    conf = [width, width + 1] if uses_conf else []
    width_ext = width + len(conf)
    weights: list[npt.NDArray[np.float64]] = []  # linear: per logit over the input
    poly: list[tuple[dict[tuple[int, ...], float], float]] = []  # per logit: monomial -> w, b
    trees: list[tuple[dict[str, Any], int, list[int]]] = []
    biases: list[float] = []
    n_logits = 0
    states = []
    for state in model.states_:
        nodes = model.policy_nodes(state)
        cols = model.state_columns(state)
        glob = [global_of_column[c] for c in cols] + conf
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
            if "trees" in node:
                _check_thresholds(node["trees"])
                trees += [(t, n_logits, glob) for t in node["trees"]]
            elif "powers" in node:
                terms: dict[tuple[int, ...], float] = {}
                for p, w in zip(np.asarray(node["powers"]), node["weights"], strict=True):
                    key = tuple(sorted(g + 1 for j, g in enumerate(glob) for _ in range(p[j])))
                    terms[key] = terms.get(key, 0.0) + float(w)
                poly.append((terms, float(node["bias"])))
            else:
                w = np.zeros(width_ext)
                for j, g in enumerate(glob):
                    w[g] = float(node["weights"][j])
                weights.append(w)
                biases.append(float(node["bias"]))
            tree.append(
                DagNode(left=child(node["left"]), right=child(node["right"]), logit=n_logits)
            )
            n_logits += 1
        states.append(
            DagState(
                groups=state,
                model=model_id_for(model.state_sensors(state)),
                transitions=[nxt for _, nxt, _ in model.transitions(state)],
                tree=tree,
            )
        )
    onx = _policy_graph(
        model, learner, width_ext, global_of_column, n_logits, weights, biases, poly, trees
    )
    (folder / file).write_bytes(onx.SerializeToString())
    return DagPolicy(
        cost_scale=0.0,
        mean_cost=0.0,
        error=0.0,
        file=file,
        confidence_inputs=uses_conf,
        states=states,
    )


def _policy_graph(
    model: DagClassifier,
    learner: str,
    width: int,
    global_of_column: Mapping[int, int],
    n_logits: int,
    weights: list[npt.NDArray[np.float64]],
    biases: list[float],
    poly: list[tuple[dict[tuple[int, ...], float], float]],
    trees: list[tuple[dict[str, Any], int, list[int]]],
) -> onnx.ModelProto:
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    inp = "features"
    out_width = max(n_logits, 1)  # every decision constant: one unused logit keeps it valid
    if learner == "gbrt" and n_logits:
        nodes.append(_tree_ensemble(trees, n_logits, inp, "logits"))
    elif poly:
        mean = np.zeros(width)
        scale = np.ones(width)
        for c, g in global_of_column.items():
            mean[g] = model.input_mean_[c]
            scale[g] = model.input_scale_[c]
        monos = sorted({k for terms, _ in poly for k in terms}, key=lambda k: (len(k), k))
        degree = max(len(k) for k in monos)
        index = {k: i for i, k in enumerate(monos)}
        W = np.zeros((len(monos), n_logits))
        for j, (terms, _) in enumerate(poly):
            for k, w in terms.items():
                W[index[k], j] += w
        gathers = np.array([[*k, *([0] * (degree - len(k)))] for k in monos], dtype=np.int64).T
        inits += [
            numpy_helper.from_array(mean.astype(np.float32)[None, :], "mean"),
            numpy_helper.from_array(scale.astype(np.float32)[None, :], "scale"),
            numpy_helper.from_array(np.zeros((1, 1), dtype=np.float32), "zero"),
            numpy_helper.from_array(np.ones((1, 1), dtype=np.float32), "one"),
            numpy_helper.from_array(np.array([0], dtype=np.int64), "first"),
            numpy_helper.from_array(W.astype(np.float32), "W"),
            numpy_helper.from_array(np.asarray([b for _, b in poly], dtype=np.float32), "b"),
        ]
        nodes += [
            helper.make_node("Sub", [inp, "mean"], ["centred"]),
            helper.make_node("Div", ["centred", "scale"], ["z"]),
            helper.make_node("Gather", [inp, "first"], ["col0"], axis=1),
            helper.make_node("Mul", ["col0", "zero"], ["zeros"]),
            helper.make_node("Add", ["zeros", "one"], ["ones"]),
            helper.make_node("Concat", ["ones", "z"], ["z1"], axis=1),
        ]
        factors = []
        for d in range(degree):
            inits.append(numpy_helper.from_array(gathers[d], f"idx{d}"))
            nodes.append(helper.make_node("Gather", ["z1", f"idx{d}"], [f"g{d}"], axis=1))
            factors.append(f"g{d}")
        prod = factors[0]
        for d, f in enumerate(factors[1:], start=1):
            nodes.append(helper.make_node("Mul", [prod, f], [f"prod{d}"]))
            prod = f"prod{d}"
        nodes += [
            helper.make_node("MatMul", [prod, "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
        ]
    else:
        if not weights:
            weights.append(np.zeros(width))
            biases.append(0.0)
        matrix = np.stack(weights, axis=1).astype(np.float32)
        inits += [
            numpy_helper.from_array(matrix, "W"),
            numpy_helper.from_array(np.asarray(biases, dtype=np.float32), "b"),
        ]
        nodes += [
            helper.make_node("MatMul", [inp, "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
        ]
    graph = helper.make_graph(
        nodes,
        "dag_policy",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, out_width])],
        inits,
    )
    onx = helper.make_model(graph, opset_imports=_OPSET if learner == "gbrt" else _OPSET[:1])
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    return onx


def verify_policy(
    path: Path,
    policy: DagPolicy,
    model: DagClassifier,
    x: npt.NDArray[np.float64],
    global_of_column: Mapping[int, int],
) -> None:
    """Every state's exported decision (ONNX logits + tree) equals the fitted policy's on
    ``x``, except where the ONNX margin is within float32 rounding of 0 (<= 1e-3); and every
    ONNX logit equals its node's margin computed from the exported arrays in float64 on the
    float32-rounded rows (trees: within 1e-4 relative, so a single split taken differently
    fails; linear and polynomial: 1e-3 relative). With confidence inputs the graph is run
    per state, with that state's classifier's confidence in the last two columns (as the
    runtime feeds it)."""
    conf = 2 if policy.confidence_inputs else 0
    inputs = np.zeros((len(x), len(global_of_column) + conf), dtype=np.float32)
    for c, g in global_of_column.items():
        inputs[:, g] = x[:, c]
    graph = path.read_bytes()
    logits = onnx_probabilities(graph, inputs)
    x32 = x.astype(np.float32).astype(np.float64)
    for state_spec in policy.states:
        state = state_spec.groups
        cols = model.state_columns(state)
        if conf:
            inputs[:, -conf:] = model.policy_input(state, x32[:, cols])[:, -conf:]
            logits = onnx_probabilities(graph, inputs)
        nodes = model.policy_nodes(state)
        internal = [n for n in nodes if "action" not in n]
        for node, spec in zip(internal, state_spec.tree, strict=True):
            if spec.logit is None:
                continue
            want = node_margin(node, model.policy_input(state, x32[:, cols]))
            got = logits[:, spec.logit].astype(np.float64)
            rel = 1e-4 if "trees" in node else 1e-3
            off = np.abs(got - want) > rel * np.maximum(1.0, np.abs(want))
            if off.any():
                worst = float(np.max(np.abs(got - want)))
                raise DagExportMismatch(
                    f"DAG policy {path.name}, state {state}, logit {spec.logit}: ONNX differs "
                    f"from the exported node by up to {worst:.3g} on {int(off.sum())} of "
                    f"{len(x)} rows; nothing written"
                )
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
