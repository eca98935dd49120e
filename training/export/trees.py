"""LightGBM split thresholds for float32 ONNX graphs: the exported splits make the fitted decisions.

ONNX's TreeEnsemble operators compare a float32 input with a float32 threshold; LightGBM tests
``x <= t`` on the double value. onnxmltools rounds ``t`` to the nearest float32, which can put
a row on the other side of a split.

scikit-learn trees need nothing here: scikit-learn compares ``float32(x) <= t`` and skl2onnx
stores the largest float32 ``<= t`` for its decision trees and forests
(``skl2onnx.common.tree_ensemble.sklearn_threshold``), which splits every float32 input as the
fitted model does (tests/training/gating/test_export_float32.py pins it).

LightGBM (:func:`lightgbm_float32_splits`): LightGBM puts a threshold between two training
values, at times a hair above one (pima's ``0.177`` splits at ``0.17700000000000002``, below
``float32(0.177)``, which is what the service receives when a client sends ``0.177``); the
nearest float32 of a midpoint can also land on the float32 of the value above it
(``1.0 | 1.00000017`` splits at ``1.00000008``, whose nearest float32 is
``float32(1.00000017)``). No float32 threshold follows LightGBM on every double, so the rule is
about the training values: :func:`partition_thresholds` picks, per split, the float32 threshold
nearest ``t`` that keeps every training value's float32 on the side the double value takes in
the fitted model. It exists unless two training values on either side of ``t`` round to the
same float32 (then the nearest float32 is kept). A value that no training row holds can still
cross: only one within a float32 rounding of ``t`` (:meth:`Float32Splits.crossing_rows` finds
such rows; the export checks allow exactly them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import lightgbm as lgb
import numpy as np
import numpy.typing as npt

from service.types import FloatArray

F32Array = npt.NDArray[np.float32]


def partition_thresholds(thresholds: FloatArray, values: FloatArray) -> F32Array:
    """Float32 thresholds for splits ``x <= t`` on one feature whose training values (sorted,
    unique, finite) are ``values``: the float32 nearest each ``t``, lowered below the float32 of
    the first training value above ``t`` when rounding reached it. Rounding to nearest never
    moves a value at or below ``t`` across; lowering keeps the value above ``t`` above, unless
    that would push the last value at or below ``t`` across (both round to one float32)."""
    t = np.asarray(thresholds, dtype=np.float64)
    t32 = t.astype(np.float32)
    first_above = np.searchsorted(values, t, side="right")
    for i in np.flatnonzero(first_above < values.size):
        right32 = np.float32(values[first_above[i]])
        if t32[i] < right32:
            continue
        lowered = np.nextafter(right32, np.float32(-np.inf))
        left = first_above[i] - 1
        if left < 0 or np.float32(values[left]) <= lowered:
            t32[i] = lowered
    return t32


@dataclass(frozen=True)
class Float32Splits:
    """Every numerical split of an exported LightGBM model: feature, fitted (double) threshold
    and exported float32 threshold."""

    features: npt.NDArray[np.int64]
    fitted: FloatArray
    exported: F32Array

    def crossing_rows(self, X: FloatArray) -> npt.NDArray[np.bool_]:
        """Rows with a value on one side of a fitted split whose float32 lies on the other side
        of the exported one: no float32 graph with these thresholds can follow the fitted model
        on them (for LightGBM: values within a float32 rounding of ``t`` that no training row
        holds, or training values that collide in float32)."""
        Xa = np.asarray(X, dtype=np.float64)
        crossing = np.zeros(Xa.shape[0], dtype=np.bool_)
        for f in np.unique(self.features):
            sel = self.features == f
            x = Xa[:, f]
            x32 = x.astype(np.float32)
            fitted_left = x[:, None] <= self.fitted[sel][None, :]
            exported_left = x32[:, None] <= self.exported[sel][None, :]
            crossing |= np.any(fitted_left != exported_left, axis=1)
        return crossing


# --------------------------------------------------------------------------------------------
# LightGBM
# --------------------------------------------------------------------------------------------


def _tree_blocks(lines: list[str]) -> Iterator[dict[str, int]]:
    """Per tree of a LightGBM model string: the line numbers of its split lines."""
    block: dict[str, int] = {}
    for i, line in enumerate(lines):
        if line.startswith("Tree=") or line.startswith("end of trees"):
            if block:
                yield block
            block = {}
        else:
            key = line.split("=", 1)[0]
            if key in ("split_feature", "threshold", "decision_type"):
                block[key] = i
    if block:
        yield block


def lightgbm_float32_splits(
    booster: lgb.Booster, rows: FloatArray
) -> tuple[lgb.Booster, Float32Splits]:
    """A copy of ``booster`` whose numerical thresholds are float32 values chosen by
    :func:`partition_thresholds` on the training ``rows`` (so a converter's float32 rounding is
    exact), and the splits (fitted and exported thresholds). The copy is for conversion only:
    its double comparisons are not the fitted model's."""
    X = np.asarray(rows, dtype=np.float64)
    values = [np.unique(X[np.isfinite(X[:, f]), f]) for f in range(X.shape[1])]
    lines = booster.model_to_string().splitlines()
    features: list[int] = []
    fitted: list[float] = []
    exported: list[np.float32] = []
    for block in _tree_blocks(lines):
        if set(block) != {"split_feature", "threshold", "decision_type"}:
            continue  # a single-leaf tree
        feat = [int(v) for v in lines[block["split_feature"]].split("=", 1)[1].split()]
        kind = [int(v) for v in lines[block["decision_type"]].split("=", 1)[1].split()]
        raw = lines[block["threshold"]].split("=", 1)[1].split()
        out = list(raw)
        for j, (f, d, text) in enumerate(zip(feat, kind, raw, strict=True)):
            if d & 1:  # categorical: the threshold indexes the category lists
                continue
            t = float(text)
            t32 = partition_thresholds(np.asarray([t]), values[f])[0]
            out[j] = repr(float(t32))
            features.append(f)
            fitted.append(t)
            exported.append(t32)
        lines[block["threshold"]] = "threshold=" + " ".join(out)
    # tree_sizes gives each tree's length in characters, which the new thresholds change;
    # without it LightGBM reads the trees one after another.
    lines = [line for line in lines if not line.startswith("tree_sizes=")]
    rewritten = lgb.Booster(model_str="\n".join(lines) + "\n")
    splits = Float32Splits(
        np.asarray(features, dtype=np.int64),
        np.asarray(fitted, dtype=np.float64),
        np.asarray(exported, dtype=np.float32),
    )
    return rewritten, splits
