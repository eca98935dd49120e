"""Gating (paper 001) as ONNX: a fitted gated system becomes a bundle's operating point.

A fitted gated system (:class:`~training.gating.AdaptLin`, :class:`~training.gating.L1Baseline`,
:class:`~training.gating.AdaptGbrt`, GreedyMiser) becomes one operating point of a bundle's
``gating`` strategy: a gate g over its own columns (ONNX, one score; above ``threshold`` the
item goes to f0), a low-cost model f1 over its own columns (ONNX probabilities, or a constant
prior when it uses none) and the shared high-cost model f0. Every exported graph is checked
against the fitted estimator before it is used (:class:`GatingExportMismatch`): on the check rows
the graph, fed their float32, must give what the fitted estimator gives on the rows themselves,
up to ``ATOL``, on every row except those :mod:`training.export.trees` and
:func:`linear_margin_rows` explain (a value within a float32 rounding of a split threshold, a
linear gate score within float32 rounding of its threshold).

The module stays whole (over 450 lines): every exporter here is checked by the same rows and
tolerances (:func:`check_rows`, :func:`linear_margin_rows`, ``ATOL``), so the export and
verification halves change together.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightgbm as lgb
import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from service.types import FloatArray
from training.export.sklearn import ATOL, export_classifier, onnx_probabilities
from training.export.trees import Float32Splits, lightgbm_float32_splits
from training.gating import AdaptGbrt, AdaptLin, L1Baseline
from training.gating.confidence import ConfidenceGate

Gated = AdaptLin | L1Baseline | AdaptGbrt | ConfidenceGate
_OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]


class GatingExportMismatch(RuntimeError):
    """An exported gate or model disagrees with the fitted estimator: nothing is written."""


# --------------------------------------------------------------------------------------------
# ONNX graphs
# --------------------------------------------------------------------------------------------


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    width: int,
    output: str,
    out_width: int,
) -> bytes:
    graph = helper.make_graph(
        nodes,
        "budgetserve_gating",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [None, out_width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=_OPSET[:1])
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def linear_softmax_onnx(coef: FloatArray, intercept: FloatArray) -> bytes:
    """``probabilities = softmax(features @ coef + intercept)``; coef is (columns, classes)."""
    inits = [
        numpy_helper.from_array(np.asarray(coef, dtype=np.float32), "W"),
        numpy_helper.from_array(np.asarray(intercept, dtype=np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["features", "W"], ["s0"]),
        helper.make_node("Add", ["s0", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    return _model(nodes, inits, coef.shape[0], "probabilities", coef.shape[1])


def linear_score_onnx(coef: FloatArray, intercept: float) -> bytes:
    """``score = features @ coef + intercept`` as an (N, 1) output."""
    inits = [
        numpy_helper.from_array(np.asarray(coef, dtype=np.float32).reshape(-1, 1), "w"),
        numpy_helper.from_array(np.asarray([intercept], dtype=np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["s0"]),
        helper.make_node("Add", ["s0", "b"], ["score"]),
    ]
    return _model(nodes, inits, coef.shape[0], "score", 1)


def select_columns(model_bytes: bytes, columns: Sequence[int], width: int) -> bytes:
    """A model trained on all ``width`` columns, re-wired to take only ``columns`` (in that
    order): a 0/1 matrix scatters them into a full-width row whose other entries are 0. Exact
    when the model never reads the other columns (trees that never split on them)."""
    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    old = graph.input[0].name
    scatter = np.zeros((len(columns), width), dtype=np.float32)
    for j, c in enumerate(columns):
        scatter[j, c] = 1.0
    wide = "full_width_features"
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = wide
    graph.initializer.append(numpy_helper.from_array(scatter, "column_scatter"))
    graph.node.insert(0, helper.make_node("MatMul", ["features", "column_scatter"], [wide]))
    del graph.input[:]
    graph.input.append(
        helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, len(columns)])
    )
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


#: Recent conversions, keyed by the booster object (held, so its id is not reused), the
#: width and the rows: a sweep exports one f1 for every routing variant of a fit, and the
#: confidence gates export their source's f1 again.
_CONVERTED: dict[tuple[int, int, str], tuple[Any, bytes, Float32Splits]] = {}


def lightgbm_onnx(model: Any, width: int, rows: FloatArray) -> tuple[bytes, Float32Splits]:
    """A LightGBM Booster or LGBMClassifier as ONNX (``probabilities`` without ZipMap for
    classifiers, the raw sum for a regression objective), its split thresholds chosen in
    float32 on the training ``rows`` (:func:`~training.export.trees.lightgbm_float32_splits`),
    and those splits."""
    booster = model.booster_ if isinstance(model, lgb.LGBMModel) else model
    digest = hashlib.sha256(np.ascontiguousarray(rows, dtype=np.float64).tobytes()).hexdigest()
    key = (id(booster), width, digest)
    if key in _CONVERTED and _CONVERTED[key][0] is booster:
        return _CONVERTED[key][1], _CONVERTED[key][2]
    onnx_bytes, splits = _convert_lightgbm(booster, width, rows)
    if len(_CONVERTED) >= 64:
        _CONVERTED.pop(next(iter(_CONVERTED)))
    _CONVERTED[key] = (booster, onnx_bytes, splits)
    return onnx_bytes, splits


def _convert_lightgbm(
    booster: lgb.Booster, width: int, rows: FloatArray
) -> tuple[bytes, Float32Splits]:
    import onnxmltools
    from onnxmltools.convert.common.data_types import FloatTensorType

    rewritten, splits = lightgbm_float32_splits(booster, rows)
    onx = onnxmltools.convert_lightgbm(  # a classifier's booster converts as the classifier
        rewritten,
        initial_types=[("features", FloatTensorType([None, width]))],
        zipmap=False,
        target_opset=15,  # the highest the LightGBM converter supports
    )
    return bytes(onx.SerializeToString()), splits


def _raw_score_booster(booster: lgb.Booster) -> lgb.Booster:
    """The gate booster with its objective renamed ``regression``: its raw score (the sum of
    its trees, g(x)) is then what converters export. The trees are unchanged."""
    renamed = {"objective=": "objective=regression", "[objective: ": "[objective: regression]"}
    lines = []
    for line in booster.model_to_string().splitlines():
        for prefix, replacement in renamed.items():
            if line.startswith(prefix):
                line = replacement
        lines.append(line)
    return lgb.Booster(model_str="\n".join(lines) + "\n")


def _run(model: bytes, x: npt.NDArray[np.float32]) -> FloatArray:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    name = "probabilities" if "probabilities" in outputs else outputs[-1]
    out = session.run([name], {session.get_inputs()[0].name: x})[0]
    return np.asarray(out, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# fitted estimator -> exported parts
# --------------------------------------------------------------------------------------------


@dataclass
class ExportedGate:
    """``onnx`` None: the gate never sends an item to f0. ``splits`` (tree gates) and
    ``linear`` (coef, intercept over ``columns``, raw units; linear gates) explain the rows
    a float32 graph may route otherwise (see :func:`verify_system`)."""

    onnx: bytes | None
    columns: list[int]
    threshold: float = 0.0
    splits: Float32Splits | None = None
    linear: tuple[FloatArray, float] | None = None


@dataclass
class ExportedModel:
    """An ONNX classifier over ``columns``, or (``onnx`` None) a constant ``prior``;
    ``splits``: its tree splits, for tree models."""

    onnx: bytes | None
    columns: list[int]
    prior: list[float] | None = None
    splits: Float32Splits | None = None


@dataclass
class ExportedSystem:
    gate: ExportedGate
    f1: ExportedModel
    always_full: bool = False  # the gate sends every item to f0 (a dominated point)


def _logit(p: float) -> float:
    p = min(max(p, 1e-12), 1.0 - 1e-12)
    return math.log(p / (1.0 - p))


def _export_lin(est: AdaptLin) -> ExportedSystem:
    f1_cols = [int(c) for c in est.f1_features_]
    gate_cols = [int(c) for c in est.gate_features_]
    if f1_cols:
        f1 = ExportedModel(linear_softmax_onnx(est.f1_coef_[f1_cols], est.f1_intercept_), f1_cols)
    else:
        logits = est.f1_intercept_ - np.max(est.f1_intercept_)
        prior = np.exp(logits) / np.exp(logits).sum()
        f1 = ExportedModel(None, [], [float(p) for p in prior])
    threshold = est.routing_threshold()
    if gate_cols and math.isfinite(threshold):
        coef = np.asarray(est.gate_coef_[gate_cols], dtype=np.float64)
        gate = ExportedGate(
            linear_score_onnx(coef, est.gate_intercept_),
            gate_cols,
            threshold,
            linear=(coef, float(est.gate_intercept_)),
        )
        return ExportedSystem(gate, f1)
    return ExportedSystem(
        ExportedGate(None, []), f1, always_full=bool(est.gate_intercept_ > threshold)
    )


def _export_l1(est: L1Baseline) -> ExportedSystem:
    cols = [int(c) for c in est.selected_]
    mean, scale = est.scaler_.mean[cols], est.scaler_.scale[cols]

    def raw(coef: FloatArray, intercept: FloatArray) -> tuple[FloatArray, FloatArray]:
        # z = (x − μ)/σ  ⇒  w_raw = w/σ, b_raw = b − Σ μ w/σ ; coef is (outputs, columns)
        w = (coef / scale).T
        return w, intercept - mean @ w

    if est.f1_ is None:
        f1 = ExportedModel(None, [], [float(p) for p in est.prior_])
    else:
        w, b = raw(est.f1_.coef_, est.f1_.intercept_)
        if w.shape[1] == 1:  # binary logistic regression: softmax over [0, s]
            w, b = np.hstack([np.zeros_like(w), w]), np.concatenate([[0.0], b])
        f1 = ExportedModel(linear_softmax_onnx(w, b), cols)
    if est.gate_ is None:
        routes_all = est.gate_const_ < float(est.gate_threshold)
        return ExportedSystem(ExportedGate(None, []), f1, always_full=routes_all)
    # route when P(correct) < τ  ⇔  −logit P(correct) > −logit τ
    w, b = raw(est.gate_.coef_, est.gate_.intercept_)
    coef, intercept = -w[:, 0], float(-b[0])
    gate = ExportedGate(
        linear_score_onnx(coef, intercept),
        cols,
        threshold=-_logit(est.gate_threshold),
        linear=(coef, intercept),
    )
    return ExportedSystem(gate, f1)


def _export_gbrt(est: AdaptGbrt, rows: FloatArray) -> ExportedSystem:
    k = est.n_features_in_
    f1_cols = [int(c) for c in est.f1_features_]
    booster = est.f1_booster_
    assert booster is not None
    if f1_cols:
        f1_onnx, f1_splits = lightgbm_onnx(booster, k, rows)
        f1 = ExportedModel(select_columns(f1_onnx, f1_cols, k), f1_cols, splits=f1_splits)
    else:  # stumps only: a constant
        f1 = ExportedModel(None, [], [float(p) for p in est.f1_proba(np.zeros((1, k)))[0]])
    gate_booster = est.gate_booster_
    gate_cols = [int(c) for c in est.gate_features_]
    threshold = est.routing_threshold()
    if gate_booster is None or not math.isfinite(threshold):
        return ExportedSystem(ExportedGate(None, []), f1)
    if not gate_cols:
        constant = float(est.gate_score(np.zeros((1, k)))[0])
        return ExportedSystem(ExportedGate(None, []), f1, always_full=constant > threshold)
    gate_onnx, gate_splits = lightgbm_onnx(_raw_score_booster(gate_booster), k, rows)
    return ExportedSystem(
        ExportedGate(
            select_columns(gate_onnx, gate_cols, k), gate_cols, threshold, splits=gate_splits
        ),
        f1,
    )


def confidence_gate_onnx(f1: bytes) -> bytes:
    """f1's graph followed by ``score = -max(probabilities)`` (N, 1): a confidence gate over
    f1's inputs (its other outputs dropped)."""
    model = onnx.load_from_string(f1)
    graph = model.graph
    names = [o.name for o in graph.output]
    source = "probabilities" if "probabilities" in names else names[-1]
    graph.node.extend(
        [
            helper.make_node("ReduceMax", [source], ["top_probability"], axes=[1], keepdims=1),
            helper.make_node("Neg", ["top_probability"], ["score"]),
        ]
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("score", TensorProto.FLOAT, [None, 1]))
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def _export_confidence(est: ConfidenceGate, rows: FloatArray) -> ExportedSystem:
    f1 = _export_gbrt(est.source, rows).f1
    if f1.onnx is None:  # a constant f1 routes all items or none: not a gate
        raise GatingExportMismatch("a confidence gate needs an f1 that reads some feature")
    gate = ExportedGate(
        confidence_gate_onnx(f1.onnx), list(f1.columns), est.routing_threshold(), splits=f1.splits
    )
    return ExportedSystem(gate, f1)


def export_system(est: Gated, rows: FloatArray) -> ExportedSystem:
    """The gate and f1 of a fitted gated system, as ONNX over the columns each one uses.
    ``rows``: the rows it was trained on (tree thresholds are chosen in float32 so that each
    of their values stays on its side of every split)."""
    if isinstance(est, ConfidenceGate):
        return _export_confidence(est, np.asarray(rows, dtype=np.float64))
    if isinstance(est, AdaptGbrt):
        return _export_gbrt(est, np.asarray(rows, dtype=np.float64))
    if isinstance(est, AdaptLin):
        return _export_lin(est)
    return _export_l1(est)


def export_f0(model: Any, width: int, rows: FloatArray) -> ExportedModel:
    """f0 (fitted on all ``width`` columns and the training ``rows``, classes as indices) as
    ONNX probabilities over every column, with its tree splits when it has trees."""
    columns = list(range(width))
    if isinstance(model, lgb.LGBMClassifier | lgb.Booster):
        onnx_bytes, splits = lightgbm_onnx(model, width, np.asarray(rows, dtype=np.float64))
        return ExportedModel(onnx_bytes, columns, splits=splits)
    # scikit-learn trees are exported exact on every float32 input: nothing to explain
    return ExportedModel(export_classifier(model, width), columns)


def system_outputs(est: Gated, X: FloatArray) -> tuple[npt.NDArray[np.bool_], FloatArray]:
    """What the fitted estimator does on rows ``X``: (sent to the high-cost model, f1's
    probabilities)."""
    if isinstance(est, L1Baseline):
        return est.route(X), est._f1_proba_z(est._z(X))
    return est.route(X), est.f1_proba(X)


# --------------------------------------------------------------------------------------------
# checks: the graph on float32 rows against the fitted estimator on the rows
# --------------------------------------------------------------------------------------------

_EPS32 = float(np.finfo(np.float32).eps)


def linear_margin_rows(
    X: FloatArray, coef: FloatArray, intercept: float, threshold: float
) -> npt.NDArray[np.bool_]:
    """Rows whose linear score ``X @ coef + intercept`` is so close to ``threshold`` that
    float32 arithmetic may put it on the other side: within (terms + 4)·ε₃₂ of the sum of
    the magnitudes involved (inputs, weights and the sum each rounded to float32)."""
    Xa = np.asarray(X, dtype=np.float64)
    score = Xa @ coef + intercept
    size = np.abs(Xa) @ np.abs(coef) + abs(intercept) + abs(threshold)
    return np.asarray(np.abs(score - threshold) <= (coef.size + 4) * _EPS32 * size, dtype=np.bool_)


def _rows(mask: npt.NDArray[np.bool_], limit: int = 5) -> str:
    idx = np.flatnonzero(mask)
    shown = ", ".join(str(int(i)) for i in idx[:limit])
    return shown + (", …" if idx.size > limit else "")


def check_rows(
    got: FloatArray,
    expected: FloatArray,
    label: str,
    explained: npt.NDArray[np.bool_] | None = None,
) -> float:
    """The largest |got − expected| over the rows that agree to ``ATOL``. Raises
    :class:`GatingExportMismatch` when the shapes differ or when a row differs that
    ``explained`` (rows with a value within a float32 rounding of a split threshold) does
    not cover: a wrong export, never forgiven by a count."""
    if got.shape != expected.shape:
        raise GatingExportMismatch(
            f"{label} ONNX gives shape {got.shape}, the fitted model {expected.shape}"
        )
    if not got.size:
        return 0.0
    per_row = np.max(np.abs(got - expected).reshape(got.shape[0], -1), axis=1)
    bad = per_row > ATOL
    ok = np.zeros_like(bad) if explained is None else explained
    wrong = bad & ~ok
    if np.any(wrong):
        raise GatingExportMismatch(
            f"{label} ONNX differs from the fitted model by up to {per_row[wrong].max():.3g} "
            f"on {int(wrong.sum())} of {bad.size} check rows (rows {_rows(wrong)}); required: "
            f"within {ATOL} on every row but those with a value within a float32 rounding of "
            f"a split threshold ({int(ok.sum())} here). The export is wrong: nothing is written"
        )
    return float(per_row[~bad].max()) if np.any(~bad) else 0.0


def _splits_rows(splits: Float32Splits | None, X: FloatArray) -> npt.NDArray[np.bool_]:
    if splits is None:
        return np.zeros(X.shape[0], dtype=np.bool_)
    return splits.crossing_rows(X)


def verify_f0(exported: ExportedModel, fitted: Any, X: FloatArray) -> float:
    """f0's graph on float32 rows against the fitted f0 on the rows; raises
    :class:`GatingExportMismatch`. Returns the largest probability deviation."""
    assert exported.onnx is not None
    Xa = np.asarray(X, dtype=np.float64)
    got = onnx_probabilities(exported.onnx, Xa.astype(np.float32)).astype(np.float64)
    expected = np.asarray(fitted.predict_proba(Xa), dtype=np.float64)
    return check_rows(got, expected, "f0", _splits_rows(exported.splits, Xa))


def verify_system(est: Gated, system: ExportedSystem, X: FloatArray, *, label: str) -> float:
    """Run the exported gate and f1 on the float32 of ``X`` and compare with the fitted
    estimator on ``X``; raises :class:`GatingExportMismatch`. Returns the largest probability
    deviation. A row may be answered or routed otherwise only where float32 cannot follow the
    fitted model: a value within a float32 rounding of one of the part's split thresholds, or
    a gate score within float32 rounding of the gate's threshold."""
    Xa = np.asarray(X, dtype=np.float64)
    x32 = Xa.astype(np.float32)
    routed, f1_expected = system_outputs(est, Xa)
    if system.f1.onnx is None:
        assert system.f1.prior is not None
        f1_got = np.tile(np.asarray(system.f1.prior), (X.shape[0], 1))
    else:
        f1_got = _run(system.f1.onnx, x32[:, system.f1.columns])
    err = check_rows(f1_got, f1_expected, f"{label}: f1", _splits_rows(system.f1.splits, Xa))
    gate = system.gate
    if gate.onnx is None:
        got_routed = np.full(X.shape[0], system.always_full)
        explained = np.zeros(X.shape[0], dtype=np.bool_)
    else:
        score = _run(gate.onnx, x32[:, gate.columns])[:, 0]
        got_routed = score > gate.threshold
        explained = _splits_rows(gate.splits, Xa)
        if gate.linear is not None:
            coef, intercept = gate.linear
            explained |= linear_margin_rows(Xa[:, gate.columns], coef, intercept, gate.threshold)
        else:  # a sum of float32 leaf values: within float32 rounding of the threshold
            fitted = est.gate_score(Xa)
            explained |= np.abs(fitted - gate.threshold) <= 1e-5 * (1.0 + np.abs(fitted))
    wrong = (got_routed != routed) & ~explained
    if np.any(wrong):
        raise GatingExportMismatch(
            f"{label}: the exported gate routes {int(wrong.sum())} of {X.shape[0]} check rows "
            f"(rows {_rows(wrong)}) otherwise than the fitted gate; required: the same route "
            f"on every row but those within float32 rounding of a split or of the gate "
            f"threshold ({int(explained.sum())} here). The export is wrong: nothing is written"
        )
    return err
